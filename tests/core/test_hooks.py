"""Every hook of the contract, called through a PluginHost on the fake backend.

One ``test_hook_<name>`` per spec in ``hookspecs.py`` (``tests/test_hooks_documented.py``
checks that none is missing): each asserts what the fake returns for its own module, and that
it returns ``None`` for a module it does not own.
"""

from __future__ import annotations

import numpy as np
import pytest

from hp_cp_core import DeepSeekV4CPConfig, LayerSpec, build_rank_plan
from hp_cp_core.config import DeepSeekV4CPContext
from hp_cp_core.plugins import PluginHost
from hp_cp_fake import fake_backend as fb


class Foreign:
    """A module no plugin owns."""


def context(layer: fb.ToyAttention, *, rank: int, cp: int, total: int) -> DeepSeekV4CPContext:
    spec = LayerSpec(compress_ratio=layer.r, window_size=layer.W, has_indexer=layer.r == 4)
    plan = build_rank_plan(
        rank=rank, cp_size=cp, spec=spec, layout_kind="contiguous", total_rows=total
    )
    return DeepSeekV4CPContext(
        cp_rank=rank, cp_size=cp, spec=spec, plan=plan, config=DeepSeekV4CPConfig(), ops=fb.BACKEND
    )


X = np.random.default_rng(11).normal(size=(30, 6))


def test_hook_hp_cp_backend(host: PluginHost) -> None:
    assert host.pm.hook.hp_cp_backend(module=fb.ToyAttention()) == [fb.BACKEND]
    assert host.pm.hook.hp_cp_backend(module=Foreign()) == []
    assert fb.hp_cp_backend(Foreign()) is None
    assert host.choose_backend(fb.ToyAttention()) == ("fake", fb.BACKEND)


@pytest.mark.parametrize("r, grid", [(0, "per_document"), (4, "global"), (128, "per_document")])
def test_hook_hp_cp_layer_spec(host: PluginHost, r: int, grid: str) -> None:
    layer = fb.ToyAttention(compress_ratio=r, window_size=7, packed_grid=grid)
    expected = LayerSpec(compress_ratio=r, window_size=7, has_indexer=r == 4, packed_grid=grid)
    assert host.pm.hook.hp_cp_layer_spec(module=layer) == expected
    assert host.hooks.layer_spec(layer) == expected
    assert host.pm.hook.hp_cp_layer_spec(module=Foreign()) is None


def test_hook_hp_cp_extract_ori_kv(host: PluginHost) -> None:
    _, key, _ = fb.ToyAttention().project(X)
    assert host.pm.hook.hp_cp_extract_ori_kv(module=fb.ToyAttention(), key=key) is key
    assert host.hooks.extract_ori_kv(fb.ToyAttention(), key) is key
    assert host.pm.hook.hp_cp_extract_ori_kv(module=Foreign(), key=key) is None


@pytest.mark.parametrize("r", [4, 128])
def test_hook_hp_cp_compress_main(host: PluginHost, r: int) -> None:
    layer = fb.ToyAttention(compress_ratio=r)
    total = 300 if r == 128 else 30
    x = np.random.default_rng(r).normal(size=(total, 6))
    whole = layer.compress(x, 0, layer.wc)
    for rank in range(3):  # rank 1 and 2 read x rows of earlier ranks (their halo)
        call = context(layer, rank=rank, cp=3, total=total)
        plan = call.plan
        halo_x = x[plan.x.halo_rows] if plan.x.n_halo else None
        out = host.pm.hook.hp_cp_compress_main(
            module=layer, x=x[plan.local_rows], halo_x=halo_x, call=call
        )
        np.testing.assert_allclose(out, whole[plan.owned_slots], rtol=0, atol=1e-12)
        assert out.shape == (plan.n_owned, layer.d)
    call = context(layer, rank=0, cp=1, total=total)
    assert host.pm.hook.hp_cp_compress_main(module=Foreign(), x=x, halo_x=None, call=call) is None


def test_hook_hp_cp_compress_indexer(host: PluginHost) -> None:
    layer = fb.ToyAttention(compress_ratio=4)
    whole = layer.compress(X, 0, layer.wci)
    for rank in range(2):
        call = context(layer, rank=rank, cp=2, total=30)
        plan = call.plan
        halo_x = X[plan.x.halo_rows] if plan.x.n_halo else None
        out = host.hooks.compress_indexer(layer, X[plan.local_rows], halo_x, call)
        np.testing.assert_allclose(out, whole[plan.owned_slots], rtol=0, atol=1e-12)
    assert (
        host.pm.hook.hp_cp_compress_indexer(module=Foreign(), x=X, halo_x=None, call=call) is None
    )


@pytest.mark.parametrize("r", [0, 4, 8])
def test_hook_hp_cp_run_attention(host: PluginHost, r: int) -> None:
    layer = fb.ToyAttention(compress_ratio=r, window_size=9)
    ref = fb.single_device(layer, X)
    q, k, qi = layer.project(X)
    for rank, cp in [(0, 1), (1, 2), (2, 3)]:
        call = context(layer, rank=rank, cp=cp, total=30)
        plan = call.plan
        if r:
            n = plan.n_needed_slots
            call = call.replace(
                cmp_kv_global=layer.compress(X, 0, layer.wc)[:n],
                cmp_idx_global=layer.compress(X, 0, layer.wci)[:n] if r == 4 else None,
            )
        rows = plan.local_rows
        out = host.pm.hook.hp_cp_run_attention(
            module=layer,
            query=q[rows],
            ori_ext=k[plan.window.ext_rows],
            x=X[rows],
            qr=qi[rows],
            call=call,
        )
        np.testing.assert_allclose(out, ref[rows], rtol=1e-12, atol=1e-12)
    assert (
        host.pm.hook.hp_cp_run_attention(
            module=Foreign(), query=q, ori_ext=k, x=X, qr=qi, call=call
        )
        is None
    )


def test_a_tryfirst_plugin_takes_over_one_stage(host: PluginHost) -> None:
    """firstresult: a narrower plugin can replace one stage and leave the rest to the fake."""
    from hp_cp_core import hookimpl

    class FusedKV:
        @hookimpl(tryfirst=True)
        def hp_cp_extract_ori_kv(self, module, key):
            return key * 2 if isinstance(module, fb.ToyAttention) else None

    host.add(FusedKV(), "fused")
    key = np.ones((3, 5))
    np.testing.assert_array_equal(host.hooks.extract_ori_kv(fb.ToyAttention(), key), key * 2)
    assert host.hooks.layer_spec(fb.ToyAttention()) == LayerSpec(
        compress_ratio=4, window_size=8, has_indexer=True
    )
    assert host.pm.hook.hp_cp_extract_ori_kv(module=Foreign(), key=key) is None

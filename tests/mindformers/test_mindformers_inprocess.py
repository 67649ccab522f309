"""The mindformers backend in one process (MindSpore CPU, PyNative): plugin discovery without
importing MindSpore, backend choice, mesh errors, cp = 1 keeping the cell's own path, the
adapter's attribute mapping, and the full CP stage pipeline on a group of one (every hook,
plan index array and op runs; only the collectives are trivial) against the cell."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
import warnings

import numpy as np
import pytest
from mf_require import mindspore_or_skip

ms = mindspore_or_skip()

import mf_reference as ref  # noqa: E402
from mindspore import Tensor, mint, nn  # noqa: E402

from hp_cp_core import (  # noqa: E402
    BackendNotFoundError,
    DeepSeekV4CPConfig,
    DeepSeekV4CPForward,
    HpCpError,
    disable_cp,
    enable_cp,
)
from hp_cp_core.plugins import PluginHost  # noqa: E402
from hp_cp_mindformers import (  # noqa: E402
    MindFormersDeepSeekV4CSAAdapter,
    _plugin,
    patch_deepseek_v4_compressed_sparse_attention_forward,
    patch_mindformers_deepseek_v4_csa_forward,
)
from hp_cp_mindformers.adapter import adapter_for  # noqa: E402
from hp_cp_mindformers.backend import (  # noqa: E402
    Capabilities,
    MeshInfo,
    MindSporeBackend,
    MindSporeGroup,
    resolve_mesh,
)

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")


class Mesh1:
    """A HyperParallel-style mesh of one rank (no communication needed)."""

    ndim = 1

    def size(self) -> int:
        return 1

    def get_local_rank(self) -> int:
        return 0

    def get_group(self) -> str:
        raise AssertionError("a mesh of one rank needs no communication group")


class Mesh2D(Mesh1):
    ndim = 2
    mesh_dim_names = ("dp", "cp")


@pytest.fixture
def host() -> PluginHost:
    h = PluginHost(autoload=False)
    h.add(_plugin, "mindformers")
    return h


def make_cell(r: int, *, train: bool = False, seed: int = 3) -> ref.CompressedSparseAttention:
    cfg = ref.ReferenceCSAConfig(dsa_indexer_loss_coeff=1.0 if train else 0.0, seed=seed)
    cell = ref.CompressedSparseAttention(cfg, None, 1, compress_ratio=r)
    cell.set_train(train)
    return cell


def inputs(s: int, b: int, seed: int = 0) -> tuple[Tensor, ...]:
    rng = np.random.default_rng(seed)
    shapes = [(s, b, 4, 32), (s, b, 1, 32), (s, b, 64), (s, b, 48)]
    return tuple(Tensor(rng.standard_normal(sh).astype(np.float32)) for sh in shapes)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


# --------------------------------------------------------------------------------------------
# discovery and backend choice


def test_loading_the_entry_point_imports_no_mindspore() -> None:
    script = textwrap.dedent(
        """
        import json, sys, importlib.metadata as md
        ep = [e for e in md.entry_points(group="hp_cp") if e.name == "mindformers"][0]
        plugin = ep.load()
        import hp_cp_mindformers
        from hp_cp_core.plugins import PluginHost
        host = PluginHost(autoload=False)
        host.add(plugin, "mindformers")
        claimed = plugin.hp_cp_backend(module=object())
        print(json.dumps({"ms": "mindspore" in sys.modules, "claimed": claimed is not None,
                          "ok": [s.name for s in host.installed()]}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.splitlines()[-1])
    assert report == {"ms": False, "claimed": False, "ok": ["mindformers"]}


def test_backend_claims_csa_cells_only(host: PluginHost) -> None:
    cell = make_cell(4)
    name, backend = host.choose_backend(cell)
    assert name == "mindformers" and isinstance(backend, MindSporeBackend)
    with pytest.raises(BackendNotFoundError, match="no hp_cp backend accepts"):
        host.choose_backend(nn.Dense(2, 2))

    class Model(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.a = make_cell(0)
            self.b = make_cell(128)
            self.proj = nn.Dense(2, 2)

    model = Model()
    assert backend.find_layers(model) == [model.a, model.b]
    assert adapter_for(model.proj) is None and adapter_for(object()) is None


def test_mesh_errors_say_what_to_pass(host: PluginHost) -> None:
    cell = make_cell(0)
    with pytest.raises(HpCpError, match="HyperParallel-style 1-D mesh"):
        enable_cp(cell, 42, plugins=host)
    with pytest.raises(HpCpError, match=r"1-D mesh.*mesh\['cp'\]"):
        enable_cp(cell, Mesh2D(), plugins=host)
    with pytest.raises(HpCpError, match="mindspore.communication.init"):
        resolve_mesh("no_such_group")
    assert "construct" not in cell.__dict__


# --------------------------------------------------------------------------------------------
# cp = 1 and the public API


@pytest.mark.parametrize("patch", ["enable_cp", "patch_mf", "patch_compat"])
def test_cp1_keeps_the_cells_own_path(host: PluginHost, patch: str) -> None:
    cell = make_cell(4)
    q, k, x, qr = inputs(16, 2)
    want = cell(q, k, x, qr).asnumpy()
    if patch == "enable_cp":
        handle = enable_cp(cell, Mesh1(), plugins=host)
    elif patch == "patch_mf":
        handle = patch_mindformers_deepseek_v4_csa_forward(cell, cp_mesh=Mesh1())
    else:
        handle = patch_deepseek_v4_compressed_sparse_attention_forward(cell, cp_mesh=Mesh1())
    assert handle.backend_name == "mindformers" and handle.cp_size == 1
    assert "construct" not in cell.__dict__  # the original path
    got = cell(handle.shard(q, 0), handle.shard(k, 0), handle.shard(x, 0), handle.shard(qr, 0))
    np.testing.assert_array_equal(handle.unshard(got, 0).asnumpy(), want)
    assert handle.shard(np.arange(16), 0).tolist() == list(range(16))
    assert handle.stats()["cp_size"] == 1
    disable_cp(handle)
    assert getattr(cell, "_hp_cp_handle", None) is None
    assert "_hp_cp_adapter" not in cell.__dict__  # the patch functions' adapter goes too


def test_adapter_maps_the_cell(host: PluginHost) -> None:
    cell = make_cell(4)
    adapter = MindFormersDeepSeekV4CSAAdapter(cell)
    assert adapter.compress_ratio == 4 and adapter.window_size == cell.window_size == 8
    assert adapter.has_indexer and adapter.force_unfused
    spec = host.hooks.layer_spec(cell)
    assert (spec.compress_ratio, spec.window_size, spec.has_indexer) == (4, 8, True)
    assert spec.packed_grid == "global" and spec.force_unfused
    key = Tensor(np.ones((5, 2, 1, 32), np.float32))
    assert tuple(adapter.extract_ori_kv(key).shape) == (5, 2, 32)
    hca = host.hooks.layer_spec(make_cell(128))
    assert (hca.compress_ratio, hca.has_indexer) == (128, False)
    swa = host.hooks.layer_spec(make_cell(0))
    assert (swa.compress_ratio, swa.has_indexer) == (0, False)


def test_force_unfused_falls_back_to_apply_dsa_kernel_fusion() -> None:
    """mindformers 2.1.0 has no ``force_unfused``; its switch is ``apply_dsa_kernel_fusion``."""
    cell = make_cell(128)
    object.__delattr__(cell, "force_unfused")
    adapter = MindFormersDeepSeekV4CSAAdapter(cell)
    assert adapter.force_unfused is True  # apply_dsa_kernel_fusion=False
    cell.apply_dsa_kernel_fusion = True
    assert adapter.force_unfused is False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert adapter.layer_spec().force_unfused is False
    assert any("unfused small-op path" in str(w.message) for w in caught)


class SubclassedCell(ref.CompressedSparseAttention):
    """Defined in a module without the cell's helpers (``unfused_compressed_sparse_attn``)."""


def test_helpers_come_from_the_cell_class_or_its_bases() -> None:
    from hp_cp_mindformers.adapter import _primitive

    cell = make_cell(4)
    assert _primitive(cell, "parse_cu_seqlens") is ref.parse_cu_seqlens
    sub = SubclassedCell(ref.ReferenceCSAConfig(), None, 1, compress_ratio=4)
    assert _primitive(sub, "unfused_compressed_sparse_attn") is ref.unfused_compressed_sparse_attn
    assert MindFormersDeepSeekV4CSAAdapter(sub).layer_spec().compress_ratio == 4
    lookalike = types.SimpleNamespace(compress_ratio=0, window_size=8, force_unfused=True)
    with pytest.raises(HpCpError, match="no module of its classes defines"):
        MindFormersDeepSeekV4CSAAdapter(lookalike).layer_spec()


def test_global_actual_seq_len_becomes_cu_seqlens() -> None:
    adapter = MindFormersDeepSeekV4CSAAdapter(make_cell(4))
    q = Tensor(np.zeros((8, 1, 4, 32), np.float32))
    ends = Tensor(np.array([5, 11, 16, 16], np.int32))  # padded with repeats, global (2 x 8)
    assert adapter.cu_seqlens(ends, q, 2).tolist() == [0, 5, 11, 16]
    assert adapter.cu_seqlens(np.array([3, 9]), q, 2).tolist() == [0, 3, 9, 16]  # tail doc
    assert adapter.cu_seqlens(Tensor(np.array([16], np.int32)), q, 2) is None  # one document
    assert adapter.cu_seqlens(None, q, 2) is None
    with pytest.raises(HpCpError, match="batch 1"):
        adapter.cu_seqlens(ends, Tensor(np.zeros((8, 2, 4, 32), np.float32)), 2)


# --------------------------------------------------------------------------------------------
# the CP stage pipeline on a group of one


def run_pipeline(host: PluginHost, cell: nn.Cell, ops_in: tuple, asl, *, chunk: int = 5):
    group = MindSporeGroup(MeshInfo(None, 0, 1), Capabilities("CPU", True, False, False))
    backend = MindSporeBackend(_plugin.find_layers, _plugin.install)
    spec = host.hooks.layer_spec(cell)
    fwd = DeepSeekV4CPForward(
        cell, host.hooks, backend, group, spec, DeepSeekV4CPConfig(query_chunk=chunk)
    )
    cu = MindFormersDeepSeekV4CSAAdapter(cell).cu_seqlens(asl, ops_in[0], 1)
    return fwd, cu


CASES = [(r, packed) for r in (0, 4, 128) for packed in (False, True)]


@pytest.mark.parametrize(
    ("r", "packed"), CASES, ids=[f"r{r}-{'packed' if p else 'padded'}" for r, p in CASES]
)
def test_cp_stages_match_the_cell(host: PluginHost, r: int, packed: bool) -> None:
    s = 160 if r == 128 else 28
    cell = make_cell(r)
    q, k, x, qr = inputs(s, 1 if packed else 2, seed=r)
    ends = (3, 30, 100, s, s) if r == 128 else (2, 3, 13, 21, s)
    asl = Tensor(np.array(ends, np.int32)) if packed else None
    params = cell.trainable_params()
    cot = Tensor(np.random.default_rng(9).standard_normal(q.shape).astype(np.float32))
    outs = []

    def loss_cell(*a):
        outs.append(cell(*a, asl))
        return (outs[-1] * cot).sum()

    fwd, cu = run_pipeline(host, cell, (q, k, x, qr), asl)

    def loss_cp(*a):
        outs.append(fwd(*a, cu_seqlens=cu))
        return (outs[-1] * cot).sum()

    grad = (0, 1, 2, 3)
    _, (gi_ref, gp_ref) = ms.value_and_grad(loss_cell, grad, params)(q, k, x, qr)
    _, (gi, gp) = ms.value_and_grad(loss_cp, grad, params)(q, k, x, qr)
    assert rel(outs[1].asnumpy(), outs[0].asnumpy()) <= 1e-5
    for a, b in [*zip(gi, gi_ref), *zip(gp, gp_ref)]:
        assert rel(a.asnumpy(), b.asnumpy()) <= 1e-4


def test_cp_stages_match_the_cell_with_the_indexer_loss(host: PluginHost) -> None:
    cell = make_cell(4, train=True)
    q, k, x, qr = inputs(28, 1, seed=5)
    asl = Tensor(np.array([2, 3, 13, 21, 28], np.int32))
    params = cell.trainable_params()
    _, gp_ref = ms.value_and_grad(lambda *a: cell(*a, asl).sum(), None, params)(q, k, x, qr)
    loss_ref = float(cell.last_indexer_loss.asnumpy())
    fwd, cu = run_pipeline(host, cell, (q, k, x, qr), asl)
    _, gp = ms.value_and_grad(lambda *a: fwd(*a, cu_seqlens=cu).sum(), None, params)(q, k, x, qr)
    assert abs(float(cell.last_indexer_loss.asnumpy()) - loss_ref) <= 1e-5 * abs(loss_ref)
    names = [p.name for p in params]
    for name, a, b in zip(names, gp, gp_ref):
        assert rel(a.asnumpy(), b.asnumpy()) <= 1e-4, name
    # the indexer learns from its loss: its gradients are not all zero
    assert any(np.abs(a.asnumpy()).max() > 0 for n, a in zip(names, gp) if "indexer" in n)


def test_empty_slices_stay_differentiable() -> None:
    """``narrow(t, 0, 0)`` / an empty index give ``t[n:n]`` (``t[0:0]``'s CPU backward fails)."""
    backend = MindSporeBackend(_plugin.find_layers, _plugin.install)
    t = Tensor(np.arange(6, dtype=np.float32).reshape(3, 2))

    def f(a):
        empty = backend.narrow(a, 0, 0)
        none = backend.index_rows(a, np.zeros(0, np.int64))
        return (backend.cat([empty, none, a]) ** 2).sum()

    g = ms.grad(f)(t)
    np.testing.assert_array_equal(g.asnumpy(), 2 * t.asnumpy())
    assert backend.split_features(mint.ones((2, 5)), [2, 3])[1].shape == (2, 3)
    assert tuple(backend.pad_rows(t, 5).shape) == (5, 2)


def test_pad_dim_extends_a_dimension_with_a_value() -> None:
    """``handle.shard(..., pad_value=...)``'s op: labels padded with the ignore index."""
    backend = MindSporeBackend(_plugin.find_layers, _plugin.install)
    x = Tensor(np.arange(6, dtype=np.float32).reshape(1, 3, 2))
    np.testing.assert_array_equal(
        backend.pad_dim(x, 1, 5, -7.0).asnumpy()[0, :, 0], [0, 2, 4, -7, -7]
    )
    labels = Tensor(np.arange(3, dtype=np.int64).reshape(1, 3))
    padded = backend.pad_dim(labels, -1, 4, -100)
    assert padded.dtype == labels.dtype
    np.testing.assert_array_equal(padded.asnumpy(), [[0, 1, 2, -100]])
    assert backend.pad_dim(labels, 1, 3, 0) is labels


@pytest.mark.parametrize("all_gather", [True, False], ids=["allgather", "allreduce"])
def test_meta_all_gather_is_exact_for_int64(all_gather: bool) -> None:
    """CPU AllGather truncates int64 and AllReduce takes floats only: meta travels as int32
    pairs (AllGather) or 16-bit chunks in float32 (AllReduce form), both exact."""

    class Tiled(MindSporeGroup):
        def gather_forward(self, t, kind):  # what every rank sees when all send ``t``
            self.count(kind, 0, 0)
            return mint.cat([t] * self.size, 0)

    caps = Capabilities("CPU", all_gather, False, False)
    group = Tiled(MeshInfo("g", 1, 3), caps)
    values = np.array([-5, 2**40 + 3, 7, -(2**62), 0], dtype=np.int64)
    np.testing.assert_array_equal(group.all_gather_meta(values), np.tile(values, (3, 1)))
    assert group.stats()["collectives"] == {"meta": 1}


def test_reference_compressor_backward_with_one_block() -> None:
    """4 <= S < 8 rows give one r = 4 block (a CP segment often does): the overlap shift must
    not take a ``[0:0]`` slice (its CPU backward fails on MindSpore 2.10)."""
    cell = make_cell(4)
    q, k, x, qr = inputs(6, 1)
    grads = ms.grad(lambda *a: cell(*a).sum(), (0, 1, 2, 3), cell.trainable_params())(q, k, x, qr)
    assert len(grads[1]) == len(cell.trainable_params())
    assert np.isfinite(grads[0][2].asnumpy()).all()

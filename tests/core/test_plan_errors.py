"""Inputs that cannot be planned raise ``PlanError`` on every rank, before any exchange, and
bad options raise ``HpCpError``; each message says what was got, what was expected, the fix."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from hp_cp_core import (
    DeepSeekV4CPConfig,
    HpCpError,
    LayerSpec,
    PlanError,
    build_rank_plan,
    disable_cp,
    enable_cp,
)
from hp_cp_core.layout import Documents, SequenceLayout
from hp_cp_core.plugins import PluginHost
from hp_cp_fake import fake_backend as fb


def run_each_rank(host: PluginHost, cp: int, inputs, *, r: int = 4, layout: str = "contiguous"):
    """Run the toy layer on every rank with ``inputs(rank) -> (x_local, cu)``; collect errors.

    Returns one entry per rank: the exception it raised, or ``None``. Also returns the seconds
    taken, so a hang (the fake's barrier gives up after 60 s) shows up as a failure.
    """
    world = fb.FakeWorld(cp)
    config = DeepSeekV4CPConfig(layout=layout)

    def rank_fn(rank: int):
        layer = fb.ToyAttention(compress_ratio=r, window_size=6)
        handle = enable_cp(layer, fb.FakeMesh(world, rank), config, plugins=host)
        x_local, cu = inputs(rank)
        try:
            layer(x_local, cu_seqlens=cu)
        except PlanError as exc:
            return exc
        finally:
            disable_cp(handle)
        return None

    t0 = time.perf_counter()
    errors = world.run(rank_fn)
    return errors, time.perf_counter() - t0


def _x(rows: int) -> np.ndarray:
    return np.random.default_rng(rows).normal(size=(rows, 6))


def assert_every_rank_raised(errors, elapsed, message: str) -> None:
    assert elapsed < 20, "a rank waited on a collective the others never joined"
    assert all(isinstance(e, PlanError) for e in errors), errors
    assert [str(e) for e in errors] == [message] * len(errors)


def test_different_local_row_counts_raise_on_every_rank(host: PluginHost) -> None:
    errors, elapsed = run_each_rank(host, 3, lambda k: (_x(3 if k == 1 else 4), None))
    assert_every_rank_raised(
        errors,
        elapsed,
        "CP ranks were given inconsistent inputs: local rows per rank [4, 3, 4]. Expected every "
        "rank to pass the same number of local rows: shard every input with "
        "handle.shard(tensor, seq_dim).",
    )


def test_different_cu_seqlens_raise_on_every_rank(host: PluginHost) -> None:
    def inputs(rank: int):
        return _x(8), np.array([0, 5, 24] if rank == 2 else [0, 9, 24])

    errors, elapsed = run_each_rank(host, 3, inputs)
    assert_every_rank_raised(
        errors,
        elapsed,
        "CP ranks were given inconsistent inputs: cu_seqlens per rank [[0, 9, 24], [0, 9, 24], "
        "[0, 5, 24]]. Expected the same global cu_seqlens (the boundaries of the whole packed "
        "sequence, not of the local rows) on every rank, or None on every rank.",
    )


def test_cu_seqlens_not_ending_at_the_global_length(host: PluginHost) -> None:
    errors, elapsed = run_each_rank(host, 3, lambda k: (_x(4), np.array([0, 5, 10])))
    assert_every_rank_raised(
        errors,
        elapsed,
        "cu_seqlens ends at 10 but the ranks hold 4 x 3 = 12 rows. Pass the global cu_seqlens "
        "(the same on every rank) and each rank's local rows from handle.shard(x, 0).",
    )


def test_malformed_cu_seqlens(host: PluginHost) -> None:
    errors, elapsed = run_each_rank(host, 2, lambda k: (_x(4), np.array([0, 6, 5, 8])))
    assert_every_rank_raised(
        errors,
        elapsed,
        "cu_seqlens must be non-decreasing; got cu_seqlens[2] = 5 < cu_seqlens[1] = 6 in "
        "[0, 6, 5, 8]. Pass cumulative document lengths (torch.cumsum of the lengths, with a "
        "leading 0).",
    )
    spec = LayerSpec(compress_ratio=4)
    with pytest.raises(PlanError, match=re.escape("got [1, 8] ending at 8.")):
        build_rank_plan(
            rank=0,
            cp_size=1,
            spec=spec,
            layout_kind="contiguous",
            total_rows=8,
            cu_seqlens=np.array([1, 8]),
        )
    with pytest.raises(PlanError, match=re.escape("got [0, 1, 2, 3, 4, 5, 6, 7]... ending at 9")):
        Documents.packed(np.arange(10), 8)


def test_load_balanced_with_odd_local_length(host: PluginHost) -> None:
    fix = (
        "a load_balanced layout over cp=2 ranks needs the sequence length to be a multiple of "
        "4; got 6 rows. Pad it at the end: handle.shard(t, dim, pad_value=...) pads tensors "
        "and handle.padding(rows).cu_seqlens(cu) the packed boundaries."
    )
    errors, elapsed = run_each_rank(host, 2, lambda k: (_x(3), None), layout="load_balanced")
    held = " (This rank holds 3 local rows: 6 in all if each of the 2 ranks holds as many.)"
    assert_every_rank_raised(errors, elapsed, fix + held)
    handle = enable_cp(
        fb.ToyAttention(),
        fb.FakeMesh(fb.FakeWorld(2), 0),
        DeepSeekV4CPConfig(layout="load_balanced"),
        plugins=host,
    )
    with pytest.raises(PlanError, match=re.escape(fix)):
        handle.shard(_x(6), 0)
    disable_cp(handle)


def test_contiguous_layout_needs_a_multiple_of_cp() -> None:
    with pytest.raises(PlanError) as err:
        SequenceLayout("contiguous", 3, 10)
    assert str(err.value) == (
        "a contiguous layout over cp=3 ranks needs the sequence length to be a multiple of 3; "
        "got 10 rows. Pad it at the end: handle.shard(t, dim, pad_value=...) pads tensors and "
        "handle.padding(rows).cu_seqlens(cu) the packed boundaries."
    )


def test_rank_and_cp_size_out_of_range() -> None:
    spec = LayerSpec(compress_ratio=0)
    with pytest.raises(PlanError, match=r"^rank 2 is outside the CP group of size 2\.$"):
        build_rank_plan(rank=2, cp_size=2, spec=spec, layout_kind="contiguous", total_rows=8)
    with pytest.raises(PlanError, match=r"^cp size must be >= 1, got 0\.$"):
        SequenceLayout("contiguous", 0, 8)


# -- options ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"layout": "zigzag"},
            "CPConfig.layout='zigzag' is not a layout; expected one of "
            "('contiguous', 'load_balanced').",
        ),
        (
            {"attention_kernel": ""},
            "CPConfig.attention_kernel='' is not a kernel name; pass the name of a "
            "kernel the backend registers (a non-empty string).",
        ),
        ({"query_chunk": 0}, "CPConfig.query_chunk must be >= 1, got 0."),
    ],
)
def test_bad_config_values(kwargs: dict, message: str) -> None:
    with pytest.raises(HpCpError) as err:
        DeepSeekV4CPConfig(**kwargs)
    assert str(err.value) == message


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"compress_ratio": -4},
            "LayerSpec.compress_ratio=-4: expected 0 (sliding window), 1 (a slot per row: DSA) "
            "or a ratio >= 2 such as 4 (CSA) or 128 (HCA).",
        ),
        (
            {"compress_ratio": 1, "overlapping": True},
            "LayerSpec.overlapping=True needs a pooling ratio >= 2, got 1: a slot of ratio 1 is "
            "one row, with no block before it to overlap.",
        ),
        (
            {"compress_ratio": 0, "window_size": 0},
            "LayerSpec.window_size must be >= 1 (or 0, no window, for a layer with compressed "
            "slots: compress_ratio >= 1), got 0 with compress_ratio=0.",
        ),
        (
            {"compress_ratio": 1, "window_size": 0},
            "LayerSpec(compress_ratio=1, window_size=0) needs has_indexer=True: a layer without "
            "a window and without pooling attends only to its indexer's picks (DSA). A dense "
            "causal layer is not a sparse-attention layer hp_cp plans.",
        ),
        (
            {"compress_ratio": 1, "window_size": 0, "has_indexer": True, "reuses": ("kv",)},
            "LayerSpec.reuses=('kv',): expected distinct names out of ('compressed_kv', "
            "'index_keys', 'selection', 'candidates').",
        ),
        (
            {"compress_ratio": 128, "reuses": ("selection",)},
            "LayerSpec.reuses=('selection',) names the indexer's artifacts, so the layer reads "
            "an indexer selection: set has_indexer=True.",
        ),
        (
            {"compress_ratio": 128, "index_block": 4},
            "LayerSpec.index_block > 0 (a two-level indexer) needs has_indexer.",
        ),
        (
            {"compress_ratio": 2, "has_indexer": True, "reuses": ("compressed_kv", "candidates")},
            "LayerSpec.reuses=('compressed_kv', 'candidates') names 'candidates' (the candidate "
            "blocks of a two-level indexer), so the layer selects among them: set index_block "
            ">= 1 (the owner's block size) and do not reuse the selection as well.",
        ),
        (
            {"compress_ratio": 4, "packed_grid": "thd"},
            "LayerSpec.packed_grid='thd': expected one of ('per_document', 'global').",
        ),
        (
            {"compress_ratio": 0, "has_indexer": True},
            "LayerSpec.has_indexer=True needs compress_ratio > 0.",
        ),
    ],
)
def test_bad_layer_spec_values(kwargs: dict, message: str) -> None:
    with pytest.raises(HpCpError) as err:
        LayerSpec(**kwargs)
    assert str(err.value) == message


def test_errors_share_one_base() -> None:
    import hp_cp_core

    for name in (
        "BackendConflictError",
        "BackendLoadError",
        "BackendNotFoundError",
        "PlanError",
    ):
        assert issubclass(getattr(hp_cp_core, name), HpCpError)


def test_packed_on_some_ranks_only_raises_on_every_rank(host: PluginHost) -> None:
    errors, elapsed = run_each_rank(
        host, 2, lambda k: (_x(6), None if k == 0 else np.array([0, 5, 12]))
    )
    assert_every_rank_raised(
        errors,
        elapsed,
        "CP ranks were given inconsistent inputs: cu_seqlens per rank [None, [0, 5, 12]]. "
        "Expected the same global cu_seqlens (the boundaries of the whole packed sequence, not "
        "of the local rows) on every rank, or None on every rank.",
    )

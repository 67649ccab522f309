"""The Triton sparse-attention kernel (``attention_kernel="triton"``) against the small-op
reference: outputs and gradients of q, the KV pool and the sink, then the reference layer
and the HF model under CP at cp = 2, and the plugin seam (a ``tryfirst``
``hp_cp_run_attention``). Without a GPU the kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``, set by conftest.py), so the shapes are tiny.

Skipped when Triton is not installed, unless ``HP_CP_REQUIRE_BACKEND`` contains ``triton``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

if "triton" in os.environ.get("HP_CP_REQUIRE_BACKEND", ""):
    import triton  # noqa: F401 - must be importable: fail, not skip
else:
    pytest.importorskip("triton")

import torch  # noqa: E402
import triton_cases  # noqa: E402
from cases import check_comm_counts, check_parity, result  # noqa: E402
from test_efficient import assert_close, random_case, run  # noqa: E402

import hp_cp_torch.kernels.triton_attention as triton_attention  # noqa: E402
from hp_cp_core import HpCpError  # noqa: E402
from hp_cp_torch.kernels.smallop import sparse_attention_smallop  # noqa: E402
from hp_cp_torch.kernels.triton_attention import sparse_attention_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SHAPES = [
    dict(),  # -1 columns, an all -1 row, duplicates; K = 11
    dict(batch=1, seq=6, heads=20, dim=40, pool=50, k=37),  # two head blocks, D and K padded
    dict(batch=3, seq=5, heads=1, dim=8, pool=2, k=9),  # many duplicates, tiny D
    dict(k=1),
    dict(k=0),
    dict(pool=0, k=4),  # an empty pool: every column -1
    dict(seq=0),
    dict(batch=1, seq=2, heads=64, dim=512, pool=9, k=8),  # V4-Flash: 64 heads x D = 512
]


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


# the defaults (heads-as-M forward, atomics-free backward) and the 0.2.0 kernels
OLD_PATHS = {"fwd": {"LAYOUT": "head_blocks"}, "bwd": {"POOL_GRAD": "atomic"}}
PATHS = {"new": None, "old": OLD_PATHS}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_matches_smallop_fp32(shape, path):
    q, kv, idx, sink = on_device(*random_case(**shape))
    ref = run(sparse_attention_smallop, q, kv, idx, sink, 0.3)
    tuning = PATHS[path]
    got = run(lambda *a: sparse_attention_triton(*a, tuning=tuning), q, kv, idx, sink, 0.3)
    for name, a, b, tol in zip(("out", "dq", "dkv", "dsink"), got, ref, (1e-5, 1e-4, 1e-4, 1e-4)):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.isfinite(a).all(), name
        if b.numel():
            assert_close(a, b, tol)


@pytest.mark.parametrize(
    "tuning",
    [
        {"bwd": {"FUSED": False}},
        {"bwd": {"BLOCK_H": 16, "ALL_HEADS": True}},
        {"fwd": {"BLOCK_K": 16}, "bwd": {"BLOCK_H": 16, "BLOCK_K": 16}, "delta": {"BLOCK_H": 32}},
        {"bwd": {"BLOCK_H": 16, "PARTS_MIB": 0.01}},  # parts of 2 query rows per chunk
        {"bwd": {"BLOCK_H": 16, "ALL_HEADS": True, "PARTS_MIB": 0.0}},  # one row per chunk
        {"bwd": {"BLOCK_H": 16, "ALL_HEADS": True, "POOL_GRAD": "atomic"}},
        {"fwd": {"LAYOUT": "head_blocks", "BLOCK_H": 16}, "bwd": {"POOL_GRAD": "atomic"}},
    ],
    ids=[
        "unfused-backward",
        "all-heads",
        "small-blocks-own-delta-tiles",
        "owned-chunks",
        "owned-all-heads-row-chunks",
        "atomic-all-heads",
        "old-forward-two-head-blocks",
    ],
)
def test_tuning_variants_match_smallop(tuning):
    """The launch overrides the GPU benchmark tries compute the same (K = 37: three blocks
    of 16; H = 20: two head blocks; B = 2)."""
    q, kv, idx, sink = on_device(*random_case(batch=2, seq=6, heads=20, dim=24, pool=30, k=37))
    ref = run(sparse_attention_smallop, q, kv, idx, sink, 0.3)
    got = run(lambda *a: sparse_attention_triton(*a, tuning=tuning), q, kv, idx, sink, 0.3)
    for a, b, tol in zip(got, ref, (1e-5, 1e-4, 1e-4, 1e-4)):
        assert_close(a, b, tol)
    with pytest.raises(HpCpError, match="unknown keys"):
        sparse_attention_triton(q, kv, idx, sink, 0.3, tuning={"fwd": {"FUSED": True}})
    with pytest.raises(HpCpError, match="expected one of"):
        sparse_attention_triton(q, kv, idx, sink, 0.3, tuning={"bwd": {"POOL_GRAD": "x"}})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_launch_fits_the_shared_memory_budget(dtype, heads):
    """At D = 512 (Flash) the default tiles fit 200 KiB of shared memory; an override
    that would not (Triton 3.6 asked 288 KiB for a backward BLOCK_H of 64) is refused."""
    for phase in ("fwd", "bwd", "delta"):
        cfg = triton_attention._launch(dtype, heads, 512, phase, None)
        elem = torch.finfo(dtype).bits // 8
        assert triton_attention._shared_bytes(cfg, phase, elem) <= 200 << 10, (phase, cfg)
    with pytest.raises(HpCpError, match="shared memory"):
        triton_attention._launch(dtype, heads, 512, "bwd", {"bwd": {"BLOCK_H": 64}})


def _backward_twice(tuning):
    q, kv, idx, sink = on_device(*random_case(batch=2, seq=7, heads=20, dim=24, pool=9, k=29))
    return [
        run(lambda *a: sparse_attention_triton(*a, tuning=tuning), q, kv, idx, sink, 0.3)
        for _ in range(2)
    ]


@pytest.mark.parametrize("tuning", [None, {"bwd": {"BLOCK_H": 16, "PARTS_MIB": 0.01}}])
def test_backward_is_bitwise_reproducible(tuning):
    """Two backward runs give the same bits (a pool of 9 rows read by 7 x 29 columns:
    many readers per row, the case atomics would reorder on a GPU)."""
    first, second = _backward_twice(tuning)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_deterministic_mode_takes_the_owned_backward_and_refuses_atomics():
    """Under ``torch.use_deterministic_algorithms(True)`` the default backward runs (and
    matches small-op); the atomics one raises, or warns with ``warn_only``."""
    q, kv, idx, sink = on_device(*random_case(batch=1, seq=5, heads=3, dim=16, pool=8, k=9))
    atomic = {"bwd": {"POOL_GRAD": "atomic"}}
    before = torch.are_deterministic_algorithms_enabled()
    warn_before = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        got = run(sparse_attention_triton, q, kv, idx, sink, 0.3)
        with pytest.raises(HpCpError, match="use_deterministic_algorithms"):
            run(lambda *a: sparse_attention_triton(*a, tuning=atomic), q, kv, idx, sink, 0.3)
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match="POOL_GRAD"):
            run(lambda *a: sparse_attention_triton(*a, tuning=atomic), q, kv, idx, sink, 0.3)
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_before)
    ref = run(sparse_attention_smallop, q, kv, idx, sink, 0.3)
    for a, b, tol in zip(got, ref, (1e-5, 1e-4, 1e-4, 1e-4)):
        assert_close(a, b, tol)


@pytest.mark.parametrize(
    "ratio, layout",
    [(4, "load_balanced"), (8, "contiguous"), (8, "load_balanced"), (0, "load_balanced")],
)
def test_plan_bands_backward_matches_smallop(ratio, layout):
    """Through ``run_sparse_attention``: the window (and HCA) readers come from the plan
    (:class:`hp_cp_core.columns.ColumnBands`, two runs when load balanced), CSA's picks
    from the device sort (r = 4 with an indexer; r = 8 without one reads every visible
    slot, as HCA does); outputs and gradients match the small-op kernel."""
    from hp_cp_core import LayerSpec, build_rank_plan
    from hp_cp_core.columns import PlanColumns
    from hp_cp_torch.attention import run_sparse_attention

    spec = LayerSpec(compress_ratio=ratio, window_size=4, has_indexer=ratio == 4)
    plan = build_rank_plan(rank=1, cp_size=2, spec=spec, layout_kind=layout, total_rows=2 * 16)
    g = torch.Generator().manual_seed(ratio)
    n_ext = plan.window.ext_rows.size
    q = torch.randn(1, plan.n_local, 2, 16, generator=g)
    ori = torch.randn(1, n_ext, 16, generator=g)
    cmp = torch.randn(1, plan.n_needed_slots, 16, generator=g) if ratio else None
    sink = torch.randn(2, generator=g)
    selected = None
    if ratio == 4:  # random picks among the visible slots, with -1 and a duplicate
        width = plan.n_needed_slots
        picks = torch.randint(0, max(width, 1), (1, plan.n_local, 3), generator=g)
        visible = (picks >= torch.as_tensor(plan.cmp_start)[None, :, None]) & (
            picks < torch.as_tensor(plan.cmp_start + plan.cmp_count)[None, :, None]
        )
        selected = torch.where(visible, picks, -1)
        selected[0, -1, 1] = selected[0, -1, 0]
    bands = PlanColumns(plan, n_ext).column_bands(
        0, plan.n_local, n_ext + (cmp.shape[1] if ratio else 0)
    )
    assert bands is not None and bands.first.shape[1] == (2 if layout == "load_balanced" else 1)
    leaves = [t for t in (q, ori, cmp, sink) if t is not None]
    grad = torch.randn(q.shape, generator=g)

    def grads(kernel):
        ins = [t.detach().clone().requires_grad_(True) for t in leaves]
        qq, oo, cc, ss = ins if ratio else (ins[0], ins[1], None, ins[2])
        out = run_sparse_attention(
            qq, oo, cc, plan, selected, ss, 0.25, kernel=kernel, query_chunk=7
        )
        return [out, *torch.autograd.grad(out, ins, grad)]

    for a, b in zip(grads("triton"), grads("smallop")):
        assert_close(a, b, 1e-4)


def test_empty_rows_give_zero_output_and_finite_grads():
    q, kv, idx, sink = on_device(*random_case())
    out, dq, dkv, dsink = run(sparse_attention_triton, q, kv, idx, sink, 0.25)
    assert torch.equal(out[:, 2], torch.zeros_like(out[:, 2]))
    assert torch.equal(dq[:, 2], torch.zeros_like(dq[:, 2]))
    assert all(torch.isfinite(t).all() for t in (dq, dkv, dsink))


def test_shared_int32_index_and_one_input_needing_grad():
    q, kv, idx, sink = on_device(*random_case(batch=2))
    shared = idx[:1].int()  # [1, S, K]: one column list for the whole batch
    assert_close(
        sparse_attention_triton(q, kv, shared, sink, 0.5),
        sparse_attention_smallop(q, kv, shared, sink, 0.5),
        1e-5,
    )
    kvg = kv.clone().requires_grad_(True)  # only the pool needs a gradient
    (got,) = torch.autograd.grad(sparse_attention_triton(q, kvg, idx, sink, 0.5).sum(), [kvg])
    (want,) = torch.autograd.grad(sparse_attention_smallop(q, kvg, idx, sink, 0.5).sum(), [kvg])
    assert_close(got, want, 1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_tracks_fp32(dtype):
    q, kv, idx, sink = on_device(*random_case(seq=9, dim=32, pool=40, k=13, dtype=dtype))
    got = run(sparse_attention_triton, q, kv, idx, sink, 0.2)
    ref32 = run(sparse_attention_smallop, q.float(), kv.float(), idx, sink, 0.2)
    ref16 = run(sparse_attention_smallop, q, kv, idx, sink, 0.2)
    assert [t.dtype for t in got] == [dtype] * 3 + [torch.float32]
    for a, b, c in zip(got, ref32, ref16):
        err = (a.float() - b).abs().max().item()
        assert err <= max(2 * (c.float() - b).abs().max().item(), 2e-2 * b.abs().max().item())


def test_mixed_dtypes_are_a_clear_error():
    q, kv, idx, sink = on_device(*random_case())
    with pytest.raises(HpCpError, match="q and kv_pool of one dtype"):
        sparse_attention_triton(q, kv.double(), idx, sink, 0.5)


def test_missing_triton_or_gpu_is_a_clear_error(monkeypatch):
    assert triton_attention.triton_problem(DEVICE) is None
    assert "runs on CUDA devices" in triton_attention.triton_problem("meta")
    monkeypatch.setattr(triton_attention, "find_spec", lambda name: None)
    problem = triton_attention.triton_problem(DEVICE)
    assert "pip install 'hp-cp-torch[triton]'" in problem
    q, kv, idx, sink = on_device(*random_case())
    with pytest.raises(HpCpError, match="not installed"):
        sparse_attention_triton(q, kv, idx, sink, 0.5)


CPU_WITHOUT_INTERPRETER = """
import torch, torch.distributed as dist
from hp_cp_core import DeepSeekV4CPConfig, HpCpError, enable_cp
from hp_cp_torch.reference import DeepSeekV4Attention, DeepSeekV4AttentionConfig
from hp_cp_torch.kernels.triton_attention import sparse_attention_triton
q = torch.zeros(1, 2, 1, 16); kv = torch.zeros(1, 3, 16); idx = torch.zeros(1, 2, 1).long()
try:
    sparse_attention_triton(q, kv, idx, torch.zeros(1), 1.0)
except HpCpError as e:
    print("kernel:", e)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
layer = DeepSeekV4Attention(DeepSeekV4AttentionConfig(compress_ratio=4))
config = DeepSeekV4CPConfig(attention_kernel="triton", single_rank_bypass=False)
enable_cp(layer, dist.group.WORLD, config)
try:
    layer(torch.randn(1, 8, 64))
except HpCpError as e:
    print("layer:", e)
"""


def test_cpu_without_the_interpreter_is_a_clear_error():
    """Without TRITON_INTERPRET=1 (a fresh process) CPU tensors raise HpCpError naming the
    fix, from the kernel and from a layer under CP (in its input checks, before any
    exchange)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", CPU_WITHOUT_INTERPRETER],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = out.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["kernel", "layer"], out
    for line in lines:
        assert "needs a CUDA GPU" in line and "TRITON_INTERPRET=1" in line, line
    assert "DeepSeekV4Attention under CP" in lines[1]


# ------------------------------------------------------------------ under CP (2 gloo ranks)

SUITE = "triton_cases:triton_suite"


@pytest.mark.slow
@pytest.mark.parametrize("case", triton_cases.CONFIG_CASES, ids=lambda c: c.name)
def test_reference_layer_cp2_matches_single_device(case):
    """``DeepSeekV4CPConfig(attention_kernel="triton")`` against the single-device layer
    (small-op kernel): the same outputs and gradients."""
    per_rank = result(SUITE, 2, case.name)
    check_parity(case, next(r for r in per_rank if r["cp_rank"] == 0))
    check_comm_counts(case, per_rank)


@pytest.mark.slow
@pytest.mark.parametrize("case", triton_cases.PLUGIN_CASES, ids=lambda c: c.name)
def test_plugin_takes_only_the_layers_it_supports(case):
    per_rank = result(SUITE, 2, f"plugin-{case.name}")
    check_parity(case, next(r for r in per_rank if r["cp_rank"] == 0))
    # one call per rank for the sliding-window layer; the CSA layer (indexer) is not taken
    assert [r["plugin_calls"] for r in per_rank] == [0 if case.r == 4 else 1] * 2


@pytest.mark.slow
def test_hf_model_cp2_matches_single_device():
    for res in result(SUITE, 2, "hf"):
        assert res["logits_rel_err"] <= 1e-5 and res["loss_rel_err"] <= 1e-6, res
        assert all(err <= 1e-5 for err in res["attn_out_rel_err"].values()), res
        assert res["grad_presence_mismatch"] == [] and res["grad_rel_err_max"] <= 1e-4, res

"""``hp-cp bench``: the exact measures against per-token definitions, and a small full run."""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib

import numpy as np
import pytest

from hp_cp_core import build_rank_plan
from hp_cp_core.layout import SequenceLayout
from hp_cp_torch.bench import suite
from hp_cp_torch.bench.suite import Shapes, comm_per_rank, work_per_rank
from hp_cp_torch.bench.traffic import (
    FAMILY_KINDS,
    dsa_traffic_measures,
    family_comm_per_rank,
    traffic_measures,
    ulysses_rank_bytes,
)

SMALL = Shapes(hidden=48, head_dim=16, n_heads=2, index_heads=2, index_dim=8, topk=3, window=8)


def brute_lower_bound(seq, cp, ratio, layout, shapes):
    """Per rank: remote window rows, remote-dependent visible slots, and visible slots another
    rank owns (what the point-to-point exchange delivers), by loops."""
    lay = SequenceLayout(layout, cp, seq)
    owner = lay.rank_of(np.arange(seq))
    out = []
    for k in range(cp):
        rows = [t for t in range(seq) if owner[t] == k]
        win = {j for t in rows for j in range(max(0, t - shapes.window + 1), t + 1)}
        win = {j for j in win if owner[j] != k}
        slots, remote = set(), set()
        for j in range(seq // ratio if ratio else 0):
            last = j * ratio + ratio - 1
            dep = j * ratio - (ratio if ratio == 4 and j > 0 else 0)
            visible = any(last <= t for t in rows)
            if visible and any(owner[i] != k for i in range(dep, last + 1)):
                slots.add(j)
            if visible and owner[last] != k:
                remote.add(j)
        out.append((len(win), len(slots), len(remote)))
    return out


@pytest.mark.parametrize("layout", ["contiguous", "load_balanced"])
@pytest.mark.parametrize(
    "seq,cp,ratio", [(64, 4, 4), (48, 4, 4), (40, 4, 4), (24, 3, 4), (48, 8, 0), (96, 2, 4)]
)
def test_lower_bound_matches_per_token_definition(seq, cp, ratio, layout):
    if seq % (2 * cp) and layout == "load_balanced":
        pytest.skip("layout needs S % 2cp == 0")
    c = comm_per_rank(seq, cp, ratio, layout, SMALL)
    width = SMALL.head_dim + (SMALL.index_dim if ratio == 4 else 0)
    for k, (win, slots, remote) in enumerate(brute_lower_bound(seq, cp, ratio, layout, SMALL)):
        assert c["lower_window"][k] == win * SMALL.head_dim * SMALL.elem_bytes
        assert c["lower_slots"][k] == slots * width * SMALL.elem_bytes
        # the plan's window halo is exactly the rows the queries read, and the point-to-point
        # slots exactly the visible ones another rank computes
        assert c["ours_window"][k] == c["lower_window"][k]
        assert c["ours_slots"][k] == remote * width * SMALL.elem_bytes


def test_flash_traffic_against_the_worked_example():
    """MindFormers' CP: S = 131072, cp = 8, bf16."""
    c = comm_per_rank(131072, 8, 4)
    # MF: window tails 7*127*D + compressor tails 7*4*H + 7*4097*(D + Di)
    assert c["mindformers"].max() == (7 * 127 * 512 + 7 * 4 * 4096 + 7 * 4097 * 640) * 2
    # ours: window halo 127 rows of D, x halo of 4 rows, rank 0's 4096 slots point to point
    assert c["ours"][1] == (127 * 512 + 4 * 4096 + 4096 * 640) * 2
    # the all-gather fallback: 4096 slots from each of the 7 peers
    assert c["ours_allgather_fallback"][1] == (127 * 512 + 4 * 4096 + 7 * 4096 * 640) * 2
    assert c["lower"][7] == (127 * 512 + (7 * 4096 + 1) * 640) * 2
    assert (c["ours"] >= c["lower"]).all()
    # Ulysses: q and o all-to-all, KV, x and the query residual all-gathered
    rows = 131072 // 8
    want = 2 * 7 * rows * 64 * 512 // 8 + 7 * rows * (512 + 4096 + 1024)
    assert (c["ulysses"] == want * 2).all() and ulysses_rank_bytes(131072, 8, 4) == want * 2


def test_every_rank_at_its_own_lower_bound():
    """The bench's traffic targets, at a scaled-down S (the ratios hardly depend on S)."""
    res = traffic_measures(16384, 8)
    for lay in ("contiguous", "balanced"):
        for r in (0, 4, 128):
            assert res[f"comm_max_rank_over_own_lower_bound_{lay}_r{r}"] <= 1.05, (lay, r)
            assert res[f"comm_total_over_sum_lower_bounds_{lay}_r{r}"] <= 1.05, (lay, r)
            assert res[f"comm_bytes_unneeded_{lay}_r{r}"] == 0, (lay, r)
    # the all-gather fallback delivers every rank's slots everywhere: far above the bound
    assert res["comm_allgather_fallback_total_over_sum_lower_bounds_contiguous_r4"] > 1.5
    assert res["comm_allgather_fallback_bytes_unneeded_contiguous_r4"] > 0  # rank 0's
    assert res["ulysses_bytes_over_ours_r4"] > 1.0


@pytest.mark.parametrize("layout", ["contiguous", "load_balanced"])
@pytest.mark.parametrize("seq,cp", [(60, 3), (64, 4), (48, 8)])
@pytest.mark.parametrize("kind", sorted(FAMILY_KINDS))
def test_family_traffic_against_per_token_loops(kind, seq, cp, layout):
    """Every new layer kind of the family (DSA full / shared, V4.1 Full / Reindex / Reuse):
    the plan's point-to-point slots are exactly the visible slots another rank owns, the
    bound's slots the visible ones with a remote input, and a layer reusing the compressed KV
    moves no slot (its owner moved them)."""
    spec, big = FAMILY_KINDS[kind]
    shapes = Shapes(hidden=48, head_dim=16, index_dim=8, window=min(big.window, 8))
    spec = dataclasses.replace(spec, window_size=shapes.window)
    c = family_comm_per_rank(seq, cp, spec, layout, shapes)
    r = int(spec.compress_ratio)
    width = (16 if spec.makes_compressed_kv else 0) + (8 if spec.makes_index_keys else 0)
    lay = SequenceLayout(layout, cp, seq)
    owner = lay.rank_of(np.arange(seq))
    for k in range(cp):
        rows = np.flatnonzero(owner == k)
        win = {j for t in rows for j in range(max(0, t - shapes.window + 1), t + 1)}
        remote_window = sum(owner[j] != k for j in win)
        visible = [j for j in range(seq // r) if any((j + 1) * r <= t + 1 for t in rows)]
        remote = sum(owner[j * r + r - 1] != k for j in visible)
        needed = sum(any(owner[i] != k for i in range(j * r, j * r + r)) for j in visible)
        assert c["ours_window"][k] == remote_window * 16 * 2, (kind, k)
        assert c["ours_slots"][k] == remote * width * 2, (kind, k)
        assert c["lower"][k] == (remote_window * 16 + needed * width) * 2, (kind, k)
        if not spec.makes_compressed_kv:  # the plan itself moves nothing for the slots
            plan = build_rank_plan(
                rank=k, cp_size=cp, spec=spec, layout_kind=layout, total_rows=seq
            )
            assert plan.slot_exchange is None and plan.x is None, (kind, k)
            assert c["ours_slots"][k] == 0 and c["ours_x"][k] == 0
        assert c["ours"][k] >= c["lower"][k]


def test_family_every_rank_at_its_own_lower_bound():
    """The family's traffic keys of ``hp-cp bench``: every kind at its bound, and the DSA
    all-gather above ours in total."""
    res = dsa_traffic_measures(16384, 8)
    for lay in ("contiguous", "balanced"):
        for kind in FAMILY_KINDS:
            assert res[f"comm_max_rank_over_own_lower_bound_{lay}_{kind}"] <= 1.05, (lay, kind)
            assert res[f"comm_bytes_unneeded_{lay}_{kind}"] == 0, (lay, kind)
        for kind in ("dsa", "dsa_shared"):
            assert res[f"dsa_allgather_total_bytes_over_ours_{lay}_{kind}"] > 1.3, (lay, kind)
            assert res[f"dsa_allgather_max_rank_bytes_over_ours_{lay}_{kind}"] >= 1.0


def test_work_counts():
    w = work_per_rank(4096, 2, 128, "contiguous", SMALL, query_chunk=64)
    assert w["indexer"].sum() == 0
    assert (w["impl"] >= w["plan"]).all()
    w4 = work_per_rank(4096, 2, 4, "load_balanced", SMALL, query_chunk=64)
    assert (w4["indexer"] > 0).all() and (w4["impl"] >= w4["plan"]).all()


def read_png(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        assert struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])[0] == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + n
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[color]  # matplotlib writes RGBA, the fallback RGB
    row = 1 + (width * channels * depth + 7) // 8
    assert len(zlib.decompress(chunks[b"IDAT"])) == height * row
    return width, height


def test_builtin_png(tmp_path):
    path = str(tmp_path / "chart.png")
    suite._bars_png_fallback([("A_B r4", 1.2, 1.05), ("plan/s", 0.01, 0.2), ("x", 9.0, None)], path)
    width, height = read_png(path)
    assert width > 100 and height > 50


@pytest.mark.slow
def test_bench_main_small(tmp_path, capsys):
    out = tmp_path / "sub" / "bench.json"
    argv = [
        "--out",
        str(out),
        "--seq",
        "4096",
        "--cp",
        "4",
        "--plan-tokens",
        "65536",
        "--plan-docs",
        "8",
        "--saved-rows",
        "256",
        "--saved-heads",
        "2",
        "--check-rows",
        "32",
        "--peak-rows",
        "64",
        "--step-seq",
        "512",
        "--repeat",
        "1",
        "--kernel-repeat",
        "0",
        "--hf-mem-seqs",
        "",
        "--hotpath-steps",
        "0",  # test_hotpath_counts runs it
        "--overlap-seq",
        "0",
    ]
    assert suite.main(argv) == 0
    res = json.loads(out.read_text())
    required = [
        *[
            f"comm_{what}_{lay}_r{r}"
            for what in ("max_rank_over_own_lower_bound", "total_over_sum_lower_bounds")
            for lay in ("contiguous", "balanced")
            for r in (0, 4, 128)
        ],
        *[
            f"{peer}_bytes_over_ours_r{r}"
            for peer in ("mindformers_allgather", "ulysses")
            for r in (0, 4, 128)
        ],
        *[f"work_max_over_mean_{lay}_r{r}" for lay in ("contiguous", "balanced") for r in (4, 128)],
        "plan_build_seconds_s1m_cp8",
        "saved_bytes_efficient_over_smallop",
        "step_time_cp2_over_cp1",
        "cp_enabled_cp1_overhead",
        "desync_record_us",
        "desync_record_over_small_all_gather",
        "step_plain_layer_s",
        *[f"step_time_cp2_over_cp1_{lay}_{ker}" for lay, ker in suite.STEP_VARIANTS],
    ]
    for key in required:
        assert isinstance(res[key], (int, float)) and np.isfinite(res[key]), key
    assert all(isinstance(v, (int, float)) for v in res.values()), "bench.json is numbers only"
    assert res["saved_bytes_efficient_over_smallop"] < 0.15
    assert res["saved_bytes_efficient_real_over_meta_l32"] == 1.0
    for lay, ker in suite.STEP_VARIANTS:
        assert res[f"comm_counted_over_plan_cp2_{lay}_{ker}"] == 1.0
        assert res[f"step_cp2_{lay}_{ker}_max_rel_err"] < 1e-5
        assert res[f"step_cp1_{lay}_{ker}_max_rel_err"] < 1e-5
    read_png(tmp_path / "sub" / "bench.png")
    assert "step_time_cp2_over_cp1" in capsys.readouterr().out


def test_kernel_case_counts_only_attended_columns():
    """The FLOP/s measure's inputs: every query has a full window and ``topk`` distinct
    visible picks at r = 4, so the useful FLOPs are ``3.5 * 4 * B * S * H * K * D``."""
    from hp_cp_torch.bench.kernel import attention_case

    shapes = {"batch": 1, "seq": 64, "heads": 2, "dim": 8, "window": 8, "topk": 8}
    case = attention_case(4, shapes)
    sel, plan = case["selected"], case["plan"]
    assert (sel >= 0).all() and (plan.window_len == 8).all()
    start = plan.cmp_start[None, :, None]
    assert ((sel.numpy() >= start) & (sel.numpy() < start + plan.cmp_count[None, :, None])).all()
    assert all(len(set(row.tolist())) == 8 for row in sel[0])
    assert case["useful_flops"] == 3.5 * 4 * 1 * 64 * 2 * (8 + 8) * 8
    hca = attention_case(128, {**shapes, "seq": 512})
    assert hca["mean_columns"] == 8 + float(hca["plan"].cmp_count.mean())


def test_kernel_measures_every_picks_read_in_one_run(tmp_path, capsys, monkeypatch):
    """The kernel measure runs the banded kernel once per way of reading picks in the same
    run; the headline keys are the default's (``weights``), and ``--merge`` writes the numbers
    into an existing bench.json, keeping its other keys, and the strings into its notes."""
    from hp_cp_torch.bench import kernel as bench_kernel
    from hp_cp_torch.kernels.banded import PICK_READS

    shapes = {"batch": 1, "seq": 64, "heads": 2, "dim": 8, "window": 8, "topk": 8}
    cases = {"r4": (4, 3), "r128": (128, 3)}
    res = bench_kernel.kernel_measures(("banded",), repeat=1, shapes=shapes, cases=cases)
    assert PICK_READS[0] == "weights" and res["attn_banded_default_picks"] == "weights"
    for case in cases:
        for suffix in ("", "_cpu"):
            for picks in PICK_READS:
                value = res[f"attn_flops_over_matmul_{case}_{picks}{suffix}"]
                assert np.isfinite(value) and value > 0
            headline = res[f"attn_flops_over_matmul_{case}{suffix}"]
            assert headline == res[f"attn_flops_over_matmul_banded_{case}{suffix}"]
            assert headline == res[f"attn_flops_over_matmul_{case}_weights{suffix}"]
    out = tmp_path / "bench.json"
    out.write_text(json.dumps({"host_syncs_per_step": 1.0}))
    fake = {"attn_flops_over_matmul_r4": 0.5, "x": "s"}
    monkeypatch.setattr(bench_kernel, "kernel_measures", lambda *a, **k: fake)
    assert bench_kernel.main(["--merge", str(out)]) == 0
    assert json.loads(out.read_text()) == {
        "host_syncs_per_step": 1.0,
        "attn_flops_over_matmul_r4": 0.5,
    }
    assert json.loads((tmp_path / "bench.notes.json").read_text()) == {"x": "s"}
    assert '"x": "s"' in capsys.readouterr().out


def test_bench_refuses_the_hf_measure_without_transformers_before_measuring(
    tmp_path, capsys, monkeypatch
):
    """Without transformers the HF memory measure (on by default) is refused at once, exit 2,
    naming the extra and the switch that skips it; nothing else has run."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else real(name, *a),
    )
    monkeypatch.setattr(suite, "run", lambda args: pytest.fail("measures ran"))
    with pytest.raises(SystemExit) as exc:
        suite.main(["--out", str(tmp_path / "bench.json")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "hp-cp-torch[bench]" in err and "--hf-mem-seqs ''" in err
    assert not (tmp_path / "bench.json").exists()


@pytest.mark.parametrize("true_limit", [700, 3000, 5000, 40000])
def test_longest_fitting_seq_brackets_the_limit_without_far_probes(true_limit, monkeypatch):
    """The search for the longest S that fits: it ends with measured S on both sides of the
    limit within 10% (+ one probe quantum), and never probes past 1.5x the longest S measured
    to fit so far."""
    from hp_cp_torch.bench import memory as bench_memory

    def peak(seq):  # quadratic memory, at the budget (1.0) exactly at true_limit
        return 0.2 + 0.3 * seq / true_limit + 0.5 * (seq / true_limit) ** 2

    probes = []

    def fake_peak(seq, cp):
        fits = [s for s in [512, 1024, 2048, *probes] if peak(s) <= 1.0]
        assert seq <= 1.5 * max(fits) + 1, "a probe far past the budget"
        probes.append(seq)
        return peak(seq)

    monkeypatch.setattr(bench_memory, "_peak", fake_peak)
    start = {s: peak(s) for s in (512, 1024, 2048)}
    fit, over, measured = bench_memory.longest_fitting_seq(4, 1.0, start, max_probes=12)
    assert all(s % bench_memory.SEARCH_QUANTUM == 0 for s in probes)
    if true_limit < 512:
        assert fit == 0
        return
    assert fit <= true_limit and peak(fit) <= 1.0
    assert over is not None and over > true_limit
    assert over <= 1.1 * fit + bench_memory.SEARCH_QUANTUM
    assert set(measured) == {512, 1024, 2048, *probes}


def test_hf_cp_scaling_measures_one_budget_for_both_cp(monkeypatch):
    """``hp-cp bench --long --long-hf``: cp 4 and cp 8 searched under the same per-rank budget;
    a rank that holds what its own rows need fits twice the S at twice the ranks."""
    from hp_cp_torch.bench import memory as bench_memory

    calls = []

    def fake_peak(seq, cp):  # a constant plus a cost per local row
        calls.append((seq, cp))
        return 0.1 + 0.9 * (seq / cp) / 3000

    monkeypatch.setattr(bench_memory, "_peak", fake_peak)
    res = bench_memory.hf_cp_scaling_measures((4, 8), seeds=(4096, 8192), budget=1.0)
    assert res["hf_max_seq_budget_bytes"] == 1.0
    assert {cp for _, cp in calls} == {4, 8}
    for cp in (4, 8):
        fit, over = res[f"hf_max_seq_cp{cp}"], res[f"hf_max_seq_cp{cp}_over"]
        assert fake_peak(fit, cp) <= 1.0 < fake_peak(over, cp)
        assert res[f"hf_step_peak_bytes_cp{cp}_max_rank_s{fit}"] <= 1.0
    assert 1.8 <= res["hf_max_seq_cp8_over_cp4"] <= 2.2


@pytest.mark.slow
def test_hotpath_counts():
    """The hot-path keys of ``hp-cp bench`` (one warm-up and one counted step, 2 ranks): no
    store operation while all goes well, one agreement per model forward (the later layers
    reuse it), the old code's extrapolated store load from the collectives counted."""
    from hp_cp_torch.bench.hotpath import N_LAYERS, hotpath_measures

    res = hotpath_measures(warmup=1, steps=1)
    assert res["store_ops_per_step"] == 0
    assert res["store_ops_per_step_1024_ranks_61_layers"] == 0
    assert res["agreements_per_step"] == res["model_forwards_per_step"] == 1
    assert res["agreements_reused_per_step"] == N_LAYERS - 1
    old = (res["cp_collectives_per_step"] + N_LAYERS - 1) * 61 / N_LAYERS * 1024
    assert res["store_ops_per_step_1024_ranks_61_layers_old"] == old > 0
    # the agreement's gather (the HF value checks ride in it): the one host read per forward
    assert res["host_syncs_per_step"] == res["host_syncs_per_step_agreement"] == 1
    assert res["host_syncs_per_step"] <= res["model_forwards_per_step"]
    # HF's own packed-sequence check on position_ids is the model's, not hp_cp's
    assert res["host_syncs_per_step_model"] >= res["host_syncs_per_step"]


def test_host_read_counter_sees_reads_and_data_shaped_ops():
    """The counter counts what a GPU would wait for: value reads, data-shaped outputs,
    boolean-mask indexing; not plain device ops."""
    import torch

    from hp_cp_torch.bench.hotpath import HostReads

    t = torch.arange(6.0)
    reads = HostReads()
    with reads:
        t.sum().item()
        t.nonzero()
        t[t > 2]
        torch.unique(t)
        bool((t > 0).any())
        t.topk(2)
        t * 2
    assert reads.counts["model"] == 5
    assert reads.counts["cp"] == 0  # no hp_cp frame on the stack


def test_delayed_link_completes_after_its_delay():
    import time

    from hp_cp_torch.bench.overlap import DelayedLink

    class Done:
        def wait(self, *args):
            return True

        def is_completed(self):
            return True

    link = DelayedLink(0.05)
    assert link([]) == [] and link.batches == 0
    (work,) = link([Done()])
    assert not work.is_completed()
    t0 = time.monotonic()
    work.wait()
    assert time.monotonic() - t0 > 0.02 and link.slept > 0.02 and link.batches == 1


def test_device_hotpath_script_parses_its_arguments():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "scripts" / "device_hotpath.py"
    spec = importlib.util.spec_from_file_location("device_hotpath", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = mod.parse_args(["--dry-run", "--steps", "1"])
    assert args.dry_run and args.steps == 1 and args.seq == 256
    assert mod.parse_args([]).out == "bench/device/hotpath.json"
    assert set(mod.PARTS) == {"hf", "csa_triton"}


def _peers_memory(monkeypatch):
    """bench/peers_memory.py, its collectives made local (one rank)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    try:
        import peers_memory
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(peers_memory.dist, "all_reduce", lambda *a, **k: None)
    return peers_memory


def _allocating_step(ran: list[int]):
    import torch

    def step(n: int) -> None:  # n MiB, touched, freed at return; then 1 MiB
        ran.append(n)
        torch.ones(n * (1 << 20) // 4).sum()
        torch.ones(1 << 18).sum()

    return step


def test_step_peaks_measures_each_step_alone(monkeypatch):
    """bench/peers_memory.py's per-step resident method: a warm-up step first, then each
    step's own peak, stopping past the budget."""
    from hp_cp_torch.bench.memory import reset_peak

    if not reset_peak():
        pytest.skip("VmHWM cannot be reset here")
    peers_memory, mib, ran = _peers_memory(monkeypatch), 1 << 20, []
    peaks = peers_memory.step_peaks(_allocating_step(ran), [32, 8, 64, 16], None, None)
    assert ran == [32, 32, 8, 64]  # warm-up, then until the first S over the budget (S = 32's)
    for n in (32, 8, 64):  # each step's own buffer, within a few pages
        assert (n - 2) * mib <= peaks[n] < (n + 24) * mib


def test_live_peaks_counts_the_most_tensor_bytes_alive_at_once(monkeypatch):
    """bench/peers_memory.py's live-tensor method: exactly the largest buffer alive at once
    (the 1 MiB one comes after it is freed), nothing of the previous steps."""
    peers_memory, mib, ran = _peers_memory(monkeypatch), 1 << 20, []
    peaks = peers_memory.live_peaks(_allocating_step(ran), [32, 8, 64, 16], None, None)
    assert ran == [32, 32, 8, 64]
    assert sorted(peaks) == [8, 32, 64]
    for n, peak in peaks.items():  # the buffer and sum()'s scalars
        assert n * mib <= peak <= n * mib + 64

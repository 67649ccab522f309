"""Scaling through the CP path: fwd + bwd of one layer at cp = 2 over the same layer, kernel
and layout through the CP path at cp = 1 (``single_rank_bypass=False``).

Every variant (layout x kernel) is its own key, ``step_time_cp2_over_cp1_<layout>_<kernel>``;
the headline ``step_time_cp2_over_cp1`` is fixed in advance: ``load_balanced`` with the
default kernel (:data:`HEADLINE`). The plain layer (no CP at all, its own small-op kernel) has
its own keys (``step_plain_layer_s``); ``cp_enabled_cp1_overhead`` is the CP path at cp = 1 over
the plain layer with the same (small-op) kernel, for the CSA layer and its sliding-window
twin. Training mode with the indexer loss on, one thread per rank, interleaved rounds; a round
of cp = 2 counts as its slower rank. Ratios are medians over rounds of the paired per-round
ratio (the headline's every round: ``step_time_cp2_over_cp1_per_round``; its best round
over the best round of cp = 1: ``step_time_cp2_over_cp1_best``), on wall seconds
and on CPU seconds (``_cpu``: steadier when other jobs share the machine, but a rank blocked
on its peer uses no CPU, so they leave out waiting). ``step_cp1_concurrent_over_alone`` is the
machine's own share of the result: both ranks step the headline's cp = 1 layer at the same
time, with no exchange, over one step alone (on separate devices this would be 1).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any

import numpy as np

from hp_cp_core.config import CPConfig

__all__ = ["HEADLINE", "STEP_KERNELS", "STEP_VARIANTS", "scaling_measures"]

STEP_KERNELS = ("banded", "efficient", "smallop")
STEP_LAYOUTS = ("contiguous", "load_balanced")
STEP_VARIANTS = tuple((lay, ker) for ker in STEP_KERNELS for lay in STEP_LAYOUTS)
HEADLINE = ("load_balanced", CPConfig().attention_kernel)
"""The variant of the headline ``step_time_cp2_over_cp1``, fixed before any run."""


def step_config(index_topk: int = 64) -> Any:
    """The scaled-down CSA layer of the step-time measure."""
    from hp_cp_torch.reference import DeepSeekV4AttentionConfig

    return DeepSeekV4AttentionConfig(
        hidden_size=256,
        n_heads=4,
        head_dim=64,
        rope_head_dim=16,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=32,
        window_size=128,
        compress_ratio=4,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=index_topk,
    )


def _predicted_recv(plan: Any, widths: dict[str, int], cp: int) -> int:
    """Forward + backward bytes this rank's byte counters should show for one step."""
    win, x_row, slot = widths["window"], widths["x"], widths["slot"]
    fwd = sum(plan.window.recv_counts) * win
    bwd = sum(r.size for r in plan.window.send_rows) * win
    if plan.x is not None:
        fwd += sum(plan.x.recv_counts) * x_row
        bwd += sum(r.size for r in plan.x.send_rows) * x_row
        fwd += plan.slot_exchange.n_halo * slot  # point to point (torch)
        bwd += plan.slot_exchange.send_total * slot
    return int(fwd + bwd)


def _step(layer: Any, x: Any, g: Any) -> tuple[float, float]:
    """``(wall, cpu)`` seconds of one forward + backward (cpu: this process, all threads)."""
    import torch

    for p in layer.parameters():
        p.grad = None
    x = x.detach().requires_grad_(True)
    t0, c0 = time.perf_counter(), time.process_time()
    out = layer(x)
    torch.autograd.backward(out, g)
    return time.perf_counter() - t0, time.process_time() - c0


def _scaling_worker(rank: int, world: int, seq: int, repeat: int) -> dict[str, Any]:
    """On 2 gloo ranks (1 thread each), in interleaved rounds: rank 0 alone (rank 1 waits in a
    barrier) runs the plain layers and every variant through the CP path on a group of one,
    then both ranks run every variant at cp = 2."""
    import torch
    import torch.distributed as dist

    from hp_cp_core import LayerSpec, build_rank_plan, disable_cp, enable_cp
    from hp_cp_torch.reference import DeepSeekV4Attention

    torch.set_num_threads(1)
    cfg = step_config()
    torch.manual_seed(0)
    plain = {"csa": DeepSeekV4Attention(cfg)}
    torch.manual_seed(0)
    plain["swa"] = DeepSeekV4Attention(dataclasses.replace(cfg, compress_ratio=0))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, seq, cfg.hidden_size, generator=gen)
    g = torch.randn(1, seq, cfg.hidden_size, generator=gen)
    solos = [dist.new_group([r]) for r in range(world)]  # every rank takes part in each
    solo = solos[0]
    cp2, cp1, handles = {}, {}, []
    for layout, kernel in STEP_VARIANTS:
        options = CPConfig(layout=layout, attention_kernel=kernel)
        layer = copy.deepcopy(plain["csa"])
        h = enable_cp(layer, None, options)
        handles.append(h)
        cp2[f"cp2_{layout}_{kernel}"] = (layer, h, h.shard(x, 1), h.shard(g, 1))
        if rank == 0:
            one = dataclasses.replace(options, single_rank_bypass=False)
            layer = copy.deepcopy(plain["csa"])
            handles.append(enable_cp(layer, solo, one))
            cp1[f"cp1_{layout}_{kernel}"] = layer
    if rank == 0:  # the sliding-window twin through the CP path (small-op, like the plain one)
        layer = copy.deepcopy(plain["swa"])
        one = CPConfig(attention_kernel="smallop", single_rank_bypass=False)
        handles.append(enable_cp(layer, solo, one))
        cp1["cp1_swa_smallop"] = layer
    # the machine's share: both ranks step the headline's cp = 1 layer at once, no exchange
    twin = copy.deepcopy(plain["csa"])
    lay, ker = HEADLINE
    one = CPConfig(layout=lay, attention_kernel=ker, single_rank_bypass=False)
    handles.append(enable_cp(twin, solos[rank], one))
    times: dict[str, list[tuple[float, float]]] = {}
    recv0: dict[str, int] = {}
    for rep in range(repeat + 1):  # the first round warms up (plan cache, allocator)
        if rank == 0:
            singles = [(f"plain_{k}", m) for k, m in plain.items()] + list(cp1.items())
            for name, layer in singles if rep % 2 else singles[::-1]:
                times.setdefault(name, []).append(_step(layer, x, g))
        dist.barrier()
        for name, (layer, h, xl, gl) in cp2.items():
            if rep == 1:
                recv0[name] = h.stats()["bytes_recv"]
            dist.barrier()
            times.setdefault(name, []).append(_step(layer, xl, gl))
        dist.barrier()
        times.setdefault("cp1_concurrent", []).append(_step(twin, x, g))
    # byte counters over the timed steps against the plan's prediction
    counters = {}
    f32 = 4
    widths = {
        "window": cfg.head_dim * f32,
        "x": cfg.hidden_size * f32,
        "slot": (cfg.head_dim + cfg.index_head_dim) * f32,
    }
    spec = LayerSpec(compress_ratio=4, window_size=cfg.window_size, has_indexer=True)
    for name, (_, h, _, _) in cp2.items():
        layout = name.split("_", 1)[1].rsplit("_", 1)[0]
        plan = build_rank_plan(
            rank=rank, cp_size=world, spec=spec, layout_kind=layout, total_rows=seq
        )
        got = (h.stats()["bytes_recv"] - recv0[name]) / repeat
        counters[name] = {"counted": got, "plan": _predicted_recv(plan, widths, world)}
    # parity of the timed layers with the plain layer (a guard, not a measure)
    errors = {}
    with torch.no_grad():
        ref = plain["csa"](x)
        for name, (layer, h, xl, _) in cp2.items():
            full = h.unshard(layer(xl), 1)
            errors[name] = float((full - ref).abs().max() / ref.abs().max())
        for name, layer in cp1.items():
            if name != "cp1_swa_smallop":
                errors[name] = float((layer(x) - ref).abs().max() / ref.abs().max())
    for h in handles:
        disable_cp(h)
    return {"times": {k: v[1:] for k, v in times.items()}, "counters": counters, "errors": errors}


def _ratio(num: dict[str, list[float]], den: dict[str, list[float]], clock: str) -> float:
    """Median over rounds of the paired per-round ratio."""
    return float(np.median(np.asarray(num[clock]) / np.asarray(den[clock])))


def scaling_measures(seq: int, repeat: int) -> dict[str, Any]:
    """The ``step_*`` and ``cp_enabled_cp1_overhead*`` keys (see the module docstring)."""
    from hp_cp_torch.cli.launch import run_ranks

    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    t0 = time.perf_counter()
    ranks = run_ranks(2, _scaling_worker, seq, repeat, timeout=3600)
    rounds: dict[str, dict[str, list[float]]] = {}
    res: dict[str, Any] = {"step_seq": seq, "step_rounds": repeat}
    for name, series in ranks[0]["times"].items():
        if name.startswith("cp2_") or name == "cp1_concurrent":
            both = np.asarray([r["times"][name] for r in ranks])  # [rank, round, clock]
            series = both.max(axis=0).tolist()
        rounds[name] = {"wall": [t[0] for t in series], "cpu": [t[1] for t in series]}
        res[f"step_{name}_s"] = min(rounds[name]["wall"])
        res[f"step_{name}_cpu_s"] = min(rounds[name]["cpu"])
    res["step_plain_layer_s"] = res["step_plain_csa_s"]
    res["step_plain_layer_cpu_s"] = res["step_plain_csa_cpu_s"]
    for lay, ker in STEP_VARIANTS:
        name = f"cp2_{lay}_{ker}"
        for clock, suffix in (("wall", ""), ("cpu", "_cpu")):
            res[f"step_time_cp2_over_cp1_{lay}_{ker}{suffix}"] = _ratio(
                rounds[name], rounds[f"cp1_{lay}_{ker}"], clock
            )
            res[f"step_time_cp1_{lay}_{ker}_over_plain{suffix}"] = _ratio(
                rounds[f"cp1_{lay}_{ker}"], rounds["plain_csa"], clock
            )
        res[f"step_{name}_max_rel_err"] = ranks[0]["errors"][name]
        res[f"step_cp1_{lay}_{ker}_max_rel_err"] = ranks[0]["errors"][f"cp1_{lay}_{ker}"]
        counted = sum(r["counters"][name]["counted"] for r in ranks)
        planned = sum(r["counters"][name]["plan"] for r in ranks)
        res[f"comm_counted_over_plan_{name}"] = counted / planned if planned else 1.0
        res[f"comm_counted_bytes_per_step_{name}"] = counted
    res["step_time_cp2_over_cp1"] = res["step_time_cp2_over_cp1_{}_{}".format(*HEADLINE)]
    res["step_time_cp2_over_cp1_cpu"] = res["step_time_cp2_over_cp1_{}_{}_cpu".format(*HEADLINE)]
    head, one = "cp2_{}_{}".format(*HEADLINE), "cp1_{}_{}".format(*HEADLINE)
    per_round = np.asarray(rounds[head]["wall"]) / np.asarray(rounds[one]["wall"])
    res["step_time_cp2_over_cp1_per_round"] = [float(v) for v in per_round]
    # best round over best round: noise on a shared machine only ever adds time
    res["step_time_cp2_over_cp1_best"] = min(rounds[head]["wall"]) / min(rounds[one]["wall"])
    # two ranks sharing this machine: a cp = 1 step of each at once over one alone
    res["step_cp1_concurrent_over_alone"] = _ratio(rounds["cp1_concurrent"], rounds[one], "wall")
    res["step_time_cp2_headline_variant"] = "_".join(HEADLINE)
    for clock, suffix in (("wall", ""), ("cpu", "_cpu")):
        res[f"cp_enabled_cp1_overhead{suffix}"] = _ratio(
            rounds["cp1_contiguous_smallop"], rounds["plain_csa"], clock
        )
        res[f"cp_enabled_cp1_overhead_swa{suffix}"] = _ratio(
            rounds["cp1_swa_smallop"], rounds["plain_swa"], clock
        )
    res["time_step_measures_s"] = time.perf_counter() - t0
    return res

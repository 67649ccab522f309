"""``hp-cp bench --real-widths``: memory and time of one bf16 training step at the family's
published attention widths under CP (``bench-real.json``, a PNG plot).

The models (transformers 5.23, :data:`REAL_MODELS`): ``DeepseekV4ForCausalLM`` at V4-Flash's
attention (hidden 4096, 64 heads x head_dim 512 with rope 64, q_lora 1024, o_lora 1024 in 8
groups, indexer 64 x 128, top-k 512, window 128, hc_mult 4), ``DeepseekV32ForCausalLM``
(hidden 7168, 128 heads, kv_lora 512 + rope 64, nope 128, v 128, q_lora 1536, indexer
64 x 128, top-k 2048) and ``GlmMoeDsaForCausalLM`` (hidden 6144, 64 heads, kv_lora 512 + 64,
nope 192, v 256, q_lora 2048, indexer 32 x 128, top-k 2048): transformers' defaults for
every attention and indexer width. What is reduced (:data:`REDUCED`): 2 layers (V4: one CSA
and one HCA layer; V3.2 / GLM-5: two DSA layers, each with its own indexer), vocabulary 1024,
4 routed experts of width 256 (2 per token) and one shared expert, every MLP a MoE (no dense
first layers), one expert group. MoE, embeddings and norms are token-local: they do not
change what CP exchanges. Weights: HF's init with the attention re-drawn
(:func:`~hp_cp_torch.cli.parity.randomise_attention_weights`), then cast
to bf16 except the modules HF keeps in fp32 (``_keep_in_fp32_modules_strict``: V4's
hyper-connections, sinks, norms; the routers' correction bias).

What is measured, per (model, cp, S, ``regather_compressed_kv``): one launch of ``cp`` gloo
processes on this machine (:func:`~hp_cp_torch.cli.launch.run_ranks`, a time limit per
launch), load-balanced, ``enable_cp`` with the default kernel, the batch from
``handle.batch``, the loss from ``cp_causal_lm_loss``. Each rank
runs a warm-up step, then a step whose resident peak is measured (``VmHWM`` reset just before
it, minus ``VmRSS`` before it: :mod:`hp_cp_torch.bench.memory`'s method) and timed, then,
with ``profile``, one step under ``torch.profiler`` for the peak of live tensor bytes (what
a GPU's ``max_memory_allocated`` reports), the top ops and the attention kernel's time. The
gradients are set to ``None`` before every step, so each step's peak holds its own
gradients. ``cp = 1`` is one process running the model's own forward (HF eager, dense
``[H, S, S]`` scores), the one-device reference where it fits. The gradient all-reduce of a
data-parallel step is not part of the step.

Keys (``real_<model>_``...): ``peak_bytes_cp<N>_s<S>`` (busiest rank, resident, the
library default ``regather_compressed_kv=False``), ``peak_bytes_cp<N>_s<S>_regather`` (on),
``live_peak_bytes_...`` (live tensors), ``step_seconds_...`` (the slowest rank),
``loss_finite_...``, ``peak_bytes_single_s<S>`` / ``step_seconds_single_s<S>``,
``bytes_per_local_row`` (slope of the busiest rank's resident peak against S / cp over every
CP point with regather off; ``_regather`` with it on) and ``attn_flops_over_matmul``: the
attention kernel's useful FLOP/s in the profiled step (its autograd nodes' time; useful work
counted from each local query's window and picks as in :mod:`hp_cp_torch.bench.kernel`) over
the FLOP/s of a ``[1024, 1024]`` bf16 ``torch.matmul`` in the same process right after
(``attn_flops_over_fp32_matmul``: over an fp32 one's, the rate of the products the kernels
compute their logits with).

A profiled point whose launch dies (the profiler's records of every allocation can be what
does not fit) runs again without the profiled step (``profile_failed_...`` says why).

A point whose predicted total (the busiest rank's peak extrapolated along the local rows,
plus each process's resident size, times ``cp``) exceeds ``max_total_bytes`` is skipped and
listed (``real_skipped``): the bench never exhausts a shared machine.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from typing import Any

__all__ = [
    "REAL_MODELS",
    "REDUCED",
    "build_real_model",
    "real_measures",
    "real_point",
    "real_table",
    "write_real_png",
]

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"

REDUCED: dict[str, Any] = dict(
    num_hidden_layers=2,
    vocab_size=1024,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    n_shared_experts=1,
    use_cache=False,
    attention_dropout=0.0,
)
"""What every model reduces from transformers' defaults (the attention widths are kept)."""

REAL_MODELS: dict[str, dict[str, Any]] = {
    "deepseek_v4": dict(layer_types=[CSA, HCA], mlp_layer_types=["moe", "moe"]),
    "deepseek_v32": dict(first_k_dense_replace=0, n_group=1, topk_group=1),
    "glm_moe_dsa": dict(first_k_dense_replace=0, n_group=1, topk_group=1),
}
"""Per model, the overrides on top of :data:`REDUCED` (layer kinds, no dense MLP)."""

_CLASSES = {
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM"),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
}


def build_real_model(name: str, seed: int = 0, dtype: Any = None, **overrides: Any) -> Any:
    """The bench's ``name`` model (:data:`REAL_MODELS`) with its attention re-drawn, cast to
    ``dtype`` (default bf16) except the modules HF keeps in fp32; ``overrides`` change the
    config (the tests build it at tiny widths)."""
    import torch
    import transformers

    from hp_cp_torch.cli.parity import randomise_attention_weights

    config_cls, model_cls = (getattr(transformers, n) for n in _CLASSES[name])
    dtype = torch.bfloat16 if dtype is None else dtype
    torch.manual_seed(seed)
    cfg = config_cls(**{**REDUCED, **REAL_MODELS[name], **overrides})
    cfg._attn_implementation = "eager"
    # made in ``dtype`` (no fp32 copy of every weight: a rank's build would peak at twice
    # its weights), then the modules HF keeps in fp32 go back to fp32
    model = model_cls._from_config(cfg, dtype=dtype)
    randomise_attention_weights(model, cfg.n_routed_experts, seed)
    keep = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if keep:
        pattern = re.compile(r"(^|\.)(" + "|".join(map(re.escape, keep)) + r")(\.|$)")
        with torch.no_grad():
            for pname, p in [*model.named_parameters(), *model.named_buffers()]:
                if p.is_floating_point() and pattern.search(pname):
                    p.data = p.data.float()
    return model


def _useful_attention_flops(name: str, model: Any, positions: Any) -> float:
    """Forward + backward useful FLOPs of the sparse attention of the local queries at global
    ``positions`` (a query at position ``t`` sees ``t + 1`` tokens): 3.5x the forward's
    ``4 * H * D * columns`` (V4: window plus the picks / visible HCA slots; DSA: the picks,
    scored on the latents ``[c ; k_rot]`` and summed on ``c``)."""
    import numpy as np

    cfg = model.config
    seen = np.asarray(positions, dtype=np.int64).reshape(-1) + 1
    heads = cfg.num_attention_heads
    total = 0.0
    if name == "deepseek_v4":
        window = np.minimum(seen, cfg.sliding_window)
        for kind in cfg.layer_types:
            rate = cfg.compress_rates.get(kind, 0)
            slots = seen // rate if rate else 0 * seen
            if kind == CSA:
                slots = np.minimum(slots, cfg.index_topk)
            total += 4.0 * heads * cfg.head_dim * float((window + slots).sum())
    else:
        picks = np.minimum(seen, cfg.index_topk).astype(float).sum()
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        per_layer = 2.0 * heads * picks * (width + cfg.kv_lora_rank)
        total = per_layer * cfg.num_hidden_layers
    return 3.5 * total


ATTENTION_NODES = ("_BandedSparseAttention", "_PickedAttention", "_SparseAttention")
"""The autograd nodes of the attention kernels (forward and ``...Backward``)."""


def _matmul_flops(dtype: Any = None, n: int = 1024, repeat: int = 3) -> float:
    """FLOP/s of one ``[n, n] @ [n, n]`` ``torch.matmul`` in ``dtype`` (default bf16)."""
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype or torch.bfloat16)
    b = torch.randn(n, n, generator=g).to(dtype or torch.bfloat16)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def _trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc ``malloc_trim``), so a step's
    resident peak is not hidden by pages an earlier step freed but kept."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _first_to_go() -> None:
    """Make this rank the first process the kernel's out-of-memory killer picks (a bench on a
    shared machine loses its own point, not someone else's job)."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def _progress(rank: int, what: str, t0: float) -> None:
    print(f"real: rank {rank} {what} at {time.perf_counter() - t0:.0f} s", flush=True)


def real_point(
    rank: int,
    world: int,
    name: str,
    seq: int,
    regather: bool,
    profile: bool,
    overrides: dict[str, Any] | None = None,
    side: str = "hp_cp",
    oom_first: bool = True,
) -> dict[str, Any]:
    """One rank of one measured point (module docstring); ``world == 1``: the model's own
    forward on one process; ``overrides``: config changes (the tests' tiny widths);
    ``side="allgather"``: the all-gather CP of the public DSA code instead of hp_cp
    (V3.2 / GLM-5; :func:`_allgather_step`); ``oom_first``: this process is the first the
    kernel's out-of-memory killer stops (:func:`_first_to_go`)."""
    import gc

    import torch

    from hp_cp_core import CPConfig, enable_cp
    from hp_cp_torch.bench.memory import reset_peak, status_bytes
    from hp_cp_torch.cli.parity import make_inputs
    from hp_cp_torch.integrations.transformers import cp_causal_lm_loss

    torch.set_num_threads(1)
    if oom_first:
        _first_to_go()
    t_build = time.perf_counter()
    model = build_real_model(name, **(overrides or {})).train()
    ids = make_inputs(model.config.vocab_size, 1, seq)
    if side == "allgather":
        step, positions = _allgather_step(model, ids, world)
    elif world > 1:
        config = CPConfig(layout="load_balanced", regather_compressed_kv=regather)
        handle = enable_cp(model, None, config)
        batch = handle.batch(ids)
        positions = batch.position_ids

        def step() -> torch.Tensor:
            out = model(**batch.model_inputs(), use_cache=False)
            loss = cp_causal_lm_loss(out.logits, batch.labels, batch.n_tokens)
            loss.backward()
            return loss.detach()
    else:
        positions = torch.arange(seq)[None]

        def step() -> torch.Tensor:
            loss = model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss
            loss.backward()
            return loss.detach()

    build_seconds = time.perf_counter() - t_build
    _progress(rank, "built", t_build)

    def fresh() -> None:
        model.zero_grad(set_to_none=True)
        gc.collect()
        _trim_heap()

    fresh()
    t0 = time.perf_counter()
    step()  # warm-up
    warm_seconds = time.perf_counter() - t0
    _progress(rank, "warmed up", t_build)
    fresh()
    if not reset_peak():
        return {"peak": None}
    before = status_bytes("VmRSS")
    t0 = time.perf_counter()
    loss = step()
    seconds = time.perf_counter() - t0
    peak = status_bytes("VmHWM") - before
    _progress(rank, f"measured ({peak / 2**30:.2f} GiB)", t_build)
    if world > 1:
        import torch.distributed as dist

        total = loss.clone()
        dist.all_reduce(total)
    else:
        total = loss
    res: dict[str, Any] = {
        "peak": peak,
        "rss_before": before,
        "seconds": seconds,
        "warm_seconds": warm_seconds,
        "build_seconds": build_seconds,
        "loss": float(total),
        "loss_finite": bool(torch.isfinite(total).item()),
    }
    if profile:
        res.update(_profiled_step(name, model, step, fresh, positions))
    return res


def _allgather_step(model: Any, ids: Any, world: int) -> tuple[Any, Any]:
    """The all-gather baseline of ``bench/peers_dsa.py`` (:class:`AllGatherDSA`: contiguous
    shards, every layer all-gathers the latents and index keys, hp_cp's latent attention
    code): a checkout's ``bench/`` directory is needed (not part of the wheel)."""
    import sys

    import torch
    import torch.distributed as dist

    from hp_cp_torch.integrations.transformers import cp_causal_lm_loss, cp_shift_labels

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    bench_dir = os.path.join(os.path.dirname(root), "bench")
    if not os.path.exists(os.path.join(bench_dir, "peers_dsa.py")):
        raise FileNotFoundError(f"the all-gather baseline needs a checkout's {bench_dir}")
    sys.path[:0] = [bench_dir, os.path.join(os.path.dirname(root), "tests", "torch")]
    from peers_dsa import AllGatherDSA

    AllGatherDSA(model, dist.group.WORLD, "latent")
    rank, seq = dist.get_rank(), ids.shape[1]
    own = slice(rank * (seq // world), (rank + 1) * (seq // world))
    labels = cp_shift_labels(ids)
    n_tokens = (labels != -100).sum()
    positions = torch.arange(seq)[None]

    def step() -> Any:
        out = model(input_ids=ids[:, own], position_ids=positions[:, own], use_cache=False)
        loss = cp_causal_lm_loss(out.logits, labels[:, own], n_tokens)
        loss.backward()
        return loss.detach()

    return step, positions[:, own]


def _profiled_step(name: str, model: Any, step: Any, fresh: Any, positions: Any) -> dict:
    """One more step under ``torch.profiler``: its live-tensor peak, its top ops by self time
    and the attention kernel's FLOP/s over the bf16 matmul's."""
    from torch.profiler import ProfilerActivity, profile

    fresh()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        t0 = time.perf_counter()
        step()
        profiled_seconds = time.perf_counter() - t0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    averages = prof.key_averages()
    top = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)[:12]
    total_self = sum(a.self_cpu_time_total for a in averages) or 1.0
    attn_us = sum(
        a.cpu_time_total for a in averages if a.key.removesuffix("Backward") in ATTENTION_NODES
    )
    useful = _useful_attention_flops(name, model, positions)
    import torch

    matmul = _matmul_flops()
    return {
        "fp32_matmul_flops": _matmul_flops(torch.float32),
        "live_peak": peak,
        "top_ops": [
            [a.key, a.self_cpu_time_total / 1e6, a.count, a.self_cpu_time_total / total_self]
            for a in top
        ],
        "attn_seconds": attn_us / 1e6,
        "profiled_seconds": profiled_seconds,
        "attn_useful_flops": useful,
        "matmul_flops": matmul,
    }


def _suffix(cp: int, seq: int, regather: bool) -> str:
    where = "single" if cp == 1 else f"cp{cp}"
    return f"{where}_s{seq}" + ("_regather" if regather and cp > 1 else "")


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    import numpy as np

    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(slope), float(intercept)


def _point_keys(name: str, cp: int, seq: int, regather: bool, ranks: list[dict]) -> dict:
    sfx = _suffix(cp, seq, regather)
    busiest = max(ranks, key=lambda r: r["peak"])
    res: dict[str, Any] = {
        f"real_{name}_peak_bytes_{sfx}": max(r["peak"] for r in ranks),
        f"real_{name}_peak_bytes_ranks_{sfx}": [r["peak"] for r in ranks],
        f"real_{name}_rss_before_step_bytes_{sfx}": busiest["rss_before"],
        f"real_{name}_step_seconds_{sfx}": max(r["seconds"] for r in ranks),
        f"real_{name}_warmup_seconds_{sfx}": max(r["warm_seconds"] for r in ranks),
        f"real_{name}_loss_{sfx}": ranks[0]["loss"],
        f"real_{name}_loss_finite_{sfx}": all(r["loss_finite"] for r in ranks),
    }
    if "live_peak" in ranks[0]:
        res[f"real_{name}_live_peak_bytes_{sfx}"] = max(r["live_peak"] for r in ranks)
        attn = sum(r["attn_seconds"] for r in ranks)
        if attn > 0:
            rate = sum(r["attn_useful_flops"] for r in ranks) / attn
            matmul = sum(r["matmul_flops"] for r in ranks) / len(ranks)
            res[f"real_{name}_attn_flops_over_matmul_{sfx}"] = rate / matmul
            if "fp32_matmul_flops" in ranks[0]:
                fp32 = sum(r["fp32_matmul_flops"] for r in ranks) / len(ranks)
                res[f"real_{name}_attn_flops_over_fp32_matmul_{sfx}"] = rate / fp32
            profiled = sum(r["profiled_seconds"] for r in ranks)
            res[f"real_{name}_attn_share_of_step_{sfx}"] = attn / profiled
        res[f"real_{name}_top_ops_{sfx}"] = busiest["top_ops"]
    return res


def _predicted_total(done: dict[int, tuple[float, float]], seq: int, cp: int) -> float | None:
    """``cp`` times the busiest rank's resident bytes at ``seq`` predicted from the points
    measured at this cp (``{S: (peak, rss_before)}``), ``None`` with fewer than one."""
    if not done:
        return None
    seqs = sorted(done)
    rss = max(v[1] for v in done.values())
    if len(seqs) == 1:  # no slope yet: the peak grows at most as the local rows
        peak = done[seqs[0]][0] * seq / seqs[0]
    else:
        slope, intercept = _fit([s / cp for s in seqs], [done[s][0] for s in seqs])
        peak = slope * seq / cp + intercept
    return cp * (peak + rss)


def real_measures(
    models: tuple[str, ...] = tuple(REAL_MODELS),
    seqs: tuple[int, ...] = (4096, 8192),
    cps: tuple[int, ...] = (4, 8),
    regathers: tuple[bool, ...] = (False, True),
    single: bool = True,
    profile: bool = True,
    max_total_bytes: float = 20 * 2**30,
    time_limit: float = 3600,
    allgather: bool = False,
    out: str | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """The ``real_*`` keys (module docstring). Points run smallest S first, each one launch
    of at most ``time_limit`` seconds; with ``out``, each point's keys are merged into that
    JSON as soon as it is measured (a long run that is stopped keeps what it measured)."""
    from hp_cp_torch.cli.launch import run_ranks

    res: dict[str, Any] = {"real_reduced": json.dumps(REDUCED, sort_keys=True)}
    skipped: list[str] = []
    failed: list[str] = []
    for seq in sorted(seqs):
        for name in models:
            points = [(cp, r, "hp_cp") for cp in cps for r in regathers]
            if allgather and name != "deepseek_v4":
                points += [(cp, False, "allgather") for cp in cps]
            points += [(1, False, "hp_cp")] if single else []
            for cp, regather, side in points:
                if side == "allgather":
                    sfx = f"allgather_cp{cp}_s{seq}"
                    keys = _baseline_point(name, cp, seq, sfx, time_limit, log)
                    res.update(keys)
                    if out:
                        _merge(out, keys)
                    continue
                sfx = _suffix(cp, seq, regather)
                done = {
                    s: (
                        res[f"real_{name}_peak_bytes_{_suffix(cp, s, regather)}"],
                        res[f"real_{name}_rss_before_step_bytes_{_suffix(cp, s, regather)}"],
                    )
                    for s in seqs
                    if f"real_{name}_peak_bytes_{_suffix(cp, s, regather)}" in res
                }
                if any(
                    x.startswith(f"{name}_{'single' if cp == 1 else f'cp{cp}'}_")
                    and x.endswith("_regather") == (regather and cp > 1)
                    for x in skipped + failed
                ):
                    skipped.append(f"{name}_{sfx}")  # a shorter S of this kind did not fit
                    continue
                predicted = _predicted_total(done, seq, cp)
                if predicted is not None and predicted > max_total_bytes:
                    skipped.append(f"{name}_{sfx}")
                    log(f"real: {name} {sfx} skipped, predicted {predicted / 2**30:.1f} GiB")
                    continue
                # the profiled step (live peak, top ops, FLOP/s): each model's first CP point
                profiled = (
                    profile
                    and cp > 1
                    and not any(k.startswith(f"real_{name}_live_peak_bytes_cp") for k in res)
                    and not any(k.startswith(f"real_{name}_profile_failed_") for k in res)
                )
                t0 = time.perf_counter()
                try:
                    ranks = run_ranks(
                        cp, real_point, name, seq, regather, profiled, timeout=time_limit
                    )
                except Exception as exc:  # noqa: BLE001 - a point that fails is reported
                    why = f"{type(exc).__name__}: {exc}"[:400]
                    log(f"real: {name} {sfx} failed: {why[:200]}")
                    ranks = None
                    if profiled:  # the profiler's own records can be what did not fit
                        res[f"real_{name}_profile_failed_{sfx}"] = why
                        log(f"real: {name} {sfx}: again without the profiled step")
                        try:
                            ranks = run_ranks(
                                cp, real_point, name, seq, regather, False, timeout=time_limit
                            )
                        except Exception as again:  # noqa: BLE001 - reported below
                            why = f"{type(again).__name__}: {again}"[:400]
                    if ranks is None:
                        failed.append(f"{name}_{sfx}")
                        res[f"real_{name}_failed_{sfx}"] = why
                        continue
                if any(r["peak"] is None for r in ranks):
                    return {"real_mem_note": "VmHWM cannot be reset here (/proc/self/clear_refs)"}
                keys = _point_keys(name, cp, seq, regather, ranks)
                res.update(keys)
                log(
                    f"real: {name} {sfx}: peak {keys[f'real_{name}_peak_bytes_{sfx}'] / 2**30:.2f}"
                    f" GiB (busiest rank), step {keys[f'real_{name}_step_seconds_{sfx}']:.1f} s, "
                    f"launch {time.perf_counter() - t0:.0f} s"
                )
                res.update(fitted_bytes_per_row(res, name))
                if out:
                    _merge(out, {**keys, **fitted_bytes_per_row(res, name)})
    if skipped:
        res["real_skipped"] = skipped
    if failed:
        res["real_failed"] = failed
    return res


def _baseline_point(name: str, cp: int, seq: int, sfx: str, time_limit: float, log: Any) -> dict:
    """The all-gather baseline's keys at one point: ``real_<name>_peak_bytes_<sfx>``, ..."""
    from hp_cp_torch.cli.launch import run_ranks

    try:
        ranks = run_ranks(
            cp, real_point, name, seq, False, False, None, "allgather", timeout=time_limit
        )
    except Exception as exc:  # noqa: BLE001 - a point that fails is reported
        log(f"real: {name} {sfx} failed: {type(exc).__name__}: {str(exc)[:200]}")
        return {f"real_{name}_failed_{sfx}": f"{type(exc).__name__}: {exc}"[:400]}
    log(f"real: {name} {sfx}: peak {max(r['peak'] for r in ranks) / 2**30:.2f} GiB")
    return {
        f"real_{name}_peak_bytes_{sfx}": max(r["peak"] for r in ranks),
        f"real_{name}_step_seconds_{sfx}": max(r["seconds"] for r in ranks),
        f"real_{name}_loss_finite_{sfx}": all(r["loss_finite"] for r in ranks),
    }


def fitted_bytes_per_row(res: dict[str, Any], name: str) -> dict[str, float]:
    """``real_<name>_bytes_per_local_row`` (regather off) and ``..._regather`` (on): the
    slope of the busiest rank's resident peak over S / cp, every CP point of ``res``; with
    ``_intercept_bytes``. Needs two distinct local row counts."""
    out: dict[str, float] = {}
    for regather in (False, True):
        tail = "_regather" if regather else ""
        pat = re.compile(rf"^real_{name}_peak_bytes_cp(\d+)_s(\d+){tail}$")
        xs, ys = [], []
        for key, value in res.items():
            m = pat.match(key)
            if m:
                xs.append(int(m.group(2)) / int(m.group(1)))
                ys.append(float(value))
        if len(set(xs)) >= 2:
            slope, intercept = _fit(xs, ys)
            out[f"real_{name}_bytes_per_local_row{tail}"] = slope
            out[f"real_{name}_bytes_per_local_row_intercept{tail}"] = intercept
    return out


def _merge(path: str, keys: dict[str, Any]) -> None:
    old: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    old.update(keys)
    with open(path, "w") as f:
        json.dump(old, f, indent=1, sort_keys=True)


def write_real_png(res: dict[str, Any], path: str) -> str:
    """Busiest rank's resident peak against S per model, cp and regather (one panel per
    model; the one-process points where they ran); returns the renderer."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - no plot without matplotlib
        return "none"
    names = [n for n in REAL_MODELS if any(k.startswith(f"real_{n}_peak_bytes_") for k in res)]
    if not names:
        return "none"
    fig, axes = plt.subplots(1, len(names), figsize=(4.6 * len(names), 3.8), squeeze=False)
    pat = re.compile(
        rf"^real_({'|'.join(REAL_MODELS)})_peak_bytes_((?:allgather_)?cp\d+|single)_s(\d+)(_regather)?$"
    )
    for ax, name in zip(axes[0], names, strict=True):
        series: dict[str, list[tuple[int, float]]] = {}
        for key, value in res.items():
            m = pat.match(key)
            if m and m.group(1) == name:
                label = m.group(2) + (" regather" if m.group(4) else "")
                series.setdefault(label, []).append((int(m.group(3)), float(value) / 2**30))
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("S (tokens)")
        ax.set_ylabel("busiest rank's step peak, GiB (resident)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("one bf16 training step at published attention widths (2 layers)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "matplotlib"


def main_real(args: Any) -> int:
    """``hp-cp bench --real-widths``: measure, merge into ``--real-out``, plot, print."""
    from hp_cp_torch.bench.numbers import flatten_numbers

    out = os.path.abspath(args.real_out)
    models = tuple(m for m in args.real_models.split(",") if m)
    unknown = [m for m in models if m not in REAL_MODELS]
    if unknown:
        raise SystemExit(f"--real-models: unknown {unknown}; choose from {list(REAL_MODELS)}")
    res = real_measures(
        models,
        tuple(int(s) for s in args.real_seqs.split(",") if s),
        tuple(int(c) for c in args.real_cps.split(",") if c),
        tuple({"off": False, "on": True}[r] for r in args.real_regather.split(",") if r),
        single=not args.real_no_single,
        profile=not args.real_no_profile,
        max_total_bytes=float(args.real_max_total_bytes),
        time_limit=float(args.real_time_limit),
        allgather=args.real_allgather,
        out=out,
    )
    old: dict[str, Any] = {}
    if os.path.exists(out):
        with open(out) as f:
            old = json.load(f)
    for key in ("real_skipped", "real_failed"):
        old.pop(key, None)
    res = {**old, **res}
    for name in REAL_MODELS:
        res.update(fitted_bytes_per_row(res, name))
        # the headline: the largest S's ratio, default regather, at the largest cp measured
        ratios = {
            k: v for k, v in res.items() if k.startswith(f"real_{name}_attn_flops_over_matmul_cp")
        }
        if ratios:
            res[f"real_{name}_attn_flops_over_matmul"] = ratios[max(ratios, key=_size_of)]
    numbers, notes = flatten_numbers(res)
    png = args.png or os.path.join(os.path.dirname(out), "docs", "bench-real.png")
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    notes["real_png_renderer"] = write_real_png(res, png)
    with open(out, "w") as f:
        json.dump({**numbers, **notes}, f, indent=1, sort_keys=True)
    for key in sorted(numbers):
        if re.search(r"_(peak_bytes_(cp\d+|single)_s\d+(_regather)?|bytes_per_local_row)$", key):
            print(f"{key:<60} {numbers[key] / 2**30 if 'peak' in key else numbers[key]:.4g}")
    print(real_table(res))
    print(f"wrote {out} and {png}")
    finite = all(math.isfinite(v) for v in numbers.values() if isinstance(v, float))
    return 0 if finite else 1


def real_table(res: dict[str, Any]) -> str:
    """The measured points as a markdown table: model, where (cp / one process / the
    all-gather baseline), S, regather, busiest rank's resident and live peaks (GiB), step
    seconds, loss finite."""
    pat = re.compile(
        rf"^real_({'|'.join(REAL_MODELS)})_peak_bytes_((?:allgather_)?cp\d+|single)_s(\d+)(_regather)?$"
    )
    rows = []
    for key, value in res.items():
        m = pat.match(key)
        if not m:
            continue
        name, where, seq, reg = m.group(1), m.group(2), int(m.group(3)), bool(m.group(4))
        tail = key[len(f"real_{name}_peak_bytes_") :]
        live = res.get(f"real_{name}_live_peak_bytes_{tail}")
        secs = res.get(f"real_{name}_step_seconds_{tail}")
        finite = res.get(f"real_{name}_loss_finite_{tail}")
        rows.append(
            (
                name,
                where,
                seq,
                "on" if reg else ("-" if where == "single" else "off"),
                f"{value / 2**30:.2f}",
                "-" if live is None else f"{live / 2**30:.2f}",
                "-" if secs is None else f"{secs:.0f}",
                "-" if finite is None else ("yes" if finite else "NO"),
            )
        )
    rows.sort(key=lambda r: (r[0], r[2], r[1], r[3]))
    head = (
        "| model | where | S | regather | peak GiB (resident) | peak GiB (live) | step s | "
        "loss finite |\n|---|---|---|---|---|---|---|---|\n"
    )
    return head + "\n".join("| " + " | ".join(map(str, r)) + " |" for r in rows)


def _size_of(key: str) -> tuple[int, int, int]:
    m = re.search(r"_cp(\d+)_s(\d+)(_regather)?$", key)
    return (int(m.group(2)), int(m.group(1)), -bool(m.group(3))) if m else (0, 0, 0)

"""Memory where users feel it: a Hugging Face ``DeepseekV4ForCausalLM`` training step, per rank
at cp = 4 against the single-device HF eager run at the same S.

What is measured: each run is its own process (one per rank); just before the step the
process's resident-set high-water mark is reset (``/proc/self/clear_refs``, "5"), so
``VmHWM - VmRSS before the step`` is the peak *extra* resident memory of one forward +
backward of the causal-LM loss: activations, gradients, temporaries and the CP exchanges,
not the weights or the Python / torch runtime (the same in every process). Where the reset is
not allowed the bench reports nothing rather than a high-water mark of something else.

Keys: ``hf_peak_mem_cp4_over_single`` (max over ranks at cp = 4 over single, at the largest
measured S, ``hf_mem_seq``) and the bytes behind it; ``hf_max_seq_{single,cp4}``: the longest
S measured to fit ``hf_mem_budget_bytes`` (this machine's memory over 8 per process, so four
ranks and their runtimes stay well inside the machine) and ``hf_max_seq_{single,cp4}_over``,
the shortest S measured not to: a search of real steps (Note [Longest S that fits]);
``hf_max_seq_{single,cp4}_est`` is the extrapolation from the first S alone, for comparison.

Note [Longest S that fits]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Each probe is a real training step whose peak is compared with the budget. The next probe is
where the curve through every measured peak (quadratic, as HF eager's dense masks grow)
crosses the budget, kept inside the bracket and at most 1.5x the longest fitting S (a probe
far past the budget could exhaust the machine); once a probe fails the search bisects until
the bracket is within 10%::

    peak
      |                         x  over (shortest measured S not fitting)
    B +-------------------- o --------------
      |              o   fit (longest measured S fitting)
      |     o
      +------------------------------------ S
"""

from __future__ import annotations

import math
import os
from typing import Any

__all__ = [
    "HF_MEM_CONFIG",
    "hf_cp_scaling_measures",
    "hf_memory_measures",
    "live_tensor_peak",
    "reset_peak",
    "status_bytes",
]

HF_MEM_CONFIG: dict[str, Any] = dict(
    vocab_size=2048,
    hidden_size=1024,
    moe_intermediate_size=256,
    num_attention_heads=8,
    head_dim=128,
    q_lora_rank=256,
    o_groups=2,
    o_lora_rank=128,
    n_routed_experts=4,
    num_experts_per_tok=2,
    sliding_window=128,
    index_n_heads=8,
    index_head_dim=64,
    index_topk=64,
)
"""Overrides of the demo's tiny config: hidden 1024, the three layer kinds (sliding, CSA r = 4,
HCA r = 128), W = 128, top-k 64."""


def live_tensor_peak(fn: Any) -> int:
    """The most bytes of tensors alive at once while ``fn()`` runs, from the allocations and
    frees torch's profiler records (``profile_memory``): on a CPU what
    ``torch.cuda.max_memory_allocated`` reports on a GPU, without the allocator's caching or
    the system's paging. Tensors made before the call do not count, nor do their frees."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def status_bytes(field: str) -> int:
    """This process's ``/proc/self/status`` field (``VmRSS``, ``VmHWM``, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def reset_peak() -> bool:
    """Reset this process's resident high-water mark (``VmHWM := VmRSS``); ``False`` where
    the system does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _step_peak_worker(rank: int, world: int, seq: int, cp: int) -> int | None:
    """Peak extra resident bytes of one training step of the model (``cp = 1``: plain HF
    eager on the whole sequence; else this rank's shard under CP, load-balanced)."""
    import torch

    from hp_cp_core import CPConfig, enable_cp
    from hp_cp_torch.cli.parity import build_tiny_model, make_inputs
    from hp_cp_torch.integrations.transformers import cp_causal_lm_loss, cp_shift_labels

    torch.set_num_threads(1)
    model = build_tiny_model(0, **HF_MEM_CONFIG)
    model.train()
    ids = make_inputs(HF_MEM_CONFIG["vocab_size"], 1, seq)
    pos = torch.arange(seq)[None]
    if cp > 1:
        handle = enable_cp(model, None, CPConfig(layout="load_balanced"))
        labels = cp_shift_labels(ids)
        n_tok = (labels != -100).sum()
        ids, pos, labels = (handle.shard(t, 1) for t in (ids, pos, labels))
    if not reset_peak():
        return None
    before = status_bytes("VmRSS")
    if cp > 1:
        out = model(input_ids=ids, position_ids=pos, use_cache=False)
        cp_causal_lm_loss(out.logits, labels, n_tok).backward()
    else:
        model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss.backward()
    return status_bytes("VmHWM") - before


def _machine_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _longest_seq(seqs: list[int], peaks: list[float], budget: float) -> float:
    """Largest S with ``fit(S) <= budget`` (see the module docstring)."""
    import numpy as np

    c = 0.0  # two points: the line through them
    if len(seqs) >= 3:
        c, b, a = np.polyfit(np.asarray(seqs, float), np.asarray(peaks, float), 2)
    if c <= 0:
        b, a = np.polyfit(np.asarray(seqs[-2:], float), np.asarray(peaks[-2:], float), 1)
        return float((budget - a) / b) if b > 0 else float("inf")
    return float((-b + math.sqrt(b * b - 4 * c * (a - budget))) / (2 * c))


SEARCH_QUANTUM = 512
"""Probed lengths are multiples of this (any cp up to 256 shards them load-balanced)."""


def _peak(seq: int, cp: int) -> float | None:
    """Max over ranks of one step's peak extra bytes (``None``: the peak cannot be reset)."""
    from hp_cp_torch.cli.launch import run_ranks

    ranks = run_ranks(cp, _step_peak_worker, seq, cp, timeout=1800)
    return None if any(r is None for r in ranks) else float(max(ranks))


def longest_fitting_seq(
    cp: int, budget: float, measured: dict[int, float], max_probes: int = 8
) -> tuple[int, int | None, dict[int, float]]:
    """``(fit, over, measured)``: the longest S measured to fit ``budget`` (0: none), the
    shortest measured not to (``None``: not found in ``max_probes``), every measured peak
    (Note [Longest S that fits])."""
    measured = dict(measured)
    for _ in range(max_probes):
        fit = max((s for s, p in measured.items() if p <= budget), default=0)
        over = min((s for s, p in measured.items() if p > budget), default=None)
        if fit == 0 or (over is not None and over <= 1.1 * fit + SEARCH_QUANTUM):
            break
        if over is None:
            seqs = sorted(measured)
            guess = _longest_seq(seqs, [measured[s] for s in seqs], budget)
            nxt = min(max(guess, 1.1 * fit), 1.5 * fit)
        else:
            nxt = math.sqrt(fit * over)
        nxt = max(int(nxt // SEARCH_QUANTUM) * SEARCH_QUANTUM, fit + SEARCH_QUANTUM)
        if over is not None and nxt >= over:
            break
        peak = _peak(nxt, cp)
        if peak is None:
            break
        measured[nxt] = peak
    fit = max((s for s, p in measured.items() if p <= budget), default=0)
    over = min((s for s, p in measured.items() if p > budget), default=None)
    return fit, over, measured


def hf_memory_measures(
    seqs: tuple[int, ...] = (512, 1024, 2048), cp: int = 4, search: bool = True
) -> dict[str, Any]:
    """The ``hf_*`` memory keys (see the module docstring); ``search``: also the measured
    longest S (a few minutes)."""
    res: dict[str, Any] = {}
    peaks: dict[str, list[float]] = {"single": [], f"cp{cp}": []}
    for seq in seqs:
        single, ranks = _peak(seq, 1), _peak(seq, cp)
        if single is None or ranks is None:
            return {"hf_mem_note": "VmHWM cannot be reset here (/proc/self/clear_refs)"}
        res[f"hf_step_peak_bytes_single_s{seq}"] = single
        res[f"hf_step_peak_bytes_cp{cp}_max_rank_s{seq}"] = ranks
        peaks["single"].append(single)
        peaks[f"cp{cp}"].append(ranks)
    res["hf_mem_seq"] = seqs[-1]
    res[f"hf_peak_mem_cp{cp}_over_single"] = peaks[f"cp{cp}"][-1] / peaks["single"][-1]
    budget = _machine_bytes() // 8
    res["hf_mem_budget_bytes"] = budget
    for name, values in peaks.items():
        res[f"hf_max_seq_{name}_est"] = _longest_seq(list(seqs), values, budget)
        if not search:
            continue
        fit, over, measured = longest_fitting_seq(
            1 if name == "single" else cp, budget, dict(zip(seqs, values))
        )
        res[f"hf_max_seq_{name}"] = fit
        if over is not None:
            res[f"hf_max_seq_{name}_over"] = over
        for seq, peak in sorted(measured.items()):
            if seq not in seqs:
                res[f"hf_step_peak_bytes_{name}_probe_s{seq}"] = peak
    if search and res["hf_max_seq_single"]:
        res[f"hf_max_seq_cp{cp}_over_single"] = res[f"hf_max_seq_cp{cp}"] / res["hf_max_seq_single"]
    return res


def hf_cp_scaling_measures(
    cps: tuple[int, ...] = (4, 8), seeds: tuple[int, ...] = (4096, 8192), budget: float = 0
) -> dict[str, Any]:
    """``hf_max_seq_cp<N>`` for every ``cp`` in ``cps`` under ONE per-rank budget, by real
    training steps of the HF model at :data:`HF_MEM_CONFIG` (Note [Longest S that fits]):
    what doubling the ranks buys at the same memory per rank.

    ``budget`` (default this machine's memory over 16, so that 8 ranks and their runtimes stay
    well inside it) is the busiest rank's peak extra resident bytes; each cp is seeded with a
    step at every S of ``seeds`` and searched from there. Keys: ``hf_max_seq_cp<N>``,
    ``hf_max_seq_cp<N>_over`` (the shortest S measured not to fit),
    ``hf_step_peak_bytes_cp<N>_max_rank_s<S>`` (every step measured),
    ``hf_max_seq_cp<last>_over_cp<first>`` and ``hf_max_seq_budget_bytes``.
    """
    budget = budget or _machine_bytes() // 16
    res: dict[str, Any] = {"hf_max_seq_budget_bytes": budget, "hf_max_seq_config": HF_MEM_CONFIG}
    for cp in cps:
        measured: dict[int, float] = {}
        for seq in seeds:
            peak = _peak(seq, cp)
            if peak is None:
                return {"hf_mem_note": "VmHWM cannot be reset here (/proc/self/clear_refs)"}
            measured[seq] = peak
        fit, over, measured = longest_fitting_seq(cp, budget, measured)
        res[f"hf_max_seq_cp{cp}"] = fit
        if over is not None:
            res[f"hf_max_seq_cp{cp}_over"] = over
        for seq, peak in sorted(measured.items()):
            res[f"hf_step_peak_bytes_cp{cp}_max_rank_s{seq}"] = peak
    first, last = cps[0], cps[-1]
    if res.get(f"hf_max_seq_cp{first}"):
        res[f"hf_max_seq_cp{last}_over_cp{first}"] = (
            res[f"hf_max_seq_cp{last}"] / res[f"hf_max_seq_cp{first}"]
        )
    return res

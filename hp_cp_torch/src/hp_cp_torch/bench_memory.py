"""Memory where users feel it: a Hugging Face ``DeepseekV4ForCausalLM`` training step, per rank
at cp = 4 against the single-device HF eager run at the same S.

What is measured: each run is its own process (one per rank); just before the step the
process's resident-set high-water mark is reset (``/proc/self/clear_refs``, "5"), so
``VmHWM - VmRSS before the step`` is the peak *extra* resident memory of one forward +
backward of the causal-LM loss: activations, gradients, temporaries and the CP exchanges,
not the weights or the Python / torch runtime (the same in every process). Where the reset is
not allowed the bench reports nothing rather than a high-water mark of something else.

Keys: ``hf_peak_mem_cp4_over_single`` (max over ranks at cp = 4 over single, at the largest
measured S, ``hf_mem_seq``), the bytes behind it, and ``hf_max_seq_{single,cp4}_est``: the
longest S whose step fits in ``hf_mem_budget_bytes`` (this machine's memory over 4, what each
of 4 ranks gets), from the quadratic ``peak = a + b S + c S^2`` through the three measured S
(linear through the two largest when the quadratic term comes out <= 0): an extrapolation,
labelled ``_est``.
"""

from __future__ import annotations

import math
import os
from typing import Any

__all__ = ["HF_MEM_CONFIG", "hf_memory_measures"]

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


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
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

    from hp_cp_core import DeepSeekV4CPConfig, enable_cp
    from hp_cp_torch.integrations.transformers import cp_causal_lm_loss, cp_shift_labels
    from hp_cp_torch.integrations.transformers_demo import build_tiny_model, make_inputs

    torch.set_num_threads(1)
    model = build_tiny_model(0, **HF_MEM_CONFIG)
    model.train()
    ids = make_inputs(HF_MEM_CONFIG["vocab_size"], 1, seq)
    pos = torch.arange(seq)[None]
    if cp > 1:
        handle = enable_cp(model, None, DeepSeekV4CPConfig(layout="load_balanced"))
        labels = cp_shift_labels(ids)
        n_tok = (labels != -100).sum()
        ids, pos, labels = (handle.shard(t, 1) for t in (ids, pos, labels))
    if not _reset_peak():
        return None
    before = _status_kib("VmRSS")
    if cp > 1:
        out = model(input_ids=ids, position_ids=pos, use_cache=False)
        cp_causal_lm_loss(out.logits, labels, n_tok).backward()
    else:
        model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss.backward()
    return (_status_kib("VmHWM") - before) * 1024


def _machine_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _longest_seq(seqs: list[int], peaks: list[float], budget: float) -> float:
    """Largest S with ``fit(S) <= budget`` (see the module docstring)."""
    import numpy as np

    c, b, a = np.polyfit(np.asarray(seqs, float), np.asarray(peaks, float), 2)
    if c <= 0:
        b, a = np.polyfit(np.asarray(seqs[-2:], float), np.asarray(peaks[-2:], float), 1)
        return float((budget - a) / b) if b > 0 else float("inf")
    return float((-b + math.sqrt(b * b - 4 * c * (a - budget))) / (2 * c))


def hf_memory_measures(seqs: tuple[int, ...] = (512, 1024, 2048), cp: int = 4) -> dict[str, Any]:
    """The ``hf_*`` memory keys (see the module docstring)."""
    from hp_cp_torch.launch import run_ranks

    res: dict[str, Any] = {}
    peaks: dict[str, list[float]] = {"single": [], f"cp{cp}": []}
    for seq in seqs:
        (single,) = run_ranks(1, _step_peak_worker, seq, 1, timeout=1800)
        ranks = run_ranks(cp, _step_peak_worker, seq, cp, timeout=1800)
        if single is None or any(r is None for r in ranks):
            return {"hf_mem_note": "VmHWM cannot be reset here (/proc/self/clear_refs)"}
        res[f"hf_step_peak_bytes_single_s{seq}"] = single
        res[f"hf_step_peak_bytes_cp{cp}_max_rank_s{seq}"] = max(ranks)
        res[f"hf_step_peak_bytes_cp{cp}_per_rank_s{seq}"] = list(ranks)
        peaks["single"].append(float(single))
        peaks[f"cp{cp}"].append(float(max(ranks)))
    res["hf_mem_seq"] = seqs[-1]
    res[f"hf_peak_mem_cp{cp}_over_single"] = peaks[f"cp{cp}"][-1] / peaks["single"][-1]
    budget = _machine_bytes() // 4
    res["hf_mem_budget_bytes"] = budget
    for name, values in peaks.items():
        res[f"hf_max_seq_{name}_est"] = _longest_seq(list(seqs), values, budget)
    res[f"hf_max_seq_cp{cp}_over_single_est"] = (
        res[f"hf_max_seq_cp{cp}_est"] / res["hf_max_seq_single_est"]
    )
    return res

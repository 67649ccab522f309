"""How much of a slow link's latency shows up in the training step: overlapped against blocking.

Note [Exposed communication]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The 4-layer HF model of :mod:`hp_cp_torch.bench.hotpath` trains at cp = 4 on gloo, twice:
``CPConfig(overlap_exchanges=True)`` (the default) and ``False`` (the blocking
path), two models with the same weights, each under its own handle. A :class:`DelayedLink`
on a handle's group models a slow inter-node link: every point-to-point batch (one halo or
slot exchange, forward or backward, :meth:`TorchGroup.start_p2p`) completes only
:data:`DELAY_S` after it was issued; the delay runs while the rank computes, as a real link's
latency would::

    issue --------- DELAY_S ---------> complete
      |  local work (overlapped path)  |  wait returns at once when the work took longer
      |  nothing (blocking path)       |  wait sleeps out the rest

    exposed_comm_fraction = (step with the link - step without) / summed delays of the step

with the step time the busiest rank's median over interleaved rounds, and the summed delays
that rank's delayed exchanges per step times :data:`DELAY_S`. 1.0: every delay adds to the
step; 0: all hidden under compute. The model is the memory bench's (hidden 1024,
:data:`~hp_cp_torch.bench.memory.HF_MEM_CONFIG`, 4 layers): the tiny demo model has too little
work to hide anything behind. ``exposed_wait_fraction_cp4`` is the share read off the waits
themselves: the part of each delay a wait still had to sit out once the messages had arrived
(the rest was hidden under the work since issue), averaged over the exchanges, the busiest
rank. Free of the compute's noise on a shared machine (a step's seconds vary by more than
its summed delays here); a lower bound where a late peer ate into a delay first. The
agreement's small all-gather (one per forward) is not delayed. Four ranks share this
machine's two cores, so the compute that hides a delay is itself slowed by the other ranks;
the blocking twin runs under the same conditions.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["DELAY_S", "DelayedLink", "overlap_measures"]

DELAY_S = 0.005
"""The link's latency per exchange (a slow inter-node link)."""

SEQ = 1024
ROUNDS = 3
STEPS = 2
WARMUP = 2


class _DelayedWork:
    """A work handle that completes no earlier than ``deadline`` (``time.monotonic``)."""

    def __init__(self, work: Any, deadline: float, link: DelayedLink) -> None:
        self.work, self.deadline, self.link = work, deadline, link

    def wait(self, *args: Any) -> bool:
        self.work.wait(*args)
        left = self.deadline - time.monotonic()
        if left > 0:
            time.sleep(left)
            self.link.slept += left
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed() and time.monotonic() >= self.deadline


class DelayedLink:
    """``TorchGroup.link``: wraps each issued batch of point-to-point work handles so that
    they complete only ``delay_s`` after issue; counts the delayed batches."""

    def __init__(self, delay_s: float = DELAY_S) -> None:
        self.delay_s, self.batches = float(delay_s), 0
        self.slept = 0.0  # the part of the delays a wait sat out (not hidden by compute)

    def __call__(self, works: list[Any]) -> list[Any]:
        if not works:
            return works
        self.batches += 1
        deadline = time.monotonic() + self.delay_s
        return [_DelayedWork(w, deadline, self) for w in works]


def _worker(rank: int, world: int, seq: int, rounds: int, steps: int, delay: float) -> dict:
    import torch
    import torch.distributed as dist

    from hp_cp_core import CPConfig, enable_cp
    from hp_cp_torch.bench.hotpath import N_LAYERS
    from hp_cp_torch.bench.memory import HF_MEM_CONFIG
    from hp_cp_torch.cli.parity import (
        CSA,
        HCA,
        SLIDING,
        build_tiny_model,
        make_inputs,
    )
    from hp_cp_torch.integrations.transformers import cp_causal_lm_loss, cp_shift_labels

    torch.set_num_threads(1)
    ids = make_inputs(HF_MEM_CONFIG["vocab_size"], 1, seq)
    labels = cp_shift_labels(ids)
    n_tok = (labels != -100).sum()
    runs: dict[bool, Any] = {}
    for overlap in (True, False):
        model = build_tiny_model(
            0,
            **HF_MEM_CONFIG,
            num_hidden_layers=N_LAYERS,
            layer_types=[SLIDING, CSA, HCA, CSA],
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        ).train()
        config = CPConfig(layout="load_balanced", overlap_exchanges=overlap)
        handle = enable_cp(model, None, config)
        shard = [handle.shard(t, 1) for t in (ids, torch.arange(seq)[None], labels)]
        runs[overlap] = (model, handle, shard, torch.optim.SGD(model.parameters(), lr=1e-4))

    def step(overlap: bool) -> None:
        model, _, (i, p, y), opt = runs[overlap]
        out = model(input_ids=i, position_ids=p, use_cache=False)
        cp_causal_lm_loss(out.logits, y, n_tok).backward()
        opt.step()
        opt.zero_grad()

    times: dict[tuple[bool, bool], list[float]] = {}
    batches: dict[bool, int] = {}
    slept: dict[bool, list[float]] = {}
    for overlap in (True, False):
        for _ in range(WARMUP):
            step(overlap)
    for _ in range(rounds):
        for overlap in (True, False):
            group = runs[overlap][1].group
            for delayed in (False, True):
                link = DelayedLink(delay if delayed else 0.0)
                group.link = link
                dist.barrier()
                for _ in range(steps):
                    t0 = time.perf_counter()
                    step(overlap)
                    times.setdefault((overlap, delayed), []).append(time.perf_counter() - t0)
                group.link = None
                if delayed:
                    batches[overlap] = link.batches // steps
                    slept.setdefault(overlap, []).append(link.slept / link.batches)
    return {
        "median": {f"{o}_{d}": statistics.median(v) for (o, d), v in times.items()},
        "batches": {str(o): b for o, b in batches.items()},
        "slept": {str(o): statistics.mean(v) for o, v in slept.items()},
    }


def overlap_measures(
    seq: int = SEQ,
    rounds: int = ROUNDS,
    steps: int = STEPS,
    delay: float = DELAY_S,
    world: int = 4,
) -> dict[str, float]:
    """``exposed_comm_fraction_cp4`` (overlapped, the default) and ``..._blocking`` (Note
    [Exposed communication]), with the step times and delays they come from."""
    from hp_cp_torch.cli.launch import run_ranks

    ranks = run_ranks(world, _worker, seq, rounds, steps, delay, timeout=1800)
    res: dict[str, float] = {}
    for overlap, suffix in ((True, ""), (False, "_blocking")):
        plain = max(r["median"][f"{overlap}_False"] for r in ranks)
        slow = max(r["median"][f"{overlap}_True"] for r in ranks)
        summed = max(r["batches"][str(overlap)] for r in ranks) * delay
        res[f"exposed_comm_fraction_cp{world}{suffix}"] = (slow - plain) / summed
        res[f"overlap_step_s_cp{world}{suffix}"] = plain
        res[f"overlap_step_delayed_s_cp{world}{suffix}"] = slow
        res[f"overlap_summed_delays_s_cp{world}{suffix}"] = summed
        slept = max(r["slept"][str(overlap)] for r in ranks)
        res[f"exposed_wait_fraction_cp{world}{suffix}"] = slept / delay
    res["overlap_delay_s"] = delay
    res["overlap_seq"] = float(seq)
    return res


if __name__ == "__main__":
    import json
    import sys

    seq = int(sys.argv[1]) if len(sys.argv) > 1 else SEQ
    print(json.dumps(overlap_measures(seq), indent=1))

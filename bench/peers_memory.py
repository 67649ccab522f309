"""Peak memory per S and the longest S under one memory budget, shared by the peer benches.

One job per side (the peer stack's own CP, then hp_cp) at the same cp runs real training
steps for an increasing ladder of S in the same rank processes. After each step every rank
reads its peak RSS growth over the RSS it had before the first step (``ru_maxrss``, which
only grows, so a later S includes the earlier ones) and the ranks agree on the busiest
rank's value. The budget is the peer's own peak at the ladder's first S; each side climbs
the ladder until its busiest rank goes over the budget (the step after that is not run),
so both longest S are measured, not assumed. If hp_cp is still within the budget at the
top of the ladder, its longest S is a lower bound and the summary says so.

:func:`step_peaks` measures each step alone instead (the method of
``hp_cp_torch.bench.memory``): after one warm-up step at the ladder's first S, before each
step the allocator returns its free memory to the system (``malloc_trim``) and the resident
high-water mark is reset (``/proc/self/clear_refs``), so ``VmHWM - VmRSS`` before the step is
that step's peak extra resident memory, without the one-time costs of a process's first step
(thread pools, communicator buffers, plan caches) that ``ru_maxrss`` keeps in every later S.

:func:`live_peaks` counts tensors, not pages: the most bytes of tensors alive at once during
the step, from the allocations and frees torch's profiler records (``profile_memory``), what
``torch.cuda.max_memory_allocated`` reports on a GPU. The allocator's caching, fragmentation
and the system's paging, which move a CPU step's resident peak by 10-20% from one step to the
next, do not enter it; communicator buffers outside torch's allocator do not either.
"""

from __future__ import annotations

import ctypes
import gc
import resource
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def ladder_peaks(
    step: Callable[[int], Any], ladder: Sequence[int], budget: int | None, group: Any = None
) -> dict[int, int]:
    """In every rank of ``group``: one training step ``step(seq)`` per S of ``ladder``;
    the busiest rank's peak RSS growth per S tried. Stops after the first S over ``budget``
    (``None``: the first S's peak is the budget, the peer's case)."""
    gc.collect()
    base = _rss_bytes()

    def grown(seq: int) -> int:
        step(seq)
        gc.collect()
        return _rss_bytes() - base

    return _climb(grown, ladder, budget, group)


def _climb(
    grown: Callable[[int], int], ladder: Sequence[int], budget: int | None, group: Any
) -> dict[int, int]:
    """Up the ladder: the busiest rank's ``grown(seq)`` per S, until one is over ``budget``."""
    peaks: dict[int, int] = {}
    for seq in ladder:
        busiest = torch.tensor([grown(seq)], dtype=torch.int64)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX, group=group)
        peaks[seq] = int(busiest)
        budget = peaks[seq] if budget is None else budget
        if peaks[seq] > budget:
            break
    return peaks


def _trim_heap() -> None:
    """Hand the C allocator's free memory back to the system (glibc; a no-op elsewhere)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def step_peaks(
    step: Callable[[int], Any], ladder: Sequence[int], budget: int | None, group: Any = None
) -> dict[int, int] | None:
    """Like :func:`ladder_peaks`, each step measured alone (see the module docstring): the
    busiest rank's peak extra resident bytes of the step at every S tried. ``None`` where the
    high-water mark cannot be reset (no number rather than a different one)."""
    from hp_cp_torch.bench.memory import reset_peak, status_bytes

    allowed = torch.tensor([int(reset_peak())], dtype=torch.int64)
    dist.all_reduce(allowed, op=dist.ReduceOp.MIN, group=group)
    if not int(allowed):
        return None
    step(ladder[0])  # warm-up: the process's one-time costs

    def grown(seq: int) -> int:
        gc.collect()
        _trim_heap()
        reset_peak()
        before = status_bytes("VmRSS")
        step(seq)
        return status_bytes("VmHWM") - before

    return _climb(grown, ladder, budget, group)


def live_peaks(
    step: Callable[[int], Any], ladder: Sequence[int], budget: int | None, group: Any = None
) -> dict[int, int]:
    """Like :func:`ladder_peaks`, the busiest rank's live-tensor peak of each step (see the
    module docstring), after one warm-up step at the ladder's first S."""
    from hp_cp_torch.bench.memory import live_tensor_peak

    step(ladder[0])
    return _climb(lambda seq: live_tensor_peak(lambda: step(seq)), ladder, budget, group)


def max_seq_summary(
    peer: str,
    peer_peaks: dict[int, int],
    ours_peaks: dict[int, int],
    budget: int | None = None,
    budget_is: str | None = None,
) -> dict:
    """``ours_max_seq_over_<peer>`` and the measurement behind it (every S tried, both sides).
    ``budget``: default the peer's own peak at its first S (``budget_is`` says what else)."""
    own = budget is None
    budget = peer_peaks[min(peer_peaks)] if own else budget

    def longest(peaks: dict[int, int]) -> int:
        return max((s for s, p in peaks.items() if p <= budget), default=0)

    top = max(ours_peaks)
    lower_bound = ours_peaks[top] <= budget  # never went over: the ladder ended first
    return {
        f"ours_max_seq_over_{peer}": longest(ours_peaks) / max(longest(peer_peaks), 1),
        f"ours_max_seq_over_{peer}_is_lower_bound": lower_bound,
        f"{peer}_max_seq_measured": {
            "budget_bytes": budget,
            "budget_is": f"{peer}'s busiest-rank peak RSS growth of a training step at S="
            f"{min(peer_peaks)}"
            if own
            else budget_is,
            peer: longest(peer_peaks),
            "ours": longest(ours_peaks),
            f"peaks_{peer}": {str(s): p for s, p in sorted(peer_peaks.items())},
            "peaks_ours": {str(s): p for s, p in sorted(ours_peaks.items())},
            "ours_stopped_by": f"the ladder's top S={top}" if lower_bound else "the budget",
        },
    }

"""The one schema of ``Group.stats()`` (and so of ``handle.stats()``), for every backend.

A group counts what it moved since it was made::

    {"bytes_sent": 4096, "bytes_recv": 4096,
     "collectives": {"halo_exchange": 1, "all_gather": 1,              # forward
                     "halo_exchange_bwd": 1, "all_gather_bwd": 1}}     # backward

``collectives`` maps a kind to its number of calls. The kinds of the layer exchanges are the
names below; a backend may count more kinds (``meta``, ``all_reduce``, its own point-to-point
exchanges), each a string key with an ``int`` count. Bytes are payload bytes of this rank
(what a collective moves for it, not the framework's buffers), so that the numbers of two
backends compare. A backend may add more top-level keys (``by_kind``, ``device``...).
:func:`check_stats` is what the contract suite asserts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

HALO_EXCHANGE = "halo_exchange"
"""``Group.exchange_rows`` forward (one per layer forward)."""
HALO_EXCHANGE_BWD = "halo_exchange_bwd"
"""``Group.exchange_rows`` backward."""
ALL_GATHER = "all_gather"
"""``Group.all_gather_rows`` forward (one per layer forward with r > 0)."""
ALL_GATHER_BWD = "all_gather_bwd"
"""``Group.all_gather_rows`` backward (a reduce-scatter, or an all-reduce and a slice)."""
SLOT_EXCHANGE = "slot_exchange"
"""A point-to-point exchange of compressed slots, where a backend sends each rank only the
slots it reads instead of all-gathering them (counts in place of ``all_gather``)."""
SLOT_EXCHANGE_BWD = "slot_exchange_bwd"
"""Its backward."""
META = "meta"
"""``Group.all_gather_meta`` (the agreement before any exchange; optional to count)."""

LAYER_KINDS = (
    HALO_EXCHANGE,
    HALO_EXCHANGE_BWD,
    ALL_GATHER,
    ALL_GATHER_BWD,
    SLOT_EXCHANGE,
    SLOT_EXCHANGE_BWD,
)


class GroupStats(TypedDict):
    """What ``Group.stats()`` returns (at least)."""

    bytes_sent: int
    bytes_recv: int
    collectives: dict[str, int]


def new_stats() -> GroupStats:
    """Zero counters, for a group to update."""
    return {"bytes_sent": 0, "bytes_recv": 0, "collectives": {}}


def count(stats: GroupStats, kind: str, sent: int, recv: int) -> None:
    """Add one call of ``kind`` moving ``sent`` / ``recv`` bytes to ``stats`` in place."""
    stats["bytes_sent"] += int(sent)
    stats["bytes_recv"] += int(recv)
    stats["collectives"][kind] = stats["collectives"].get(kind, 0) + 1


def check_stats(stats: Any) -> list[str]:
    """What is wrong with ``stats`` against :class:`GroupStats` (empty: nothing)."""
    if not isinstance(stats, Mapping):
        return [f"stats() must return a dict, got {type(stats).__name__}"]
    problems = []
    for key in ("bytes_sent", "bytes_recv"):
        value = stats.get(key)
        if not _is_count(value):
            problems.append(f"stats()[{key!r}] must be an int >= 0, got {value!r}")
    calls = stats.get("collectives")
    if not isinstance(calls, Mapping):
        problems.append(
            f"stats()['collectives'] must be a dict of kind -> calls, got {calls!r} (kinds: "
            f"{', '.join(LAYER_KINDS)}, see hp_cp_core.stats)"
        )
        return problems
    for kind, n in calls.items():
        if not isinstance(kind, str) or not _is_count(n):
            problems.append(f"stats()['collectives'][{kind!r}] must be an int >= 0, got {n!r}")
    return problems


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0

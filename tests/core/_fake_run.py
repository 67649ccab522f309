"""Drive one CP forward of the fake backend's toy layer on N thread-ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hp_cp_core import DeepSeekV4CPConfig, disable_cp, enable_cp
from hp_cp_core.plugins import PluginHost
from hp_cp_fake import fake_backend as fb


@dataclass
class RankResult:
    """What one rank saw: its full (unsharded) output, local output, and its group's stats."""

    full: np.ndarray
    local: np.ndarray
    stats: dict[str, Any]
    log: list[dict[str, Any]]


def fake_host() -> PluginHost:
    """A plugin host with autoload off and the fake backend registered as ``fake``."""
    host = PluginHost(autoload=False)
    host.add(fb, "fake")
    return host


def make_layer(r: int, window: int, grid: str = "per_document", topk: int = 3) -> fb.ToyAttention:
    return fb.ToyAttention(compress_ratio=r, window_size=window, index_topk=topk, packed_grid=grid)


def run_cp(
    host: PluginHost,
    *,
    cp: int,
    x: np.ndarray,
    r: int,
    window: int,
    layout: str = "contiguous",
    cu: Any = None,
    grid: str = "per_document",
    topk: int = 3,
    point_to_point: bool = True,
) -> list[RankResult]:
    """Every rank builds its own toy layer (same weights), enables CP, runs, unshards.

    ``point_to_point=False``: the group offers no point-to-point, slots go by all-gather."""
    world = fb.FakeWorld(cp, point_to_point=point_to_point)
    config = DeepSeekV4CPConfig(layout=layout)

    def rank_fn(rank: int) -> RankResult:
        layer = make_layer(r, window, grid, topk)
        handle = enable_cp(layer, fb.FakeMesh(world, rank), config, plugins=host)
        try:
            local = layer(handle.shard(x, 0), cu_seqlens=cu)
            with world.lock:
                mine = [e for e in world.log if e["rank"] == rank]
            stats = handle.stats()
            full = handle.unshard(local, 0)
        finally:
            disable_cp(handle)
        return RankResult(full, local, stats, mine)

    return world.run(rank_fn)

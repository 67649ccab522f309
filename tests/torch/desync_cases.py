"""Rank-side cases of ``test_desync_report.py``: ranks that skip a backward, so the others
wait in a CP collective until the group's short timeout, and report where everyone is.

Run through the job machinery of ``cases.py`` as the suite ``"desync_cases:desync_suite"``
on 3 ranks. Each case builds a fresh CP process group with a :data:`TIMEOUT_S` timeout
(abandoned after the failure; a barrier on the default group lines the ranks up again) and
a two-layer stack of reference layers under one ``enable_cp`` handle; two healthy steps
run first, the store wrapped to count what the desync report does with it.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from cases import layer_config
from torch import nn

from hp_cp_core import DeepSeekV4CPConfig, HpCpError, disable_cp, enable_cp
from hp_cp_torch.bench.hotpath import CountingStore
from hp_cp_torch.reference import DeepSeekV4Attention

TIMEOUT_S = 3.0
"""Collective timeout of each case's CP group (seconds)."""

SKIPPERS = {"ranks_1_2_skip": (1, 2), "rank_2_skips": (2,)}
"""Case name -> the ranks whose loss does not depend on the layers' output."""


class Stack(nn.Module):
    """Two CSA layers with residuals: layer 0, then layer 1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(DeepSeekV4Attention(layer_config(4)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def skipped_backward_case(skippers: tuple[int, ...]) -> dict[str, Any]:
    """Every rank runs the forward; ``skippers`` take a loss that does not depend on it, so
    they run no backward collective. Returns what this rank raised (class, message) and the
    store operations it ran before the failure (``ops_before``) and in all."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=TIMEOUT_S))
    model = Stack().eval()  # eval: no indexer-loss all-reduce in the forward
    x = torch.randn(2, 8 * world, 32, generator=torch.Generator().manual_seed(1))
    handle = enable_cp(model, pg, DeepSeekV4CPConfig())
    store = handle.group.log.store = CountingStore(handle.group.log.store)
    error, ops_before = None, None
    try:
        xl = handle.shard(x, 1).requires_grad_(True)
        for _ in range(2):  # a healthy step first: no store traffic
            model(xl).sum().backward()
        out = model(xl)
        ops_before = store.ops
        loss = (xl * 2).sum() if rank in skippers else out.sum()
        loss.backward()
    except HpCpError as exc:
        error = (type(exc).__name__, str(exc))
    finally:
        disable_cp(handle)
    dist.barrier()  # the default group (long timeout) lines the ranks up for the next case
    return {"error": error, "ops_before": ops_before, "ops": store.ops}


def desync_suite(world: int) -> dict[str, tuple[Callable, tuple]]:
    return {name: (skipped_backward_case, (who,)) for name, who in SKIPPERS.items()}

"""The example model adapter (``tests/model_example``, installed only through its entry
points) under CP: cases run inside the gloo ranks of the torch suites' shared jobs
(``cases.JOINT_SUITES``: suite ``"model_example_cases:example_suite"``, worlds 1 to 4).

Each case builds :class:`hp_cp_model_example.model.PooledStack` (layers of ratio 0, 4 with the
indexer, and 128) from a seed, runs it under ``hp_cp_core.enable_cp`` on this rank's rows,
forward and backward, and returns on rank 0 the unsharded output, the input's gradient and
every parameter's gradient summed over the group, by name. The test compares them with the
same model on one process, in the pytest process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hp_cp_core import DeepSeekV4CPConfig, disable_cp, enable_cp

ROWS = 384
"""Global rows: divisible by 2 * cp for cp 1 to 4 (both layouts), three ratio-128 slots."""

DOCS = [0, 5, 130, 131, 300, 384]
"""Packed documents: shorter than the window and than r, one row, spanning ranks."""


@dataclass(frozen=True)
class ExampleCase:
    cp: int
    layout: str
    packed: bool
    kernel: str = "banded"

    @property
    def name(self) -> str:
        kind = "packed" if self.packed else "padded"
        return f"example-cp{self.cp}-{self.layout}-{kind}-{self.kernel}"


def example_cases(world: int) -> list[ExampleCase]:
    """cp = ``world``: both layouts, padded and packed; one more with the third party's kernel
    and one with ``model_ops`` (the base's kernel fallback)."""
    cases = [
        ExampleCase(world, layout, packed)
        for layout in ("contiguous", "load_balanced")
        for packed in (False, True)
    ]
    if world == 2:
        cases.append(ExampleCase(2, "load_balanced", True, kernel="example_dense"))
        cases.append(ExampleCase(2, "contiguous", False, kernel="model_ops"))
    return cases


def build(seed: int = 0) -> Any:
    from hp_cp_model_example.model import PooledStack

    torch.manual_seed(seed)
    return PooledStack()


def inputs(case: ExampleCase) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, g)``: the input rows and the output's gradient seed (``[1, S, 32]`` packed,
    ``[2, S, 32]`` padded)."""
    gen = torch.Generator().manual_seed(7)
    batch = 1 if case.packed else 2
    x = torch.randn(batch, ROWS, 32, generator=gen)
    return x, torch.randn(batch, ROWS, 32, generator=gen)


def run_cp(case: ExampleCase) -> dict:
    model = build()
    x, g = inputs(case)
    config = DeepSeekV4CPConfig(
        layout=case.layout,
        attention_kernel=case.kernel,
        query_chunk=40,
        single_rank_bypass=False,  # cp = 1 runs the CP path
    )
    handle = enable_cp(model, None, config)
    try:
        adapters = sorted({type(a).__name__ for a in _pinned(model)})
        xl = handle.shard(x, 1).requires_grad_(True)
        if case.packed:
            out = model(xl, doc_bounds=torch.tensor(DOCS))
        else:
            out = model(xl, pos=handle.shard(torch.arange(ROWS)[None].expand(2, -1), 1))
        (out * handle.shard(g, 1)).sum().backward()
        full = handle.unshard(out.detach(), 1)
        gx = handle.unshard(xl.grad, 1)
        pg = getattr(handle.group, "pg", None)
        grads = {}
        for name, p in model.named_parameters():
            grad = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            dist.all_reduce(grad, group=pg)
            grads[name] = grad
    finally:
        disable_cp(handle)
    res = {"cp_rank": handle.group.rank, "adapters": adapters, "unpinned": not _pinned(model)}
    if handle.group.rank == 0:
        res.update(out=full, gx=gx, grads=grads)
    return res


def _pinned(model: Any) -> list[Any]:
    from hp_cp_torch.adapter import ADAPTER_ATTR

    return [m.__dict__[ADAPTER_ATTR] for m in model.modules() if ADAPTER_ATTR in m.__dict__]


def single_process(case: ExampleCase) -> dict:
    model = build()
    x, g = inputs(case)
    x.requires_grad_(True)
    out = model(x, doc_bounds=torch.tensor(DOCS)) if case.packed else model(x)
    (out * g).sum().backward()
    grads = {
        n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()
    }
    return {"out": out.detach(), "gx": x.grad, "grads": grads}


def params(model: Any) -> list[tuple[str, Any]]:
    return list(model.named_parameters())


def example_suite(world: int) -> dict[str, tuple[Any, tuple]]:
    if world > 4:
        return {}
    return {c.name: (run_cp, (c,)) for c in example_cases(world)}

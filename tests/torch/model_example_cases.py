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
    registered: bool = False
    """The adapter registered in this process (``register_model_adapter``, shadowing the
    entry point) instead of by entry point."""
    api: str = "0.4"
    """``"0.3"``: the guide's 0.3.0 adapter, unchanged (``hp_cp_model_example.adapter_v03``),
    registered in this process."""

    @property
    def name(self) -> str:
        kind = "packed" if self.packed else "padded"
        how = "-registered" if self.registered else ""
        api = "-v03" if self.api == "0.3" else ""
        return f"example-cp{self.cp}-{self.layout}-{kind}-{self.kernel}{how}{api}"

    @property
    def adapter(self) -> str:
        """The adapter class the layers must run with."""
        return "InProcessAdapter" if self.registered else "PooledAttentionAdapter"


def example_cases(world: int) -> list[ExampleCase]:
    """cp = ``world``: both layouts, padded and packed; one more with the third party's kernel
    and one with ``model_ops`` (the base's kernel fallback); at cp 3 one with the adapter
    registered in this process; at cp 2 and 3 the guide's 0.3.0 adapter, padded and packed."""
    cases = [
        ExampleCase(world, layout, packed)
        for layout in ("contiguous", "load_balanced")
        for packed in (False, True)
    ]
    if world == 2:
        cases.append(ExampleCase(2, "load_balanced", True, kernel="example_dense"))
        cases.append(ExampleCase(2, "contiguous", False, kernel="model_ops"))
    if world == 3:
        cases.append(ExampleCase(3, "load_balanced", True, registered=True))
    if world in (2, 3):
        for packed in (False, True):
            cases.append(ExampleCase(world, "load_balanced", packed, registered=True, api="0.3"))
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
    import warnings

    from hp_cp_model_example.model import PooledAttention

    if case.api == "0.3":
        with warnings.catch_warnings():  # the 0.3 names warn (test_model_spec.py)
            warnings.simplefilter("ignore", DeprecationWarning)
            from hp_cp_model_example.adapter_v03 import PooledAttentionAdapter
    else:
        from hp_cp_model_example.adapter import PooledAttentionAdapter

    from hp_cp_torch import register_model_adapter, unregister_model_adapter

    class InProcessAdapter(PooledAttentionAdapter):
        """The example's adapter, registered in this process only."""

    model = build()
    x, g = inputs(case)
    config = DeepSeekV4CPConfig(
        layout=case.layout,
        attention_kernel=case.kernel,
        query_chunk=40,
        single_rank_bypass=False,  # cp = 1 runs the CP path
    )
    if case.registered:
        register_model_adapter("hp_cp_model_example.model:PooledAttention", InProcessAdapter)
    try:
        handle = enable_cp(model, None, config)
    finally:
        unregister_model_adapter(PooledAttention)  # layers keep the adapter they were given
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
    suite = {c.name: (run_cp, (c,)) for c in example_cases(world)}
    if world <= 2:
        suite[f"hooks-cp{world}"] = (run_hooks, (world,))
    return suite


# --------------------------------------------------------------------------- optional hooks


def checked_adapter(layer: Any) -> Any:
    """The example's adapter with the optional hooks a model may declare: ``check_inputs``
    (a rank-local refusal), ``value_checks`` on the position ids (counted; skipped by a later
    layer handed the same ``pos``) and a projection whose queries are made as ``local_work``
    while the exchanges travel."""
    from hp_cp_model_example.adapter import PooledAttentionAdapter

    from hp_cp_torch.model.spec import Projection

    class CheckedAdapter(PooledAttentionAdapter):
        _refuse = False
        _value_checks_run = 0

        def check_inputs(self, inputs: Any, checks: Any) -> None:
            super().check_inputs(inputs, checks)
            if self._refuse:
                checks.fail("was told to refuse on this rank")

        def value_checks(self, inputs: Any, plan: Any) -> list[tuple[Any, str]]:
            self._value_checks_run += 1
            pos = inputs.position_ids
            if pos is None:
                return []
            want = torch.as_tensor(plan.positions)
            return [((pos.reshape(-1, pos.shape[-1]) != want).any(), "pos is not the plan's")]

        def project(self, state: Any) -> Projection:
            q, kv = self.module.project(state.hidden, state.positions)
            projection = Projection(None, kv)

            def queries() -> None:
                projection.query = q

            projection.local_work = (queries,)
            return projection

    return CheckedAdapter(layer)


def run_hooks(world: int) -> dict:
    """The optional hooks under CP (padded, cp = ``world``): the output equals the example's
    (queries from ``local_work``); value checks run once per forward at cp 1 (the later
    layers are handed the same objects); a bad ``pos`` or a refusal on the last rank only
    raises the same ``HpCpError`` on every rank."""
    from hp_cp_core import HpCpError
    from hp_cp_torch.adapter import ADAPTER_ATTR

    case = ExampleCase(world, "contiguous", False)
    model = build()
    adapters = [checked_adapter(layer) for layer in model.layers]
    for layer, adapter in zip(model.layers, adapters):
        layer.__dict__[ADAPTER_ATTR] = adapter  # set explicitly: the test removes it
    x, _ = inputs(case)
    config = DeepSeekV4CPConfig(query_chunk=40, single_rank_bypass=False)
    res: dict[str, Any] = {"errors": {}}
    try:
        # each bad call on a fresh handle: its first forward agrees across ranks (a later
        # forward of the same shapes reuses that agreement, and then only the bad rank raises)
        for name in ("ok", "bad_pos", "refusal"):
            handle = enable_cp(model, None, config)
            res["cp_rank"], last = handle.group.rank, handle.group.rank == handle.group.size - 1
            pos = handle.shard(torch.arange(ROWS)[None].expand(2, -1), 1)
            adapters[0]._refuse = name == "refusal" and last
            try:
                with torch.no_grad():
                    out = model(
                        handle.shard(x, 1), pos=pos + 1 if name == "bad_pos" and last else pos
                    )
                if name == "ok":
                    res["out"] = handle.unshard(out, 1)
                    res["value_checks_run"] = sum(a._value_checks_run for a in adapters)
                else:
                    res["errors"][name] = "no error"
            except HpCpError as exc:
                res["errors"][name] = str(exc)
            finally:
                disable_cp(handle)
    finally:
        for layer in model.layers:
            layer.__dict__.pop(ADAPTER_ATTR, None)
    return res

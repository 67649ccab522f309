"""Rank functions of tests/torch/test_row_exchange.py: the runner's exchange of a side tensor
(:class:`hp_cp_torch.model.runner.RowExchange`, ``handle.row_exchange(window, name)``).

The side computation is a model-level module's: a depthwise causal convolution over the
``W`` rows ``t - W + 1 .. t`` of row ``t``'s document (what V4.1's Engram hash reads of its
token ids, with weights, so that gradients flow back through the exchange). Each case runs
it on one process (the whole sequence, written out in the test) and under CP (this rank's
rows, :meth:`RowPlan.exchange` and :attr:`RowPlan.lookback`), output and gradients compared.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import torch.distributed as dist

from hp_cp_core import CPConfig, HpCpError, disable_cp, enable_cp
from hp_cp_torch.model.runner import model_handle
from hp_cp_torch.model.spec import RECORDED, ModelHandle

BATCH, WIDTH = 2, 5


@dataclasses.dataclass(frozen=True)
class RowCase:
    """One run: ``rows`` global rows (no multiple of anything), a window of ``window`` rows,
    ``cu`` packed document boundaries (``None``: padded batch of 2), the layout, and
    whether the boundaries reach the exchange as ``RECORDED`` (``handle.batch``'s)."""

    cp: int
    rows: int
    window: int
    layout: str = "contiguous"
    cu: tuple[int, ...] | None = None
    recorded: bool = False

    @property
    def name(self) -> str:
        docs = "padded" if self.cu is None else ("recorded" if self.recorded else "packed")
        return f"cp{self.cp}-S{self.rows}-W{self.window}-{self.layout}-{docs}"


CASES = [
    RowCase(1, 37, 4),
    RowCase(1, 23, 3, cu=(0, 5, 6, 23)),
    RowCase(3, 37, 4),
    RowCase(3, 37, 4, "load_balanced"),
    RowCase(3, 41, 5, cu=(0, 2, 17, 18, 41)),
    RowCase(3, 41, 3, "load_balanced", cu=(0, 9, 10, 30, 41), recorded=True),
    RowCase(3, 7, 6),  # fewer rows than ranks x window: halos from several ranks back
]


def _inputs(case: RowCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(case.rows * 31 + case.window)
    batch = 1 if case.cu is not None else BATCH
    x = torch.randn(batch, case.rows, WIDTH, generator=gen, dtype=torch.float64)
    weight = torch.randn(case.window, WIDTH, generator=gen, dtype=torch.float64)
    grad = torch.randn(batch, case.rows, WIDTH, generator=gen, dtype=torch.float64)
    return x, weight, grad


def one_process(case: RowCase) -> dict[str, torch.Tensor]:
    """The convolution on the whole sequence, written out: ``y[t] = sum_k w[k] x[t - k]``
    over the rows of ``t``'s document."""
    x, weight, grad = _inputs(case)
    x.requires_grad_(True)
    weight.requires_grad_(True)
    cu = list(case.cu) if case.cu is not None else [0, case.rows]
    out = torch.zeros_like(x)
    for lo, hi in zip(cu[:-1], cu[1:]):
        for t in range(lo, hi):
            for k in range(min(case.window, t - lo + 1)):
                out[:, t] = out[:, t] + weight[k] * x[:, t - k]
    gx, gw = torch.autograd.grad((out * grad).sum(), [x, weight])
    return {"out": out.detach(), "gx": gx, "gw": gw}


def _conv(ext: torch.Tensor, lookback: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[B, L, D]``: the convolution of each local row from the exchanged frame ``ext [B, E,
    D]`` and ``lookback [L, W]`` (``-1``: outside the document)."""
    rows = ext[:, lookback.clamp_min(0)]  # [B, L, W, D]
    keep = (lookback >= 0).to(ext.dtype)[None, :, :, None]
    return (rows * keep * weight[None, None]).sum(2)


def row_case(case: RowCase, group: Any) -> dict[str, Any]:
    """The convolution under CP on ``group``; on its rank 0 the unsharded output and input
    gradient and the summed weight gradient, on every rank the view and the traffic."""
    from cases import build_layer, parity_case

    layer = build_layer(parity_case(case.cp, 0))  # any installed layer: a handle to use
    config = CPConfig(layout=case.layout, single_rank_bypass=False)
    handle = enable_cp(layer, group, config)
    try:
        view_handle = model_handle(handle)
        exchange = view_handle.row_exchange(case.window, "causal conv")
        x, weight, grad = _inputs(case)
        weight.requires_grad_(True)
        xl = handle.shard(x, 1, pad_value=0.0).requires_grad_(True)
        gl = handle.shard(grad, 1, pad_value=0.0)
        cu: Any = None
        if case.cu is not None:
            cu = handle.padding(case.rows).cu_seqlens(list(case.cu))
            if case.recorded:
                handle.sequence.record_documents(cu)
                cu = RECORDED
        before = dict(handle.stats()["collectives"])
        documents = view_handle.documents(xl.shape[1] * handle.group.size)
        plan, ext = exchange(xl, cu_seqlens=cu)
        lookback = torch.as_tensor(plan.lookback)
        out = _conv(ext, lookback, weight)
        (out * gl).sum().backward()
        after = dict(handle.stats()["collectives"])
        pg = getattr(handle.group, "pg", None)
        gw = weight.grad.clone()
        if pg is not None:
            dist.all_reduce(gw, group=pg)
        full_out = handle.unshard(out.detach(), 1)[:, : case.rows]
        full_gx = handle.unshard(xl.grad, 1)[:, : case.rows]
        res: dict[str, Any] = {
            "name": case.name,
            "rank": handle.group.rank,
            "frame": tuple(ext.shape),
            "local": tuple(xl.shape),
            "real_rows": plan.view.real_rows,
            "documents": None if documents is None else [int(c) for c in documents],
            "halo_exchanges": after.get("halo_exchange", 0) - before.get("halo_exchange", 0),
            "backward_exchanges": after.get("halo_exchange_bwd", 0)
            - before.get("halo_exchange_bwd", 0),
        }
        if handle.group.rank == 0:
            res.update(out=full_out, gx=full_gx, gw=gw)
        return res
    finally:
        disable_cp(handle)


def refused_case(group: Any) -> list[str]:
    """A value check failing on one rank (its flag) and a problem on one rank: every rank
    raises the same ``HpCpError``, naming the exchange, before any exchange."""
    from cases import build_layer, parity_case

    layer = build_layer(parity_case(group.size(), 0))
    handle = enable_cp(layer, group, CPConfig(single_rank_bypass=False))
    messages = []
    try:
        exchange = model_handle(handle).row_exchange(3, "causal conv")
        xl = handle.shard(torch.zeros(1, 6 * group.size(), 2), 1)
        last = handle.group.rank == handle.group.size - 1
        for kwargs in (
            {"flags": [(torch.tensor(last), "a bad token id on the last rank.")]},
            {"problems": ["a bad shape on the last rank."] if last else []},
        ):
            before = dict(handle.stats()["collectives"])
            try:
                exchange.agree(xl, **kwargs)
                messages.append("no error")
            except HpCpError as exc:
                messages.append(str(exc))
            after = dict(handle.stats()["collectives"])
            assert after.get("halo_exchange") == before.get("halo_exchange"), (before, after)
        plan = exchange.agree(xl)
        try:  # rows other than those agreed on: refused before the exchange
            plan.exchange(xl[:, 1:])
            messages.append("no error")
        except HpCpError as exc:
            messages.append(str(exc))
    finally:
        disable_cp(handle)
    return messages


def handle_view_case(group: Any) -> dict[str, Any]:
    """What ``prepare_model`` is handed: a frozen :class:`ModelHandle`; a 0.4 read of the
    core's handle warns and still works."""
    from cases import build_layer, parity_case

    layer = build_layer(parity_case(group.size(), 0))
    handle = enable_cp(layer, group, CPConfig(single_rank_bypass=False))
    try:
        view = model_handle(handle)
        out: dict[str, Any] = {"type": type(view) is ModelHandle, "cp_size": view.cp_size}
        try:
            view.cp_size = 7  # type: ignore[misc]
            out["frozen"] = False
        except dataclasses.FrozenInstanceError:
            out["frozen"] = True
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out["group_size"] = view.group.size
        out["warned"] = [str(w.message) for w in seen if w.category is DeprecationWarning]
        return out
    finally:
        disable_cp(handle)


def row_suite(rank: int, world: int) -> dict[str, Any]:
    """Every case on its group (cp 1: rank 0 alone; cp 3: the world); ranks outside a case's
    group skip it."""
    torch.set_num_threads(1)
    groups = {1: dist.new_group([0]), world: dist.group.WORLD}
    out: dict[str, Any] = {}
    for case in CASES:
        if rank < case.cp:
            out[case.name] = row_case(case, groups[case.cp])
        dist.barrier()
    out["refused"] = refused_case(groups[world])
    out["handle"] = handle_view_case(groups[world])
    return out

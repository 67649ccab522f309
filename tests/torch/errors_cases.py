"""Rank-side cases of ``test_reliability_errors.py``: bad input, ranks that disagree, a rank
that fails inside the layer, and backward passes whose gradients are zero.

Run through the job machinery of ``cases.py`` as the suite ``"errors_cases:errors_suite"``
(one job per world size). In every case the *last* rank is the odd one out (bad input, a
different config, the injected fault); ranks return what they saw (error class, message,
cause, seconds, traffic counters) and the test asserts on it.

The fault cases run on a fresh process group with a short timeout (:data:`FAULT_TIMEOUT_S`),
so the ranks left waiting fail fast; the group is abandoned afterwards and a barrier on the
default group lines the ranks up again for the next case.
"""

from __future__ import annotations

import datetime
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from cases import (
    AdapterCase,
    Case,
    SeqMajorCSA,
    _loss,
    _sum_over_group,
    adapter_inputs,
    build_layer,
    empty_rank_cases,
    make_inputs,
)

from hp_cp_core import DeepSeekV4CPConfig, HpCpError, LayerSpec, disable_cp, enable_cp, hookimpl

FAULT_TIMEOUT_S = 3.0
"""Collective timeout of the fault cases' process group (seconds)."""

Outcome = tuple[str, str, str | None] | None
"""``(error class, message, class of __cause__)``, or ``None`` when the call succeeded."""


def _outcome(fn: Callable[[], Any]) -> Outcome:
    """Run ``fn``; an ``HpCpError`` is the expected result, anything else fails the case."""
    try:
        fn()
    except HpCpError as exc:
        cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else None
        return type(exc).__name__, str(exc), cause
    return None


def _traffic(handle: Any) -> dict[str, int]:
    return dict(handle.stats()["collectives"])


def _run_variants(handle: Any, variants: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Each variant's outcome and whether any data collective ran during it."""
    out = {}
    for name, fn in variants.items():
        before = _traffic(handle)
        result = _outcome(fn)
        out[name] = {"outcome": result, "data_collectives": _traffic(handle) != before}
    return out


# ------------------------------------------------------------------ validation: reference layer


def reference_bad_inputs() -> dict[str, Any]:
    """The reference layer, bad input on the last rank only (or on every rank where noted)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    rank, world = dist.get_rank(), dist.get_world_size()
    bad = world - 1
    mesh = init_device_mesh("cpu", (world,))  # for the DTensor variant (every rank joins)
    padded, packed = Case(world, 4, chunk=4), Case(world, 4, packed=True, chunk=4)
    layer = build_layer(padded)
    x, _, _ = make_inputs(padded)  # [2, S, 32]
    xp, _, _ = make_inputs(packed)  # [S, 32]
    total = padded.total
    handle = enable_cp(layer, None)
    xl, xpl = handle.shard(x, 1), handle.shard(xp, 0)
    pos = handle.shard(torch.arange(total), 0)

    def on_bad(good: Any, wrong: Any) -> Any:
        return wrong if rank == bad else good

    good_cu = torch.tensor([0, 5, total])
    variants = {
        "x_dims": lambda: layer(on_bad(xl, xl[None])),
        "x_hidden": lambda: layer(on_bad(xl, xl[..., :16])),
        "x_dtype": lambda: layer(on_bad(xl, xl.double())),
        "x_int": lambda: layer(on_bad(xl, xl.long())),
        "x_device": lambda: layer(on_bad(xl, xl.to("meta"))),
        "x_dtensor": lambda: layer(
            on_bad(xl, DTensor.from_local(xl, mesh, [Replicate()], run_check=False))
        ),
        "position_ids": lambda: layer(xl, position_ids=on_bad(pos, pos[:-1])),
        "cu_not_zero": lambda: layer(xpl, cu_seqlens=on_bad(good_cu, torch.tensor([3, total]))),
        "cu_decreasing": lambda: layer(xpl, cu_seqlens=torch.tensor([0, 10, 6, total])),
        "cu_end": lambda: layer(xpl, cu_seqlens=torch.tensor([0, 5, xpl.shape[0]])),
        "cu_2d": lambda: layer(xpl, cu_seqlens=on_bad(good_cu, good_cu[None])),
        "cu_float": lambda: layer(
            xpl, cu_seqlens=on_bad(good_cu, torch.tensor([0.0, 2.5, float(total)]))
        ),
    }
    try:
        out = _run_variants(handle, variants)
        with torch.no_grad():  # the group still works, and every rank is in step
            out["after"] = tuple(layer(xl).shape)
    finally:
        disable_cp(handle)
    lb_layer = build_layer(Case(world, 0))
    lb = enable_cp(lb_layer, None, DeepSeekV4CPConfig(layout="load_balanced"))
    try:  # 2 * 3 rows on 2 ranks: not 2cp chunks
        out.update(_run_variants(lb, {"lb_odd": lambda: lb_layer(torch.randn(2, 3, 32))}))
    finally:
        disable_cp(lb)
    return out


# ------------------------------------------------------------------ validation: generic adapter


def csa_bad_inputs() -> dict[str, Any]:
    """A module patched with ``patch_torch_deepseek_v4_csa_forward``; bad input on the last
    rank only."""
    from hp_cp_torch import patch_torch_deepseek_v4_csa_forward

    rank, world = dist.get_rank(), dist.get_world_size()
    bad = world - 1
    case = AdapterCase(world, 4)
    module = SeqMajorCSA(case.r, case.window, case.seed)
    inputs, _ = adapter_inputs(case)
    handle = patch_torch_deepseek_v4_csa_forward(module, cp_mesh=None)
    q, k, x, qr = (handle.shard(t, 0) for t in inputs)

    def on_bad(good: Any, wrong: Any) -> Any:
        return wrong if rank == bad else good

    variants = {
        "query_dims": lambda: module(on_bad(q, q[:, :, 0]), k, x, qr),
        "batch": lambda: module(q, on_bad(k, torch.cat([k, k[:, :1]], 1)), x, qr),
        "kv_heads": lambda: module(q, on_bad(k, torch.cat([k, k], 2)), x, qr),
        "head_dim": lambda: module(q, on_bad(k, k[..., :8]), x, qr),
        "rows": lambda: module(q, k, on_bad(x, x[:-1]), qr),
        "dtype": lambda: module(q, k, x, on_bad(qr, qr.double())),
        "extra_args": lambda: module(q, k, x, qr, *on_bad((), (1,))),
    }
    total = world * q.shape[0]
    good_cu = torch.tensor([0, 5, total])
    bad_cu = {  # packed input: a bad or disagreeing cu_seqlens on the last rank only
        "cu_decreasing": torch.tensor([0, 9, 5, total]),
        "cu_end": torch.tensor([0, 5, total + 2]),
        "cu_dims": torch.tensor([[0, 5, total]]),
        "cu_disagree": torch.tensor([0, 7, total]),
    }
    for name, cu in bad_cu.items():
        variants[name] = functools.partial(
            lambda cu: module(q, k, x, qr, cu_seqlens=on_bad(good_cu, cu)), cu
        )
    try:
        out = _run_variants(handle, variants)
        with torch.no_grad():
            out["after"] = tuple(module(q, k, x, qr).shape)
    finally:
        disable_cp(handle)
    return out


# ------------------------------------------------------------------ cross-rank agreement


def disagreeing_ranks() -> dict[str, Any]:
    """Every rank's input is valid on its own; the last rank's differs from the others'."""
    rank, world = dist.get_rank(), dist.get_world_size()
    odd = rank == world - 1
    base = Case(world, 4, chunk=4)
    total = base.total

    def run(
        case: Case = base,
        config: DeepSeekV4CPConfig | None = None,
        call: Callable[[Any, Any], Any] | None = None,
    ) -> dict[str, Any]:
        layer = build_layer(case)
        x, _, _ = make_inputs(case)
        handle = enable_cp(layer, None, config)
        try:
            xl = handle.shard(x, 1)
            fn = call or (lambda lay, h: lay(xl))
            return _run_variants(handle, {"run": lambda: fn(layer, handle)})["run"]
        finally:
            disable_cp(handle)

    def rows(layer: Any, handle: Any) -> Any:
        x = torch.randn(2, total // world + (1 if odd else 0), 32)
        return layer(x)

    def batch(layer: Any, handle: Any) -> Any:
        return layer(torch.randn(3 if odd else 2, total // world, 32))

    def cu(layer: Any, handle: Any) -> Any:
        cu = [0, 6 if odd else 5, total]
        return layer(torch.randn(total // world, 32), cu_seqlens=torch.tensor(cu))

    def packed_vs_padded(layer: Any, handle: Any) -> Any:
        cu = torch.tensor([0, 5, total]) if odd else None
        return layer(torch.randn(1, total // world, 32), cu_seqlens=cu)

    def dtype(layer: Any, handle: Any) -> Any:
        return layer(torch.randn(2, total // world, 32, dtype=next(layer.parameters()).dtype))

    return {
        "rows": run(call=rows),
        "batch": run(call=batch),
        "cu_seqlens": run(call=cu),
        "packed_vs_padded": run(call=packed_vs_padded),
        "dtype": run(Case(world, 4, chunk=4, dtype="float64" if odd else "float32"), call=dtype),
        "layout": run(config=DeepSeekV4CPConfig(layout="load_balanced" if odd else "contiguous")),
        "kernel": run(
            config=DeepSeekV4CPConfig(attention_kernel="efficient" if odd else "smallop")
        ),
        "ratio": run(Case(world, 128 if odd else 4, chunk=4)),
        "window": run(Case(world, 4, chunk=4, window=8 if odd else 16)),
    }


# ------------------------------------------------------------------ enable_cp checks


class _FloatRatio:
    """A plugin whose layer spec has a float compress ratio (the torch backend stays owner)."""

    @hookimpl(tryfirst=True)
    def hp_cp_layer_spec(self, module: Any) -> Any:
        return LayerSpec(compress_ratio=4.0, window_size=16, has_indexer=True)


class _ShamMesh:
    """Looks like a 1-D DeviceMesh over ``ranks`` whose group is ``group``."""

    ndim = 1

    def __init__(self, ranks: list[int], group: Any) -> None:
        self.mesh = torch.tensor(ranks)
        self._group = group

    def get_group(self) -> Any:
        return self._group

    def __repr__(self) -> str:
        return f"ShamMesh({self.mesh.tolist()})"


def enable_checks() -> dict[str, Any]:
    """What ``enable_cp`` refuses: a second enable, a group or mesh this rank is not in, a
    mesh whose size differs from its group's, a layer spec of the wrong types."""
    from hp_cp_core.plugins import PluginHost

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    layer = build_layer(Case(world, 4))
    first = enable_cp(layer, None)
    out["already_enabled"] = _outcome(lambda: enable_cp(layer, None))
    disable_cp(first)
    first_group = dist.new_group([0])  # every rank calls new_group; ranks > 0 are outside it

    def enable_and_disable(mesh: Any, plugins: Any = None) -> None:
        disable_cp(enable_cp(build_layer(Case(world, 4)), mesh, plugins=plugins))

    out["not_a_member"] = _outcome(lambda: enable_and_disable(first_group))
    singles = [dist.new_group([k]) for k in range(world)]
    out["mesh_size"] = _outcome(
        lambda: enable_and_disable(_ShamMesh(list(range(world)), singles[rank]))
    )
    out["not_in_mesh"] = _outcome(lambda: enable_and_disable(_ShamMesh([(rank + 1) % world], None)))
    host = PluginHost()
    host.add(_FloatRatio(), "float_ratio")
    out["float_ratio"] = _outcome(lambda: enable_and_disable(None, host))
    return out


# ------------------------------------------------------------------ no hangs


class _Fault:
    """Raises ``RuntimeError`` in one stage hook on one rank; elsewhere defers to torch."""

    def __init__(self, stage: str, rank: int) -> None:
        self.stage, self.rank = stage, rank

    def _maybe_fail(self, stage: str) -> None:
        if stage == self.stage and dist.get_rank() == self.rank:
            raise RuntimeError(f"injected fault in {stage} on rank {self.rank}")

    @hookimpl(tryfirst=True)
    def hp_cp_extract_ori_kv(self, module: Any, key: Any) -> Any:
        self._maybe_fail("extract_ori_kv")

    @hookimpl(tryfirst=True)
    def hp_cp_compress_main(self, module: Any, x: Any, halo_x: Any, call: Any) -> Any:
        self._maybe_fail("compress_main")

    @hookimpl(tryfirst=True)
    def hp_cp_run_attention(self, module: Any, query, ori_ext, x, qr, call) -> Any:
        self._maybe_fail("run_attention")


def fault_case(stage: str) -> dict[str, Any]:
    """The last rank fails at ``stage`` (``skip``: it never calls the layer); the others run
    forward and backward and must fail within the group timeout, not hang."""
    from hp_cp_core.plugins import PluginHost

    rank, world = dist.get_rank(), dist.get_world_size()
    bad = world - 1
    pg = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=FAULT_TIMEOUT_S))
    host = PluginHost()
    host.add(_Fault(stage, bad), "fault")
    case = Case(world, 4, "load_balanced", chunk=4)  # every rank receives a halo
    layer = build_layer(case).eval()  # eval: no indexer-loss collective in the forward
    x, _, _ = make_inputs(case)
    handle = enable_cp(layer, pg, DeepSeekV4CPConfig(layout="load_balanced"), plugins=host)
    error: Outcome = None
    t0 = time.monotonic()
    try:
        xl = handle.shard(x, 1).requires_grad_(True)
        if stage == "skip" and rank == bad:
            raise RuntimeError(f"injected fault: rank {bad} skipped the layer")
        layer(xl).sum().backward()
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
        cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else None
        error = (type(exc).__name__, str(exc), cause)
    elapsed = time.monotonic() - t0
    disable_cp(handle)
    dist.barrier()  # the default group (long timeout) lines the ranks up for the next case
    return {"error": error, "elapsed": elapsed}


# ------------------------------------------------------------------ zero gradients


def zero_grad_case(case: Case, how: str) -> dict[str, Any]:
    """Forward, then ``loss.backward()`` with a loss that gives this rank's output a zero
    gradient (``zero``: every rank; ``rank0_only``: every rank but 0 leaves its rows out).

    Returns the traffic counters (the backward collectives ran on every rank) and, on rank 0,
    the unsharded input gradient and summed parameter gradients.
    """
    rank = dist.get_rank()
    layer = build_layer(case).eval()  # eval: no indexer loss, so zero really means zero
    x, cu, g = make_inputs(case)
    handle = enable_cp(layer, None, DeepSeekV4CPConfig(layout=case.layout))
    dim = 0 if case.packed else 1
    try:
        xl = handle.shard(x, dim).requires_grad_(True)
        out = layer(xl, cu_seqlens=cu)
        if how == "zero":
            loss = (out * 0).sum()
        elif how == "rank0_only":
            loss = _loss(out, handle.shard(g, dim)) if rank == 0 else out.narrow(dim, 0, 0).sum()
        else:
            raise ValueError(how)
        layer.zero_grad(set_to_none=True)
        loss.backward()
        stats = handle.stats()
        gx = handle.unshard(xl.grad.detach(), dim)
        names = [n for n, _ in layer.named_parameters()]
        pgrads = {
            n: _sum_over_group(p.grad, p, handle.group.pg)
            for n, p in zip(names, layer.parameters())
        }
    finally:
        disable_cp(handle)
    res: dict[str, Any] = {"stats": stats, "cp_rank": handle.cp_rank}
    if handle.cp_rank == 0:
        res.update(gx=gx, pgrads=pgrads)
    return res


def zero_grad_cases(world: int) -> list[tuple[Case, str]]:
    """(case, how) pairs: empty halos, ranks without slots, and plain cases."""
    if world == 2:
        empty = empty_rank_cases(2)
        return [
            (Case(2, 4, "load_balanced", chunk=5, positions=False), "zero"),
            (Case(2, 4, "load_balanced", chunk=5, positions=False), "rank0_only"),
            (empty[0], "rank0_only"),  # rank 0 sees no slot; rank 1 has no halo
            (empty[1], "zero"),
        ]
    if world == 3:
        return [
            (Case(3, 128, chunk=20), "zero"),  # L = 40 < 128: ranks 0 and 1 own no slot
            (Case(3, 128, chunk=20), "rank0_only"),
            (Case(3, 4, packed=True, chunk=6), "rank0_only"),
        ]
    return []


def zero_grad_name(case: Case, how: str) -> str:
    return f"zero_grad:{how}:{case.name}"


# ------------------------------------------------------------------ the suite

FAULT_STAGES = ("skip", "extract_ori_kv", "compress_main", "run_attention")


def errors_suite(world: int) -> dict[str, tuple[Callable, tuple]]:
    """Every case of one world size; the fault cases come last."""
    cases: dict[str, tuple[Callable, tuple]] = {
        "reference_bad_inputs": (reference_bad_inputs, ()),
        "disagreeing_ranks": (disagreeing_ranks, ()),
    }
    if world == 2:
        cases["csa_bad_inputs"] = (csa_bad_inputs, ())
        cases["enable_checks"] = (enable_checks, ())
    for case, how in zero_grad_cases(world):
        cases[zero_grad_name(case, how)] = (zero_grad_case, (case, how))
    stages = FAULT_STAGES if world == 2 else ("skip", "run_attention")
    for stage in stages:
        cases[f"fault:{stage}"] = (fault_case, (stage,))
    return cases

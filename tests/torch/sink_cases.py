"""Rank function and one-process reference of tests/torch/test_sink.py: the reference layer
(CSA, r = 4, with its indexer loss, no window: the first 3 rows of a document see nothing)
without a sink (``attn_sink = None``), with a sink of
``-inf`` and with a finite sink, on a length neither layout shards as it is, so
``handle.shard(..., pad_value=0)`` adds hp_cp's padding rows (packed: a trailing padding
document), whose rows see nothing. Rank 0 returns the real rows of the output and input
gradient, the parameter gradients summed over the group and the indexer loss; every rank
returns whether its local output and gradients, padding rows included, are finite.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.distributed as dist
from cases import Case, _sum_over_group, build_layer, make_inputs

from hp_cp_core import DeepSeekV4CPConfig, disable_cp, enable_cp

SINKS = ("none", "-inf", "finite")
KERNELS = ("banded", "smallop", "efficient", "triton", "model_ops")
ROWS = 21
"""Not a multiple of 2 (contiguous) nor 4 (load-balanced) at cp 2: both layouts pad."""
CU = (0, 3, 3, 12, 14, ROWS)
"""Packed documents: one shorter than r, one empty, one spanning the ranks."""


@dataclasses.dataclass(frozen=True)
class SinkCase:
    """One case of the matrix: the layer's ``case`` and its ``sink`` (one of :data:`SINKS`)."""

    case: Case
    sink: str

    @property
    def name(self) -> str:
        return f"{self.case.name}-sink_{self.sink}"


def sink_cases() -> list[SinkCase]:
    """{sink none, -inf, finite} x {padded, packed} x {contiguous, load_balanced} x every
    shipped kernel (Triton under its interpreter), cp 2."""
    return [
        SinkCase(
            Case(2, 4, layout, packed, 0, 0, rows=ROWS, cu=CU if packed else None, kernel=k), s
        )
        for k in KERNELS
        for layout in ("contiguous", "load_balanced")
        for packed in (False, True)
        for s in SINKS
    ]


def build(sc: SinkCase) -> torch.nn.Module:
    """The reference layer of ``sc.case`` with ``sc.sink``: ``attn_sink`` ``None``, all
    ``-inf`` (a parameter still) or the random one."""
    layer = build_layer(sc.case)
    if sc.sink == "none":
        layer.attn_sink = None
    elif sc.sink == "-inf":
        with torch.no_grad():
            layer.attn_sink.fill_(float("-inf"))
    return layer


def _finite(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in tensors)


def run_sink_case(sc: SinkCase) -> dict[str, Any]:
    """CP forward and backward of ``sc`` on the world group (cp 2)."""
    case = sc.case
    layer = build(sc)
    x, cu, g = make_inputs(case)
    config = DeepSeekV4CPConfig(
        layout=case.layout, attention_kernel=case.kernel, single_rank_bypass=False
    )
    handle = enable_cp(layer, None, config)
    try:
        dim = 0 if case.packed else 1
        pad = handle.padding(case.total)
        xl = handle.shard(x, dim, pad_value=0.0).requires_grad_(True)
        gl = handle.shard(g, dim, pad_value=0.0)
        kwargs: dict[str, Any] = {}
        if case.packed:
            kwargs["cu_seqlens"] = torch.as_tensor(pad.cu_seqlens(cu.numpy()))
        out = layer(xl, **kwargs)
        params = dict(layer.named_parameters())
        loss = (out.float() * gl.float()).sum()  # padding rows: cotangent 0
        grads = torch.autograd.grad(loss, [xl, *params.values()], allow_unused=True)
        res: dict[str, Any] = {
            "padded": pad.pad_rows > 0,
            "finite": _finite(out, *grads),
            "out": handle.unshard(out.detach(), dim, rows=case.total),
            "gx": handle.unshard(grads[0].detach(), dim, rows=case.total),
            "pgrads": {
                n: _sum_over_group(gr, p, None) for (n, p), gr in zip(params.items(), grads[1:])
            },
            "indexer_loss": layer.indexer_loss,
        }
    finally:
        disable_cp(handle)
    return res if dist.get_rank() == 0 else {"finite": res["finite"], "padded": res["padded"]}


def one_process(sc: SinkCase) -> dict[str, Any]:
    """The same layer, inputs and loss on one process (no padding rows); one run for every
    kernel (the layer's own forward runs the small-op kernel)."""
    return _one_process(dataclasses.replace(sc, case=dataclasses.replace(sc.case, kernel="")))


@functools.cache
def _one_process(sc: SinkCase) -> dict[str, Any]:
    case = sc.case
    layer = build(sc)
    x, cu, g = make_inputs(case)
    x.requires_grad_(True)
    out = layer(x, cu_seqlens=cu)
    params = dict(layer.named_parameters())
    loss = (out.float() * g.float()).sum()
    grads = torch.autograd.grad(loss, [x, *params.values()], allow_unused=True)
    return {
        "out": out.detach(),
        "gx": grads[0],
        "pgrads": dict(zip(params, grads[1:])),
        "indexer_loss": layer.indexer_loss,
    }


def sink_suite(world: int) -> dict[str, tuple[Any, tuple]]:
    """The matrix, on 2 ranks."""
    if world != 2:
        return {}
    return {sc.name: (run_sink_case, (sc,)) for sc in sink_cases()}

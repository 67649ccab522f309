"""The DSA example (``tests/dsa_example``, installed only through its entry point) under CP:
cases run inside the gloo ranks of the torch suites' shared jobs (``cases.JOINT_SUITES``:
suite ``"dsa_example_cases:dsa_example_suite"``, worlds 1 to 4).

Each case builds :class:`hp_cp_dsa_example.model.SparseLlama` (grouped-query DSA layers: one
with its own indexer, one reusing its picks, one with its own indexer; no sink; the indexer's
KL loss attached) from a seed, cuts its batch with ``handle.batch`` (``SEQ`` rows, padded to
the layout), runs it under ``hp_cp_core.enable_cp``, forward and backward, and returns on
rank 0 the unsharded logits, each layer's ``indexer_loss`` and every parameter's gradient
summed over the group, by name. A ``recompute`` case checkpoints every decoder layer
(``torch.utils.checkpoint``, non-reentrant) and runs another batch's forward between the
forward and its backward. The test compares them with the same model on one process, in the
pytest process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hp_cp_core import CPConfig, disable_cp, enable_cp

SEQ = 37
"""A prime: a multiple of no cp and no 2 * cp, so every case pads (``handle.batch``)."""
DOCS = [0, 11, 12, 30, 37]
"""Packed documents (batch 1): one of a single token, none a multiple of anything."""
VOCAB = 64


@dataclass(frozen=True)
class DSAExampleCase:
    cp: int
    layout: str
    packed: bool
    recompute: bool = False
    """Every decoder layer checkpointed, and another batch's forward before the backward."""

    @property
    def name(self) -> str:
        kind = "packed" if self.packed else "padded"
        return f"dsa-example-cp{self.cp}-{self.layout}-{kind}" + (
            "-recompute" if self.recompute else ""
        )


def dsa_example_cases(world: int) -> list[DSAExampleCase]:
    """cp = ``world``: both layouts, padded and packed; at cp 2 and 4 one more of each kind
    with recomputation and a forward in between."""
    cases = [
        DSAExampleCase(world, layout, packed)
        for layout in ("contiguous", "load_balanced")
        for packed in (False, True)
    ]
    if world == 2:
        cases.append(DSAExampleCase(2, "contiguous", False, recompute=True))
    if world == 4:
        cases.append(DSAExampleCase(4, "load_balanced", True, recompute=True))
    return cases


def build(seed: int = 0) -> Any:
    from hp_cp_dsa_example.model import SparseLlama

    torch.manual_seed(seed)
    return SparseLlama(vocab=VOCAB)


def inputs(case: DSAExampleCase, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, g)``: token ids ``[B, SEQ]`` and the logits' gradient seed ``[B, SEQ, VOCAB]``
    (batch 1 packed, 2 padded)."""
    gen = torch.Generator().manual_seed(seed)
    batch = 1 if case.packed else 2
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    return ids, torch.randn(batch, SEQ, VOCAB, generator=gen)


def run_cp(case: DSAExampleCase) -> dict:
    model = build()
    ids, g = inputs(case)
    config = CPConfig(layout=case.layout, query_chunk=16, single_rank_bypass=False)
    handle = enable_cp(model, None, config)
    model.gradient_checkpointing = case.recompute
    try:
        cu = DOCS if case.packed else None
        batch = handle.batch(ids, cu_seqlens=cu)
        pad = handle.padding(SEQ).padded_rows - SEQ
        g_local = handle.shard(torch.nn.functional.pad(g, (0, 0, 0, pad)), 1)
        out = model(batch.input_ids, batch.position_ids, batch.cu_seqlens)
        losses = [layer.self_attn.indexer_loss for layer in model.layers]
        if case.recompute:  # another batch's forward before this one's backward
            other = handle.batch(inputs(case, seed=8)[0], cu_seqlens=cu)
            model(other.input_ids, other.position_ids, other.cu_seqlens)
        (out * g_local).sum().backward()
        full = handle.unshard(out.detach(), 1, rows=SEQ)
        pg = getattr(handle.group, "pg", None)
        grads = {}
        for name, p in model.named_parameters():
            grad = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            dist.all_reduce(grad, group=pg)
            grads[name] = grad
    finally:
        disable_cp(handle)
    res: dict[str, Any] = {"cp_rank": handle.group.rank}
    if handle.group.rank == 0:
        res.update(out=full, grads=grads, losses=[None if x is None else float(x) for x in losses])
    return res


def single_process(case: DSAExampleCase) -> dict:
    model = build()
    ids, g = inputs(case)
    cu = torch.tensor(DOCS) if case.packed else None
    out = model(ids, cu_seqlens=cu)
    losses = [layer.self_attn.indexer_loss for layer in model.layers]
    (out * g).sum().backward()
    grads = {
        n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()
    }
    return {
        "out": out.detach(),
        "grads": grads,
        "losses": [None if x is None else float(x) for x in losses],
    }


def run_refusal(world: int) -> dict:
    """The adapter's ``check_inputs``: a rotary table of other rows than the layer's input
    (the full sequence's, say) is refused with an ``HpCpError`` on every rank, before any
    exchange."""
    from hp_cp_core import HpCpError

    model = build()
    handle = enable_cp(model, None, CPConfig(single_rank_bypass=False))
    try:
        batch = handle.batch(inputs(DSAExampleCase(world, "contiguous", False))[0])
        hidden = model.embed(batch.input_ids)
        table = model.rotary(torch.arange(SEQ + 1)[None])  # not this rank's rows
        try:
            model.layers[0](hidden, table)
            error = "no error"
        except HpCpError as exc:
            error = str(exc)
    finally:
        disable_cp(handle)
    return {"cp_rank": handle.group.rank, "error": error}


def dsa_example_suite(world: int) -> dict[str, tuple[Any, tuple]]:
    if world > 4:
        return {}
    suite = {c.name: (run_cp, (c,)) for c in dsa_example_cases(world)}
    if world == 2:
        suite["refusal-cp2"] = (run_refusal, (2,))
    return suite

"""Rank and single-device runs for the indexer KL loss tests (``test_indexer_loss.py``).

Each CP run trains one CSA layer twice from the same weights, with ``indexer_loss_coeff``
0.01 and 0, and returns the loss value every rank read, the parameter gradients summed over
the ranks and, per rank, which indexer parameters got a gradient. Rows of a ``loss_mask``
(the padding tail of a padded batch row, or a trailing padding document when packed) count
nowhere.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import torch.distributed as dist
from cases import Case, layer_config, make_inputs, parity_case

from hp_cp_core import DeepSeekV4CPConfig, disable_cp, enable_cp
from hp_cp_torch.adapter import ReferenceLayerAdapter
from hp_cp_torch.reference import DeepSeekV4Attention

COEFFS = (0.01, 0.0)


@dataclasses.dataclass(frozen=True)
class LossCase:
    """One CSA layer trained under CP; ``masked``: a loss mask drops the padding rows."""

    base: Case
    masked: bool = False

    @property
    def name(self) -> str:
        return self.base.name + ("-masked" if self.masked else "")


def loss_cases(world: int) -> list[LossCase]:
    """cp = world; contiguous and load-balanced; padded and packed; with and without a mask."""
    out = []
    for layout in ("contiguous", "load_balanced"):
        for packed in (False, True):
            base = parity_case(world, 4, layout, packed, chunk=10 if packed else 6)
            out.append(LossCase(base, masked=False))
            out.append(LossCase(base, masked=True))
    return out


def build(case: LossCase, coeff: float) -> DeepSeekV4Attention:
    """The layer of ``case`` (same weights whatever ``coeff``)."""
    torch.manual_seed(1000 + case.base.seed)
    config = dataclasses.replace(layer_config(4, case.base.window), indexer_loss_coeff=coeff)
    return DeepSeekV4Attention(config)


def inputs(case: LossCase) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, Any]:
    """``(x, cu_seqlens, cotangent, loss_mask or None)``, global."""
    x, cu, g = make_inputs(case.base)
    if not case.masked:
        return x, cu, g, None
    total = case.base.total
    if cu is None:  # padded batch of 2: row 1 ends in padding
        mask = torch.ones(2, total, dtype=torch.bool)
        mask[1, total - total // 3 :] = False
    else:  # packed: the last document is padding, and so is one early row
        mask = torch.ones(total, dtype=torch.bool)
        mask[int(cu[-2]) :] = False
        mask[1] = False
    return x, cu, g, mask


def _kwargs(cu: Any, mask: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {"cu_seqlens": cu}
    if mask is not None:
        kw["loss_mask"] = mask
    return kw


def run_loss_case_cp(case: LossCase, api: str = "0.4") -> dict:
    """Per coefficient: loss value, summed parameter gradients, input gradient (rank 0) and
    which indexer parameters this rank saw a gradient for. ``api="0.3"``: the layers run with
    a third party's adapter written against 0.3.0 (``v03_adapters.ThirdPartyAdapter``)."""
    base = case.base
    x, cu, g, mask = inputs(case)
    dim = 0 if base.packed else 1
    res: dict[str, Any] = {}
    for coeff in COEFFS:
        layer = build(case, coeff)
        if api == "0.3":
            from v03_adapters import ThirdPartyAdapter

            layer.__dict__["_hp_cp_adapter"] = ThirdPartyAdapter(layer)  # an explicit adapter
        config = DeepSeekV4CPConfig(layout=base.layout, query_chunk=base.query_chunk)
        handle = enable_cp(layer, None, config)
        try:
            xl = handle.shard(x, dim).requires_grad_(True)
            local_mask = None if mask is None else handle.shard(mask, dim)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = layer(xl, **_kwargs(cu, local_mask))
            loss_value = float(layer.indexer_loss)
            layer.zero_grad(set_to_none=True)
            (out.float() * handle.shard(g, dim).float()).sum().backward()
            named = dict(layer.named_parameters())
            has_grad = {n: p.grad is not None for n, p in named.items() if "indexer" in n}
            zero = {n: bool(p.grad is not None and not p.grad.any()) for n, p in named.items()}
            summed = {}
            for n, p in named.items():
                t = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                dist.all_reduce(t)
                summed[n] = t
            gx = handle.unshard(xl.grad.detach(), dim)
        finally:
            disable_cp(handle)
        res[coeff] = {
            "loss": loss_value,
            "has_grad": has_grad,
            "zero": zero,
            "pgrads": summed,
            "gx": gx,
            "student_warnings": _student_warnings(caught),
        }
    return res


class _ScaledScoresAdapter(ReferenceLayerAdapter):
    """The reference layer's adapter whose selection scores are twice the indexer's: the
    default ``indexer_loss_scores`` (DeepSeek's formula) no longer matches them."""

    def index_scores(self, state: Any, lo: int, hi: int, keys: torch.Tensor) -> Any:
        return 2.0 * super().index_scores(state, lo, hi, keys)


def run_scaled_student(case: LossCase) -> list[str]:
    """The warnings of two forwards of a layer whose ``index_scores`` disagree with the
    default ``indexer_loss_scores`` (the check warns once per layer)."""
    x, cu, _, _ = inputs(case)
    layer = build(case, COEFFS[0])
    layer.__dict__["_hp_cp_adapter"] = _ScaledScoresAdapter(layer)  # as an explicit adapter
    handle = enable_cp(layer, None, DeepSeekV4CPConfig(layout=case.base.layout))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                layer(handle.shard(x, 0 if case.base.packed else 1), **_kwargs(cu, None))
    finally:
        disable_cp(handle)
        del layer.__dict__["_hp_cp_adapter"]
    return _student_warnings(caught)


def _student_warnings(caught: list) -> list[str]:
    return [str(w.message) for w in caught if "indexer_loss_scores" in str(w.message)]


def single_device_loss(case: LossCase, coeff: float) -> dict:
    """The same training step on one device."""
    x, cu, g, mask = inputs(case)
    layer = build(case, coeff)
    x = x.clone().requires_grad_(True)
    out = layer(x, **_kwargs(cu, mask))
    (out.float() * g.float()).sum().backward()
    return {
        "loss": float(layer.indexer_loss),
        "pgrads": {n: p.grad for n, p in layer.named_parameters()},
        "gx": x.grad,
    }


# ------------------------------------------------------- one handle, steps of other lengths


def training_steps(world: int) -> list[tuple[int, int]]:
    """``(rows, masked)`` per step of one handle: rows padded to the same length as the
    step before but with another real length (259 after 260, as a varying-length training
    meets), then a loss mask whose zeros (the first ``masked`` rows, on the first rank
    only) change from step to step with the same shapes."""
    padded = 2 * world * -(-50 // (2 * world))  # >= 50 rows, fits both layouts
    return [(padded - 1, 0), (padded, 0), (padded - 1, 0), (padded, 3), (padded, 7)]


def build_stack() -> torch.nn.ModuleList:
    """A window-only layer, then a CSA layer with the indexer loss (the first layer of a
    forward has no loss of its own: the later one reuses its agreement)."""
    torch.manual_seed(77)
    return torch.nn.ModuleList(
        DeepSeekV4Attention(dataclasses.replace(layer_config(r), indexer_loss_coeff=0.01))
        for r in (0, 4)
    )


def step_inputs(step: int, rows: int, masked: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``(x, cotangent, loss_mask or None)`` of one step, global ``[2, rows, hidden]``."""
    gen = torch.Generator().manual_seed(300 + step)
    hidden = layer_config(4).hidden_size
    x = torch.randn(2, rows, hidden, generator=gen)
    g = torch.randn(2, rows, hidden, generator=gen)
    if not masked:
        return x, g, None
    mask = torch.ones(2, rows)
    mask[:, :masked] = 0
    return x, g, mask


def run_stack(stack: Any, x: torch.Tensor, mask: Any) -> torch.Tensor:
    for layer in stack:
        x = x + layer(x, **({} if mask is None else {"loss_mask": mask}))
    return x


def run_training_steps(layout: str) -> list[dict]:
    """Every step of :func:`training_steps` on one handle (padded by ``shard(...,
    pad_value=0)``): per step the indexer loss every rank read and, on rank 0, the output,
    the input's gradient and the parameter gradients summed over the ranks."""
    stack = build_stack()
    handle = enable_cp(stack, None, DeepSeekV4CPConfig(layout=layout))
    steps = []
    try:
        for step, (rows, masked) in enumerate(training_steps(dist.get_world_size())):
            x, g, mask = step_inputs(step, rows, masked)
            xl = handle.shard(x, 1, pad_value=0).requires_grad_(True)
            local_mask = None if mask is None else handle.shard(mask, 1, pad_value=0)
            out = run_stack(stack, xl, local_mask)
            loss = float(stack[1].indexer_loss)
            stack.zero_grad(set_to_none=True)
            (out * handle.shard(g, 1, pad_value=0)).sum().backward()
            grads = {}
            for name, p in stack.named_parameters():
                t = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                dist.all_reduce(t)
                grads[name] = t
            full = handle.unshard(out.detach(), 1, rows=rows)
            gx = handle.unshard(xl.grad.detach(), 1, rows=rows)
            steps.append({"loss": loss, "out": full, "gx": gx, "grads": grads})
            if step == 1:  # an evaluation between steps: no loss, then training again
                stack.eval()
                with torch.no_grad():
                    run_stack(stack, xl.detach(), None)
                stack.train()
    finally:
        disable_cp(handle)
    return steps


def training_steps_one_process(world: int) -> list[dict]:
    """The same steps on one process (no padding: the real rows only)."""
    steps = []
    for step, (rows, masked) in enumerate(training_steps(world)):
        stack = build_stack()
        x, g, mask = step_inputs(step, rows, masked)
        x.requires_grad_(True)
        out = run_stack(stack, x, mask)
        (out * g).sum().backward()
        grads = {
            n: torch.zeros_like(p) if p.grad is None else p.grad
            for n, p in stack.named_parameters()
        }
        steps.append(
            {
                "loss": float(stack[1].indexer_loss),
                "out": out.detach(),
                "gx": x.grad,
                "grads": grads,
            }
        )
    return steps


def loss_suite(world: int) -> dict[str, tuple[Any, tuple]]:
    cases = loss_cases(world)
    suite = {c.name: (run_loss_case_cp, (c,)) for c in cases}
    for layout in ("contiguous", "load_balanced"):
        suite[f"steps-{layout}"] = (run_training_steps, (layout,))
    suite["v03-adapter"] = (run_loss_case_cp, (cases[0], "0.3"))
    return {**suite, "scaled-student": (run_scaled_student, (cases[0],))}

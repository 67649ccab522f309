"""Rank functions of tests/torch/test_sequence_dim.py: a sequence-major model declares its
sequence dimension (``ModelAdapter.sequence_dim = 0``) and needs no transposes; the rows a
layer sees are checked against the sequence ``handle.shard`` cut for its forward."""

from __future__ import annotations

import collections
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from cases import layer_config
from torch.utils._python_dispatch import TorchDispatchMode

import hp_cp_core
import hp_cp_torch
from hp_cp_core import CPConfig, HpCpError, disable_cp, enable_cp
from hp_cp_torch import register_model_adapter, unregister_model_adapter
from hp_cp_torch.adapter import ReferenceLayerAdapter
from hp_cp_torch.model.spec import LayerInputs, Traits
from hp_cp_torch.reference import DeepSeekV4Attention

SEQ, BATCH = 37, 4


class SeqMajorAttention(DeepSeekV4Attention):
    """The reference layer called Megatron's way: ``[S, B, hidden]`` in and out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x.transpose(0, 1)).transpose(0, 1)


class SeqMajorAdapter(ReferenceLayerAdapter):
    """The reference adapter, its rows declared sequence-major: no transpose anywhere."""

    traits = Traits(sequence_dim=0)

    def read_inputs(self, x: Any) -> LayerInputs:  # type: ignore[override]
        return LayerInputs(x)


def _layer() -> SeqMajorAttention:
    torch.manual_seed(5)
    return SeqMajorAttention(layer_config(4))


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    shape = (SEQ, BATCH, layer_config(4).hidden_size)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


PRODUCT = tuple(str(Path(m.__file__).parent) for m in (hp_cp_core, hp_cp_torch))
"""Where hp_cp's modules were imported from (a checkout's ``src`` or site-packages)."""


class LayoutCopies(TorchDispatchMode):
    """Counts the copies that materialise a strided view (a transpose made real), by the
    innermost hp_cp source file on the Python stack when it ran: the model's own math
    (``reference.py``), an attention kernel's own blocks (``kernels/``), the collectives'
    send buffers (``backend.py``), or the machinery."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("clone", "copy_", "_to_copy", "contiguous"):
            src = args[1] if name == "copy_" else args[0]
            if isinstance(src, torch.Tensor) and src.numel() > 1 and not src.is_contiguous():
                frames = [
                    f.filename for f in traceback.extract_stack() if f.filename.startswith(PRODUCT)
                ]
                site = Path(frames[-1]) if frames else Path("outside hp_cp")
                self.sites["kernels/" if site.parent.name == "kernels" else site.name] += 1
        return func(*args, **(kwargs or {}))


def sequence_dim_suite(rank: int, world: int) -> dict[str, Any]:
    """Exact at cp = world (load-balanced, padded), and the batch sharded by mistake raising
    the same error on every rank."""
    torch.set_num_threads(1)
    register_model_adapter(SeqMajorAttention, SeqMajorAdapter)
    try:
        x, g = _inputs()
        layer = _layer()
        xr = x.clone().requires_grad_()
        (layer(xr) * g).sum().backward()
        want_out = layer(x).detach()
        want = {n: p.grad.clone() for n, p in layer.named_parameters()}
        want_dx = xr.grad
        with LayoutCopies() as one_process:
            layer(x)
        layer.zero_grad(set_to_none=True)
        handle = enable_cp(layer, None, CPConfig(layout="load_balanced"))
        try:
            xl = handle.shard(x, 0, pad_value=0.0).requires_grad_()
            with LayoutCopies() as under_cp:
                out = layer(xl)
            (out * handle.shard(g, 0, pad_value=0.0)).sum().backward()
            got_out = handle.unshard(out.detach(), 0, rows=SEQ)
            got_dx = handle.unshard(xl.grad, 0, rows=SEQ)
        finally:
            disable_cp(handle)
        for p in layer.parameters():
            dist.all_reduce(p.grad)
        scale = max(float(w.abs().max()) for w in want.values())
        grad_err = max(
            float((p.grad - want[n]).abs().max()) / max(float(want[n].abs().max()), 1e-2 * scale)
            for n, p in layer.named_parameters()
        )
        handle = enable_cp(layer, None, CPConfig(layout="contiguous"))
        try:
            wrong = handle.shard(x, 1)  # the batch, split by mistake
            layer(wrong)
            message = "no error"
        except HpCpError as exc:
            message = str(exc)
        finally:
            disable_cp(handle)
    finally:
        unregister_model_adapter(SeqMajorAttention)
    return {
        "out_err": float((got_out - want_out).abs().max() / want_out.abs().max()),
        "dx_err": float((got_dx - want_dx).abs().max() / want_dx.abs().max()),
        "grad_err": grad_err,
        "wrong_dim": message,
        "copies_one_process": dict(one_process.sites),
        "copies_under_cp": dict(under_cp.sites),
    }

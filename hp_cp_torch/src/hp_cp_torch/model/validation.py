"""Tensor checks of one CP forward on torch (dims, batch, heads, dtype, device, DTensor).

The install wrappers run these before anything that could fail on one rank only, hand what
they find to ``cp_forward.inspect(..., problems=...)`` and then ``cp_forward.agree(...)``,
so a bad tensor on one rank makes *every* rank raise the same ``HpCpError`` before any
exchange. See Note [Validate, agree, then communicate] in :mod:`hp_cp_core.validation`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hp_cp_core import HpCpError

__all__ = ["TensorChecks", "is_dtensor", "rows_hint"]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing it eagerly)."""
    return any(c.__name__ == "DTensor" and "distributed" in c.__module__ for c in type(t).__mro__)


class TensorChecks:
    """Collects what is wrong with one forward's input tensors.

    Every message names the argument, its value and the fix. ``problems`` is handed to
    ``cp_forward.inspect``; ``signature`` (shapes without the row dim, dtypes) is agreed on
    across ranks.

    Args:
        device: the device the CP group communicates on (``TorchGroup.device``).
        where: how the messages name the call, e.g. ``"DeepSeekV4Attention under CP"``.
    """

    def __init__(self, device: torch.device | None, where: str) -> None:
        self.device, self.where = device, where
        self.problems: list[str] = []
        self._sig: list[str] = []

    def fail(self, message: str) -> None:
        self.problems.append(f"{self.where}: {message}")

    @property
    def signature(self) -> str:
        return "; ".join(self._sig)

    def tensor(self, name: str, t: Any, dims: Sequence[int], layout: str) -> bool:
        """``t`` is a plain floating-point tensor with one of ``dims`` dims on the group's
        device type. ``layout`` spells the expected shape for the message."""
        if is_dtensor(t):
            self.fail(
                f"{name} is a DTensor (placements {tuple(t.placements)}); hp_cp takes each "
                "rank's local rows as a plain torch.Tensor. Pass handle.shard(x.full_tensor(), "
                "seq_dim), or x.to_local() if it already holds this rank's rows in the CP layout."
            )
            return False
        if not isinstance(t, torch.Tensor):
            self.fail(f"{name} is a {type(t).__name__}; expected a torch.Tensor {layout}.")
            return False
        if t.dim() not in dims:
            want = " or ".join(str(d) for d in dims)
            self.fail(
                f"{name} has {t.dim()} dims (shape {list(t.shape)}); expected {want}: {layout}. "
                f"Pass {name} with that shape."
            )
            return False
        if not t.is_floating_point():
            self.fail(
                f"{name} has dtype {t.dtype}; expected a floating-point tensor. Cast it with "
                f"{name}.to(<the model's dtype>)."
            )
            return False
        if self.device is not None and t.device != self.device:
            self.fail(
                f"{name} is on {t.device} but the CP group communicates on {self.device}; move "
                f"the inputs with {name}.to('{self.device}') (with NCCL: "
                "torch.cuda.set_device(local_rank) before init_process_group)."
            )
            return False
        return True

    def host_cu_seqlens(self, cu_seqlens: Any) -> Any:
        """``cu_seqlens`` as a host array for the core's checks (which read and agree on it);
        a tensor it cannot read is recorded here (and ``None`` returned)."""
        if cu_seqlens is None or not isinstance(cu_seqlens, torch.Tensor):
            return cu_seqlens
        if is_dtensor(cu_seqlens):
            self.fail(
                "cu_seqlens is a DTensor; pass the global document boundaries as a plain "
                "tensor or list, the same on every rank."
            )
            return None
        return cu_seqlens.detach().cpu().numpy()

    def kernel(self, name: str, device: torch.device) -> None:
        """The attention kernel ``name`` (``CPConfig.attention_kernel``) is
        registered and can run on ``device`` (its ``problem(device)``: the Triton kernel
        needs Triton and a GPU, or its CPU interpreter)."""
        from hp_cp_torch.kernels.registry import kernel_named

        try:
            problem = getattr(kernel_named(name), "problem", None)
        except HpCpError as exc:
            self.fail(str(exc))
            return
        why = None if problem is None else problem(device)
        if why is not None:
            self.fail(why)

    def same(self, what: str, dim_of: dict[str, tuple[torch.Tensor, int]], fix: str = "") -> bool:
        """The named tensors have equal sizes at their given dims (``what`` names the size)."""
        sizes = {name: int(t.shape[d]) for name, (t, d) in dim_of.items()}
        if len(set(sizes.values())) <= 1:
            return True
        listing = ", ".join(
            f"{name} {size} (dim {dim_of[name][1]} of {list(dim_of[name][0].shape)})"
            for name, size in sizes.items()
        )
        self.fail(
            f"{what} differs between the inputs: {listing}. "
            f"{fix or 'Pass tensors of the same ' + what + '.'}"
        )
        return False

    def dtypes(self, named: dict[str, torch.Tensor], want: torch.dtype | None = None) -> bool:
        """Every tensor has dtype ``want`` (or, without ``want``, the first one's)."""
        want = want if want is not None else next(iter(named.values())).dtype
        bad = {n: t.dtype for n, t in named.items() if t.dtype != want}
        if not bad:
            return True
        listing = ", ".join(f"{n} {d}" for n, d in bad.items())
        self.fail(
            f"dtype mismatch: {listing}, expected {want} (the layer's dtype). Cast the inputs "
            f"(or the layer) to one dtype, e.g. x.to({want})."
        )
        return False

    def sign(self, named: dict[str, torch.Tensor | None]) -> None:
        """Add the row-less shapes and dtypes of sequence-major tensors to the signature."""
        for name, t in named.items():
            if isinstance(t, torch.Tensor) and t.dim() >= 1:
                self._sig.append(f"{name} [*, {', '.join(map(str, t.shape[1:]))}] {t.dtype}")
            else:
                self._sig.append(f"{name} {type(t).__name__}")

    def layer_input(
        self, module: torch.nn.Module, inputs: Any, hidden_size: int | None = None
    ) -> None:
        """A layer's ``LayerInputs`` (``ModelAdapter.check_inputs``' default): ``x [B, L,
        hidden]`` (packed: ``[L, hidden]`` too) of the parameters' dtype and device,
        ``hidden_size`` wide (``module.config``'s), one ``position_ids`` / ``loss_mask`` a row."""
        x, packed = inputs.hidden, inputs.cu_seqlens is not None
        layout = (
            "[L, hidden] or [B, L, hidden] with cu_seqlens (packed local rows)"
            if packed
            else "[B, L, hidden] (padded local rows; pass cu_seqlens for packed [L, hidden])"
        )
        if not self.tensor("x", x, (2, 3) if packed else (3,), layout):
            return
        hidden = int(module.config.hidden_size if hidden_size is None else hidden_size)
        if x.shape[-1] != hidden:
            self.fail(
                f"x has hidden size {x.shape[-1]} (last dim of {list(x.shape)}) but the layer's "
                f"hidden_size is {hidden}. Pass the layer's input activations [..., {hidden}]."
            )
        ref = _param_dtype_device(module)
        if ref is not None:
            if not torch.is_autocast_enabled(x.device.type):
                self.dtypes({"x": x}, ref[0])
            if x.device != ref[1]:
                self.fail(
                    f"x is on {x.device} but the layer's parameters are on {ref[1]}; move x (or "
                    f"the layer) with .to('{ref[1]}')."
                )
        batch, rows = (1, x.shape[0]) if x.dim() == 2 else (x.shape[0], x.shape[1])
        shapes = (
            f"[{rows}] or [{batch}, {rows}]"
            if batch == 1
            else f"[{rows}], [1, {rows}] or [{batch}, {rows}]"
        )
        for name in ("position_ids", "loss_mask"):
            t = getattr(inputs, name)
            if t is None:
                continue
            if is_dtensor(t) or not isinstance(t, torch.Tensor):
                self.fail(
                    f"{name} is a {type(t).__name__}; expected a plain torch.Tensor of one value "
                    f"per local row ({shapes}). Shard it like x with "
                    f"handle.shard({name}, seq_dim)."
                )
            elif t.numel() not in (rows, batch * rows) or (t.dim() and t.shape[-1] != rows):
                self.fail(
                    f"{name} has shape {list(t.shape)} but x has {rows} local rows (batch "
                    f"{batch}); expected {shapes}. Shard it like x with "
                    f"handle.shard({name}, seq_dim)."
                )
            elif t.device != x.device:
                self.fail(f"{name} is on {t.device} but x is on {x.device}; move it to {x.device}.")
        self.sign({"x": x.transpose(0, 1) if x.dim() == 3 else x})

    def hidden_states(self, hidden: Any, width: int, packed: bool) -> None:
        """``hidden_states [B, L, width]`` of a transformers-style layer (packed: batch 1)."""
        if not self.tensor("hidden_states", hidden, (3,), "[B, L, hidden] (local rows)"):
            return
        if hidden.shape[-1] != width:
            self.fail(
                f"hidden_states has hidden size {hidden.shape[-1]} (shape {list(hidden.shape)}); "
                f"the model's hidden_size is {width}. Call the model, not the layer, or pass the "
                "decoder layer's normalised input."
            )
        if packed and hidden.shape[0] != 1:
            self.fail(
                f"packed input (cu_seqlens) needs batch size 1, got {hidden.shape[0]}; pack the "
                "documents of a batch into one row."
            )
        self.sign({"hidden_states": hidden.transpose(0, 1)})

    def csa_inputs(self, query: Any, key: Any, x: Any, qr: Any) -> None:
        """A patched module's sequence-major ``query [L, B, N, D]``, ``key [L, B(, 1), D]``,
        ``x [L, B, hidden]`` and ``qr [L, B, q_lora]`` or ``None``."""
        named = {"query": query, "key": key, "x": x}
        ok = self.tensor("query", query, (4,), "[L, B, heads, head_dim] (sequence-major)")
        ok &= self.tensor("key", key, (3, 4), "[L, B, head_dim] or [L, B, 1, head_dim]")
        ok &= self.tensor("x", x, (3,), "[L, B, hidden] (sequence-major)")
        if qr is not None:
            ok &= self.tensor("qr", qr, (3,), "[L, B, q_lora_rank] (sequence-major) or None")
            named["qr"] = qr
        if not ok:
            return
        self.same(
            "local rows",
            {n: (t, 0) for n, t in named.items()},
            "Pass every input's local rows from handle.shard(tensor, 0).",
        )
        self.same(
            "batch",
            {n: (t, 1) for n, t in named.items()},
            "Pass query, key, x and qr of one batch (dim 1).",
        )
        if key.dim() == 4 and key.shape[2] != 1:
            self.fail(
                f"key has {key.shape[2]} heads (dim 2 of {list(key.shape)}); DeepSeek V4 "
                "attention has one shared KV head. Pass key as [L, B, 1, head_dim] or "
                "[L, B, head_dim]."
            )
        self.same(
            "head_dim",
            {"query": (query, 3), "key": (key, key.dim() - 1)},
            "Pass key rows of the query's head_dim (K == V, one head).",
        )
        self.dtypes(named)
        self.sign(named)


def rows_hint(t: Any, dim: int) -> int:
    """``t.shape[dim]`` when ``t`` has that dim, else 0 (a failed check already explains why)."""
    shape = getattr(t, "shape", None)
    try:
        return int(shape[dim]) if shape is not None else 0
    except (IndexError, TypeError):
        return 0


def _param_dtype_device(module: torch.nn.Module) -> tuple[torch.dtype, torch.device] | None:
    p = next(module.parameters(), None)
    return None if p is None else (p.dtype, p.device)

"""Sparse attention with a sink as fused Triton kernels (``attention_kernel="triton"``).

:func:`sparse_attention_triton` computes what
:func:`hp_cp_torch.kernels.smallop.sparse_attention_smallop` computes (same arguments, fp32
softmax, ``-1`` columns, duplicates, all ``-1`` rows) without materialising the gathered
rows: one program reads a query row's KV columns block by block and serves all heads of
the row with them (MQA, one shared KV head). The programs are in
:mod:`hp_cp_torch.kernels.triton_kernels`; see Note [Triton sparse attention] for the data flow.

It needs ``pip install 'hp-cp-torch[triton]'`` and CUDA tensors, or CPU tensors with
``TRITON_INTERPRET=1`` set before Triton is first imported (Triton's interpreter:
exact, slow, what the CPU tests use).

Note [Triton sparse attention]
------------------------------
Forward saves only ``q``, the pool, the index list (int32) and the fp32 log-sum-exp; the
backward recomputes the scores twice, once for ``delta`` and once for the gradients::

    forward   (row, head block) ──► for each block of K columns: gather kv [BK, D],
                                    s = q kv^T, online softmax with the sink ──► o, lse
    backward  dq kernel         ──► pass 1: delta = sum p (dO kv^T)   (= dO . o)
                                    (tiles of tuning "delta")
                                    (pass 2 only with FUSED off:
                                     dq = scale * sum p (dp - delta) kv)
              dkv kernel        ──► per column block: p^T dO + scale ds^T q
                                    atomic add into d_pool[b, idx]  (fp32),
                                    and dq (FUSED, the default); tuning
                                    ALL_HEADS: one program per row sums
                                    all head blocks before its atomic add
              dsink             ──► -sum_{b,s} exp(sink - lse) delta        (torch)

The fp32 pool gradient is summed with atomics, so on a GPU its rounding depends on the
order the programs run in (not bitwise reproducible); the interpreter runs them in order.
"""

from __future__ import annotations

import contextlib
import os
from importlib.util import find_spec
from typing import Any

import torch

from hp_cp_core import HpCpError

__all__ = ["TRITON_EXTRA", "TUNABLE", "sparse_attention_triton", "triton_problem"]

TRITON_EXTRA = "pip install 'hp-cp-torch[triton]'"
"""How to install the kernel's dependency."""


def triton_problem(device: torch.device | str) -> str | None:
    """Why ``attention_kernel="triton"`` cannot run on ``device``, or ``None`` when it can.

    It runs on CUDA devices, and on CPU only under Triton's interpreter
    (``TRITON_INTERPRET=1``, set before Triton is first imported).
    """
    device = torch.device(device)
    if find_spec("triton") is None:
        return f'attention_kernel="triton" needs Triton, which is not installed: {TRITON_EXTRA}.'
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return 'attention_kernel="triton" got CUDA tensors but CUDA is not available.'
        return None
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1" or not _kernels_interpreted():
            return (
                'attention_kernel="triton" needs a CUDA GPU; the tensors are on the CPU, where '
                "Triton kernels only run under its interpreter (set TRITON_INTERPRET=1 before "
                "triton is first imported; exact but slow, for tests). Use "
                'attention_kernel="efficient" or "smallop" on the CPU.'
            )
        return None
    return (
        f'attention_kernel="triton" runs on CUDA devices, got tensors on {device}; use '
        'attention_kernel="efficient" or "smallop" there.'
    )


def _kernels_interpreted() -> bool:
    """Whether the kernels (imported now, if not yet) and Triton's own ``triton.language``
    helpers run in Triton's interpreter: both were defined with ``TRITON_INTERPRET=1``."""
    import triton.language as tl

    from hp_cp_torch.kernels import triton_kernels

    ours = type(triton_kernels.sparse_attention_fwd).__name__ == "InterpretedFunction"
    return ours and type(getattr(tl, "zeros", None)).__name__ != "JITFunction"


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


TUNABLE = {
    "fwd": ("BLOCK_H", "BLOCK_K", "num_warps", "num_stages"),
    "bwd": ("BLOCK_H", "BLOCK_K", "num_warps", "num_stages", "FUSED", "ALL_HEADS"),
    "delta": ("BLOCK_H", "BLOCK_K", "num_warps", "num_stages"),
}
"""Launch options ``sparse_attention_triton(tuning=...)`` may override per phase: the
forward, the backward's gradient kernels, and the backward's ``delta`` pass when it runs
alone (``FUSED``; by default up to 64 heads x 64 columns, shrunk to fit)."""

SHARED_MEMORY_BUDGET = 200 << 10
"""Bytes of shared memory a launch may plan for (an H100/H200 SM has 227 KiB)."""


def _shared_bytes(cfg: dict[str, Any], phase: str, elem: int) -> int:
    """Shared memory one program needs, estimated from its tiles: the forward stages its
    ``[BLOCK_K, D]`` KV tile ``num_stages`` times next to the q tile; the delta pass holds
    q and dO; the dKV kernel holds q and dO twice each (once per operand role of the
    products) and the KV tile twice when fused (``kv^T`` and ``kv``). Matches what
    Triton 3.6 asked for on an H200 (294912 bytes at ``BLOCK_H=64, BLOCK_K=32, D=512``,
    bf16, unfused)."""
    rows, cols, dim = cfg["BLOCK_H"], cfg["BLOCK_K"], cfg["BLOCK_D"]
    stages = max(1, cfg["num_stages"])
    row_tiles, col_tiles = {"fwd": (1, 1), "delta": (2, 1), "bwd": (4, 2)}[phase]
    return (row_tiles * rows + col_tiles * stages * cols) * dim * elem


def _launch(
    dtype: torch.dtype, heads: int, dim: int, phase: str, tuning: dict[str, Any] | None
) -> dict[str, Any]:
    """Launch options of one kernel (``phase`` one of :data:`TUNABLE`): the row tiles
    ``[BLOCK_H, D]`` (q, and dO in backward) take at most 64 KiB, a KV tile at most 64 KiB
    in the forward and 32 KiB in the backward, then stages, column and head blocks shrink
    until the estimated shared memory fits :data:`SHARED_MEMORY_BUDGET`. No autotuning (one
    compile per shape class). The backward computes dq inside the dKV kernel (``FUSED``,
    one pass over the columns fewer). ``tuning`` may override :data:`TUNABLE` per phase,
    e.g. ``{"bwd": {"FUSED": False}}``; ``"ALL_HEADS": True`` sums the pool gradient of
    all head blocks of a row before one atomic add (dq then comes from the dq kernel, not
    fused). An override whose estimate does not fit is an error.
    """
    elem = torch.finfo(dtype).bits // 8
    tiles = "fwd" if phase == "fwd" else "bwd"  # the delta pass starts from the bwd tiles
    operands = 1 if tiles == "fwd" else 2
    block_d = max(16, _next_pow2(dim))
    block_h = min(64, max(16, _next_pow2(heads)))
    while block_h > 16 and operands * block_h * block_d * elem > 64 << 10:
        block_h //= 2
    block_k, kv_tile = (64, 64 << 10) if tiles == "fwd" else (32, 32 << 10)
    while block_k > 16 and block_k * block_d * elem > kv_tile:
        block_k //= 2
    cfg = {
        "BLOCK_H": block_h,
        "BLOCK_K": block_k,
        "BLOCK_D": block_d,
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "UPCAST": dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1",
        "num_warps": 8 if block_d >= 256 else 4,
        "num_stages": 2 if tiles == "fwd" else 1,
    }
    if phase == "delta":  # q and dO only, no KV tile kept: the widest tiles that fit
        # (measured on an H200 at D = 512 bf16: 25% faster fwd + bwd than the bwd tiles)
        cfg["BLOCK_H"], cfg["BLOCK_K"], tiles = min(64, max(16, _next_pow2(heads))), 64, "delta"
    for key, floor in (("num_stages", 1), ("BLOCK_K", 16), ("BLOCK_H", 16)):
        while cfg[key] > floor and _shared_bytes(cfg, tiles, elem) > SHARED_MEMORY_BUDGET:
            cfg[key] = cfg[key] - 1 if key == "num_stages" else cfg[key] // 2
    if phase == "bwd":
        cfg["FUSED"] = True
        cfg["ALL_HEADS"] = False
    extra = dict((tuning or {}).get(phase, {}))
    unknown = set(extra) - set(TUNABLE[phase])
    if unknown:
        raise HpCpError(
            f"sparse_attention_triton tuning[{phase!r}] has unknown keys {sorted(unknown)}; "
            f"expected some of {TUNABLE[phase]}."
        )
    tuned = {**cfg, **extra}
    need = _shared_bytes(tuned, phase, elem)
    if extra and need > max(SHARED_MEMORY_BUDGET, _shared_bytes(cfg, phase, elem)):
        raise HpCpError(
            f"sparse_attention_triton tuning[{phase!r}] = {extra} needs about {need >> 10} KiB "
            f"of shared memory at D = {dim} ({dtype}), over the {SHARED_MEMORY_BUDGET >> 10} "
            "KiB budget; use a smaller BLOCK_H, BLOCK_K or num_stages."
        )
    return tuned


def _on(device: torch.device) -> Any:
    """Triton launches on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _grid(batch: int, seq: int, heads: int, cfg: dict[str, Any]) -> tuple[int, int]:
    return (batch * seq, -(-heads // cfg["BLOCK_H"]))


class _TritonSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        kv_pool: torch.Tensor,
        idx: torch.Tensor,
        sink: torch.Tensor,
        scale: float,
        tuning: dict[str, Any] | None,
    ) -> torch.Tensor:
        from hp_cp_torch.kernels.triton_kernels import sparse_attention_fwd

        batch, seq, heads, dim = q.shape
        q = q.contiguous()
        pool = kv_pool if kv_pool.shape[1] else kv_pool.new_zeros(batch, 1, dim)
        pool = pool.contiguous()
        small = pool.shape[1] < 2**31 - 1
        idx = idx.expand(batch, -1, -1).to(torch.int32 if small else torch.int64).contiguous()
        k = idx.shape[-1]
        out = torch.empty_like(q)
        lse = torch.empty(batch, seq, heads, dtype=torch.float32, device=q.device)
        if q.numel():
            cfg = _launch(q.dtype, heads, dim, "fwd", tuning)
            with _on(q.device):
                sparse_attention_fwd[_grid(batch, seq, heads, cfg)](
                    q, pool, idx, sink.detach().float().contiguous(), out, lse,
                    float(scale), seq, pool.shape[1], k, heads, dim, **cfg,
                )  # fmt: skip
        ctx.save_for_backward(q, pool, idx, sink, lse)
        ctx.scale = float(scale)
        ctx.tuning = tuning
        ctx.n_pool = kv_pool.shape[1]
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        from hp_cp_torch.kernels.triton_kernels import (
            sparse_attention_bwd_dkv,
            sparse_attention_bwd_dkv_all_heads,
            sparse_attention_bwd_dq,
        )

        q, pool, idx, sink, lse = ctx.saved_tensors
        batch, seq, heads, dim = q.shape
        k = idx.shape[-1]
        need_q, need_kv, _, need_sink, _, _ = ctx.needs_input_grad
        grad_out = grad_out.to(q.dtype).contiguous()
        d_q = torch.zeros_like(q)
        delta = torch.zeros(batch, seq, heads, dtype=torch.float32, device=q.device)
        d_pool = torch.zeros(pool.shape if need_kv else 0, dtype=torch.float32, device=q.device)
        args = (ctx.scale, seq, pool.shape[1], k, heads, dim)
        if q.numel() and k:
            cfg = _launch(q.dtype, heads, dim, "bwd", ctx.tuning)
            all_heads = bool(cfg.pop("ALL_HEADS"))
            fused = bool(cfg.pop("FUSED")) and need_kv and not all_heads
            grid = _grid(batch, seq, heads, cfg)
            # the delta pass alone (fused) has tiles of its own
            dcfg = _launch(q.dtype, heads, dim, "delta", ctx.tuning) if fused else cfg
            with _on(q.device):
                sparse_attention_bwd_dq[_grid(batch, seq, heads, dcfg)](
                    q, pool, idx, grad_out, lse, d_q, delta, *args, **dcfg, DQ_PASS=not fused
                )
                if need_kv and all_heads:
                    sparse_attention_bwd_dkv_all_heads[(batch * seq,)](
                        q, pool, idx, grad_out, lse, delta, d_pool, *args, **cfg
                    )
                elif need_kv:
                    sparse_attention_bwd_dkv[grid](
                        q, pool, idx, grad_out, lse, delta, d_pool, d_q, *args, **cfg,
                        WITH_DQ=fused,
                    )  # fmt: skip
        d_sink = -(torch.exp(sink.detach().float() - lse) * delta).sum(dim=(0, 1))
        return (
            d_q if need_q else None,
            d_pool[:, : ctx.n_pool].to(pool.dtype) if need_kv else None,
            None,
            d_sink.to(sink.dtype) if need_sink else None,
            None,
            None,
        )


def sparse_attention_triton(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    *,
    tuning: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Attend each query to the KV-pool rows listed in ``idx``, with an attention sink.

    Same arguments, result and gradients as
    :func:`hp_cp_torch.kernels.smallop.sparse_attention_smallop`, as fused Triton kernels (see
    Note [Triton sparse attention]). ``q`` and ``kv_pool`` share one floating dtype (fp32,
    bf16 or fp16; the softmax runs in fp32 either way); any ``K`` (the kernels loop over
    the columns in blocks), any ``D`` and ``H`` (tiled in powers of two).

    Args:
        q: Queries ``[B, S, H, D]``.
        kv_pool: The shared KV rows ``[B, P, D]`` (keys and values are the same vectors).
        idx: Column lists ``[B or 1, S, K]`` (int32 or int64) of rows of ``kv_pool``; ``-1``
            marks an empty column.
        sink: Per-head sink logits ``[H]`` (used in fp32).
        scale: Softmax scale applied to ``q . kv``.
        tuning: launch overrides per phase, ``{"fwd": {...}, "bwd": {...}}``, keys in
            :data:`TUNABLE` (benchmarks; the defaults follow D, H and the dtype).

    Returns:
        The attention output ``[B, S, H, D]`` in ``q``'s dtype.

    Raises:
        HpCpError: Triton is missing, the tensors are on a device it cannot run on (see
            :func:`triton_problem`), or ``q`` and ``kv_pool`` differ in dtype.
    """
    problem = triton_problem(q.device)
    if problem is not None:
        raise HpCpError(problem)
    if q.dtype != kv_pool.dtype or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise HpCpError(
            f'attention_kernel="triton" takes q and kv_pool of one dtype among float32, '
            f"bfloat16 and float16; got q {q.dtype} and kv_pool {kv_pool.dtype}. Cast them "
            "to one (the layer's dtype)."
        )
    return _TritonSparseAttention.apply(q, kv_pool, idx, sink, scale, tuning)

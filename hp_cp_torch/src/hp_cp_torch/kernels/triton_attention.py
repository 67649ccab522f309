"""Sparse attention with an optional sink as fused Triton kernels (``attention_kernel="triton"``).

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

    forward   (row, head block) ──► for each block of K columns: gather kv [BK, D] once,
                                    s = q kv^T ([H, D] x [D, BK]: the row's heads are M),
                                    online softmax with the sink ──► o, lse
    backward  dq kernel         ──► pass 1: delta = sum p (dO kv^T)   (= dO . o)
                                    (tiles of tuning "delta")
                                    (pass 2 only with FUSED off:
                                     dq = scale * sum p (dp - delta) kv)
              dkv kernel        ──► per column block: p^T dO + scale ds^T q, and dq (FUSED)
                                    POOL_GRAD "owned" (default): stored as this head
                                    block's part of that column (no atomics), then
                                    Note [Atomics-free pool gradient];
                                    "atomic" (0.2.0): fp32 atomic add into d_pool[b, idx]
              dsink             ──► -sum_{b,s} exp(sink - lse) delta        (torch)

The default forward (``LAYOUT="heads_m"``) takes up to 128 heads per program (as many as
an fp32 ``[BLOCK_H, D]`` accumulator of :data:`REGISTER_TILE` bytes allows: 64 at D = 512)
and splits D in two halves; ``"head_blocks"`` is the 0.2.0 forward (at most 64 heads).

Note [Atomics-free pool gradient]
---------------------------------
Each pool row's gradient is summed by the one program that owns it, in a fixed order, so
the result is the same bits every run and ``torch.use_deterministic_algorithms(True)``
accepts it. Per chunk of query rows (as many as ``PARTS_MIB`` of fp32 parts hold)::

    dkv kernel (query rows)     parts[head block, row, column, :] = p^T dO + scale ds^T q
    readers of each pool row    window / HCA columns: ranges from the plan (bands,
                                Note [Readers of a band]); the picks: inverted on the device
                                (Note [Inverting the picks]; every column without bands)
    pool_grad_owned (pool row,  d_pool[r] += sum over its readers, in query order, of the
      feature block)            parts of every head block    (one writer per row: no atomics)

    query rows  q0 q1 q2          parts [row, col]         pool row 2 reads (q0,c0) (q1,c0)
    idx         [2,-1] [2,2] [0]  ──► written once each ──►  (q1,c1): one program adds them

The price is memory traffic: the parts are written once and read once (``4 K D`` bytes per
query row and head block), where the atomics added in place.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from importlib.util import find_spec
from typing import Any

import torch

from hp_cp_core import HpCpError
from hp_cp_core.columns import ColumnBands
from hp_cp_torch.kernels.pool_index import build_inverted_index
from hp_cp_torch.kernels.softmax import sink_gradient, sink_logits

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
    "fwd": ("BLOCK_H", "BLOCK_K", "num_warps", "num_stages", "LAYOUT"),
    "bwd": (
        "BLOCK_H",
        "BLOCK_K",
        "num_warps",
        "num_stages",
        "FUSED",
        "ALL_HEADS",
        "POOL_GRAD",
        "PARTS_MIB",
    ),
    "delta": ("BLOCK_H", "BLOCK_K", "num_warps", "num_stages"),
}
"""Launch options ``sparse_attention_triton(tuning=...)`` may override per phase: the
forward, the backward's gradient kernels, and the backward's ``delta`` pass when it runs
alone (``FUSED``; by default up to 64 heads x 64 columns, shrunk to fit). Choices:

* ``fwd`` ``LAYOUT``: ``"heads_m"`` (default: up to 128 heads of a row as the M dimension,
  D in two halves, base-2 softmax; ``sparse_attention_fwd_heads_m``) or ``"head_blocks"``
  (the 0.2.0 forward, at most 64 heads per program);
* ``bwd`` ``POOL_GRAD``: ``"owned"`` (default: atomics-free, bitwise reproducible; Note
  [Atomics-free pool gradient]) or ``"atomic"`` (the 0.2.0 fp32 atomics; refused under
  ``torch.use_deterministic_algorithms(True)``); ``PARTS_MIB``: the owned path's budget for
  its per-column gradient parts (default 4096 MiB; the query rows go in chunks that fit).
"""

POOL_GRAD_CHOICES = ("owned", "atomic")
FWD_LAYOUTS = ("heads_m", "head_blocks")
PARTS_MIB = 4096
"""Default ``PARTS_MIB``: fp32 ``[parts, rows, K, D]`` kept per chunk of query rows."""
REGISTER_TILE = 128 << 10
"""Bytes of fp32 accumulator one ``heads_m`` forward program may hold (half an SM's
registers); its head block shrinks until ``BLOCK_H x BLOCK_D x 4`` fits."""

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
    extra = dict((tuning or {}).get(phase, {}))
    unknown = set(extra) - set(TUNABLE[phase])
    if unknown:
        raise HpCpError(
            f"sparse_attention_triton tuning[{phase!r}] has unknown keys {sorted(unknown)}; "
            f"expected some of {TUNABLE[phase]}."
        )
    layout = extra.get("LAYOUT", FWD_LAYOUTS[0])
    pool_grad = extra.get("POOL_GRAD", POOL_GRAD_CHOICES[0])
    for key, value, choices in (
        ("LAYOUT", layout, FWD_LAYOUTS),
        ("POOL_GRAD", pool_grad, POOL_GRAD_CHOICES),
    ):
        if value not in choices:
            raise HpCpError(
                f"sparse_attention_triton tuning[{phase!r}][{key!r}] = {value!r}; expected one "
                f"of {choices}."
            )
    tiles = "fwd" if phase == "fwd" else "bwd"  # the delta pass starts from the bwd tiles
    operands = 1 if tiles == "fwd" else 2
    heads_m = phase == "fwd" and layout == "heads_m"
    block_d = max(32 if heads_m else 16, _next_pow2(dim))  # heads_m: two halves of >= 16
    block_h = min(128 if heads_m else 64, max(16, _next_pow2(heads)))
    while block_h > 16 and operands * block_h * block_d * elem > (128 if heads_m else 64) << 10:
        block_h //= 2
    while heads_m and block_h > 16 and block_h * block_d * 4 > REGISTER_TILE:
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
        cfg.update(FUSED=True, ALL_HEADS=False, POOL_GRAD=pool_grad, PARTS_MIB=PARTS_MIB)
    if phase == "fwd":
        cfg["LAYOUT"] = layout
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


def _refuse_atomics_if_deterministic() -> None:
    """What torch does for its own nondeterministic ops under
    ``torch.use_deterministic_algorithms(True)``: raise (or warn, with ``warn_only``)."""
    if not torch.are_deterministic_algorithms_enabled():
        return
    message = (
        'sparse_attention_triton with tuning {"bwd": {"POOL_GRAD": "atomic"}} sums the pool '
        "gradient with fp32 atomics, whose rounding depends on the order the GPU runs them "
        "in, but torch.use_deterministic_algorithms(True) is set. Drop the override: the "
        'default POOL_GRAD "owned" is atomics-free and bitwise reproducible.'
    )
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(message, stacklevel=3)
        return
    raise HpCpError(message)


def _band_tensors(bands: ColumnBands | None, seq: int, n_pool: int, device: torch.device):
    """The plan's bands as int32 device tensors (or one-element placeholders)."""
    if bands is None:
        return (torch.zeros(1, dtype=torch.int32, device=device),) * 5, 0, 0
    if bands.start.shape[1] != seq or bands.first.shape[2] != n_pool:
        raise HpCpError(
            f"sparse_attention_triton bands cover {bands.start.shape[1]} queries and "
            f"{bands.first.shape[2]} pool rows, the call has {seq} and {n_pool}; build them "
            "with PlanColumns.column_bands for the same chunk and pool."
        )
    arrays = (bands.col0, bands.start, bands.length, bands.first, bands.stop)
    out = tuple(torch.as_tensor(a, dtype=torch.int32).to(device).contiguous() for a in arrays)
    return out, bands.first.shape[0], bands.first.shape[1]


class _TritonSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        kv_pool: torch.Tensor,
        idx: torch.Tensor,
        sink: torch.Tensor | None,
        scale: float,
        tuning: dict[str, Any] | None,
        bands: ColumnBands | None,
    ) -> torch.Tensor:
        from hp_cp_torch.kernels.triton_kernels import (
            sparse_attention_fwd,
            sparse_attention_fwd_heads_m,
        )

        batch, seq, heads, dim = q.shape
        q = q.contiguous()
        pool = (kv_pool if kv_pool.shape[1] else kv_pool.new_zeros(batch, 1, dim)).contiguous()
        small = pool.shape[1] < 2**31 - 1
        idx = idx.expand(batch, -1, -1).to(torch.int32 if small else torch.int64).contiguous()
        k = idx.shape[-1]
        out = torch.empty_like(q)
        lse = torch.empty(batch, seq, heads, dtype=torch.float32, device=q.device)
        if q.numel():
            cfg = _launch(q.dtype, heads, dim, "fwd", tuning)
            kernel = {"heads_m": sparse_attention_fwd_heads_m, "head_blocks": sparse_attention_fwd}
            with _on(q.device):
                kernel[cfg.pop("LAYOUT")][_grid(batch, seq, heads, cfg)](
                    q, pool, idx, sink_logits(sink, heads, q).detach().contiguous(), out, lse,
                    float(scale), seq, pool.shape[1], k, heads, dim, **cfg,
                )  # fmt: skip
        ctx.save_for_backward(q, pool, idx, sink, lse)
        ctx.scale, ctx.tuning, ctx.bands, ctx.n_pool = float(scale), tuning, bands, kv_pool.shape[1]
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        from hp_cp_torch.kernels.triton_kernels import sparse_attention_bwd_dq

        q, pool, idx, sink, lse = ctx.saved_tensors
        batch, seq, heads, dim = q.shape
        k = idx.shape[-1]
        need_q, need_kv, _, need_sink, _, _, _ = ctx.needs_input_grad
        grad_out = grad_out.to(q.dtype).contiguous()
        d_q = torch.zeros_like(q)
        delta = torch.zeros(batch, seq, heads, dtype=torch.float32, device=q.device)
        d_pool = torch.zeros(pool.shape if need_kv else 0, dtype=torch.float32, device=q.device)
        args = (ctx.scale, seq, pool.shape[1], k, heads, dim)
        if q.numel() and k:
            cfg = _launch(q.dtype, heads, dim, "bwd", ctx.tuning)
            all_heads = bool(cfg.pop("ALL_HEADS"))
            owned = cfg.pop("POOL_GRAD") == "owned"
            parts_mib = float(cfg.pop("PARTS_MIB"))
            fused = bool(cfg.pop("FUSED")) and need_kv and not all_heads
            if need_kv and not owned:
                _refuse_atomics_if_deterministic()
            # the delta pass alone (fused) has tiles of its own
            dcfg = _launch(q.dtype, heads, dim, "delta", ctx.tuning) if fused else cfg
            with _on(q.device):
                sparse_attention_bwd_dq[_grid(batch, seq, heads, dcfg)](
                    q, pool, idx, grad_out, lse, d_q, delta, *args, **dcfg, DQ_PASS=not fused
                )
                if need_kv:
                    grads = (q, pool, idx, grad_out, lse, delta, d_pool, d_q)
                    pool_grad = _pool_grad_owned if owned else _pool_grad_atomic
                    pool_grad(grads, args, cfg, all_heads, fused, parts_mib, ctx.bands)
        d_sink = sink_gradient(sink, lse, delta)
        return (
            d_q if need_q else None,
            d_pool[:, : ctx.n_pool].to(pool.dtype) if need_kv else None,
            None,
            d_sink.to(sink.dtype) if need_sink else None,
            None,
            None,
            None,
        )


def _pool_grad_atomic(grads, args, cfg, all_heads, fused, parts_mib, bands) -> None:
    """The 0.2.0 pool gradient: fp32 atomic adds from the programs of the query rows."""
    from hp_cp_torch.kernels.triton_kernels import (
        sparse_attention_bwd_dkv,
        sparse_attention_bwd_dkv_all_heads,
    )

    q, pool, idx, grad_out, lse, delta, d_pool, d_q = grads
    batch, seq, heads, _ = q.shape
    rows = (0, seq)
    if all_heads:
        sparse_attention_bwd_dkv_all_heads[(batch * seq,)](
            q, pool, idx, grad_out, lse, delta, d_pool, *args, *rows, **cfg, STORE_PARTS=False
        )
    else:
        sparse_attention_bwd_dkv[_grid(batch, seq, heads, cfg)](
            q, pool, idx, grad_out, lse, delta, d_pool, d_q, *args, *rows, **cfg,
            WITH_DQ=fused, STORE_PARTS=False,
        )  # fmt: skip


def _pool_grad_owned(grads, args, cfg, all_heads, fused, parts_mib, bands) -> None:
    """The atomics-free pool gradient (Note [Atomics-free pool gradient]), chunk by chunk of
    query rows: their per-column parts, the inverse of their picks, then one program per
    pool row (and feature block) that adds its readers' parts in query order."""
    from hp_cp_torch.kernels.triton_kernels import (
        pool_grad_owned,
        sparse_attention_bwd_dkv,
        sparse_attention_bwd_dkv_all_heads,
    )

    q, pool, idx, grad_out, lse, delta, d_pool, d_q = grads
    batch, seq, heads, dim = q.shape
    n_pool, k = pool.shape[1], idx.shape[-1]
    n_parts = 1 if all_heads else -(-heads // cfg["BLOCK_H"])
    per_row = n_parts * batch * k * dim * 4  # bytes of parts per query row (all batches)
    chunk = max(1, min(seq, int(parts_mib * (1 << 20) // per_row)))
    band_args, n_bands, n_runs = _band_tensors(bands, seq, n_pool, q.device)
    sorted_from = min(bands.n_columns, k) if bands is not None else 0
    block_d = min(128, max(16, _next_pow2(dim)))
    shift = (torch.arange(batch, device=q.device) * n_pool).view(batch, 1, 1)
    for row0 in range(0, seq, chunk):
        rows = min(chunk, seq - row0)
        parts = torch.empty(n_parts, batch * rows, k, dim, dtype=torch.float32, device=q.device)
        if all_heads:
            sparse_attention_bwd_dkv_all_heads[(batch * rows,)](
                q, pool, idx, grad_out, lse, delta, parts, *args, row0, rows, **cfg,
                STORE_PARTS=True,
            )  # fmt: skip
        else:
            sparse_attention_bwd_dkv[(batch * rows, n_parts)](
                q, pool, idx, grad_out, lse, delta, parts, d_q, *args, row0, rows, **cfg,
                WITH_DQ=fused, STORE_PARTS=True,
            )  # fmt: skip
        picks = idx[:, row0 : row0 + rows, sorted_from:]
        has_csr = picks.shape[-1] > 0
        if has_csr:  # pool row r of batch b is key b * P + r; entries name parts rows
            keys = torch.where(picks >= 0, picks + shift, -1).reshape(batch * rows, -1)
            csr = build_inverted_index(keys, batch * n_pool, trim=False)
            csr_args = (csr.offsets, csr.query_rows, csr.columns)
        else:
            csr_args = (band_args[0],) * 3
        pool_grad_owned[(batch * n_pool, -(-dim // block_d))](
            parts, d_pool, *csr_args, *band_args, sorted_from, n_bands, n_runs, row0, rows,
            seq, n_pool, k, dim, n_parts, batch * rows,
            BLOCK_E=32, BLOCK_D=block_d, HAS_BANDS=n_bands > 0, HAS_CSR=has_csr,
        )  # fmt: skip
        del parts


def sparse_attention_triton(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    idx: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float,
    *,
    tuning: dict[str, Any] | None = None,
    bands: ColumnBands | None = None,
) -> torch.Tensor:
    """Attend each query to the KV-pool rows listed in ``idx``, with an optional sink.

    Same arguments, result and gradients as
    :func:`hp_cp_torch.kernels.smallop.sparse_attention_smallop`, as fused Triton kernels (see
    Note [Triton sparse attention]). ``q`` and ``kv_pool`` share one floating dtype (fp32,
    bf16 or fp16; the softmax runs in fp32 either way); any ``K`` (the kernels loop over
    the columns in blocks), any ``D`` and ``H`` (tiled in powers of two); ``idx`` may have
    batch 1.

    Args:
        tuning: launch overrides per phase, ``{"fwd": {...}, "bwd": {...}}``, keys in
            :data:`TUNABLE` (benchmarks; the defaults follow D, H and the dtype).
        bands: the plan's window (and HCA) columns as
            :class:`hp_cp_core.columns.ColumnBands` (``PlanColumns.column_bands`` for the
            same queries and pool): the atomics-free backward reads their readers from the
            plan and inverts only the later columns; without it every column is inverted.

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
    unknown = set(tuning or {}) - set(TUNABLE)
    if unknown:
        raise HpCpError(
            f"sparse_attention_triton tuning has unknown phases {sorted(unknown)}; expected "
            f"some of {sorted(TUNABLE)}."
        )
    for phase in tuning or {}:  # every override checked now, not at the backward
        _launch(q.dtype, q.shape[2], q.shape[3], phase, tuning)
    return _TritonSparseAttention.apply(q, kv_pool, idx, sink, scale, tuning, bands)

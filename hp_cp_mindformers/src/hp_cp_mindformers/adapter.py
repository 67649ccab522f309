"""The MindFormers adapter: how the hooks reach into a ``CompressedSparseAttention`` cell.

:class:`MindFormersDeepSeekV4CSAAdapter` maps the cell's attributes exactly as the design
note's adapter sketch does (``compressor``, ``indexer`` / ``indexer.compressor``, ``squeeze``,
``window_size``, ``compress_ratio``, ``force_unfused``; the real mindformers 2.1.0 class has
``apply_dsa_kernel_fusion`` instead of ``force_unfused``). Attention runs the primitives that
``_construct_naive`` uses, taken from the cell's own Python module
(``unfused_compressed_sparse_attn``, ``parse_cu_seqlens``, ``indexer.forward_before_topk``,
the unfused indexer scoring, ``unfused_indexer_loss``), on the plan's index arrays:

* the columns come from the core (:class:`hp_cp_core.columns.PlanColumns`): the window rows
  of ``ori_ext``, then the compressed slots of the gathered ``call.cmp_kv_global`` (every
  visible slot for r = 128, the indexer's top-k over the visible candidates for r = 4, scored
  chunk by chunk over the ranges the core plans; host top-k, ties to the lower slot).

The adapter never plans; every index comes from ``call.plan`` through the core. Inputs are
SBND: ``query [L, b, np, d]``, ``key [L, b, 1, d]`` (already RoPE'd by the parent at the rows'
global positions), ``x [L, b, hidden]``, ``qr [L, b, q_lora_rank]``; packed input is
``b = 1`` plus the GLOBAL ``actual_seq_len`` (document ends) on every rank.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
from mindspore import Tensor, mint, nn, ops
from mindspore import dtype as mstype

from hp_cp_core import (
    CPConfig,
    CPContext,
    HpCpError,
    LayerSpec,
    enable_cp,
    stage1_compress_with_halo,
)
from hp_cp_core.columns import PlanColumns, select_topk_numpy
from hp_cp_core.compression import build_x_ext
from hp_cp_core.indexer_loss import global_indexer_loss, indexer_loss_weight

__all__ = [
    "MindFormersDeepSeekV4CSAAdapter",
    "adapter_for",
    "install_construct",
    "patch_deepseek_v4_compressed_sparse_attention_forward",
    "patch_mindformers_deepseek_v4_csa_forward",
]

ADAPTER_ATTR = "_hp_cp_adapter"
_CSA_ATTRS = ("compress_ratio", "window_size", "attn_sink", "_construct_naive", "compressor")


_PRIMITIVES = ("unfused_compressed_sparse_attn", "parse_cu_seqlens")
"""The helpers of mindformers' csa.py that the adapter calls, taken from the cell's module."""


def _primitive(cell: Any, name: str) -> Callable[..., Any]:
    """``name`` from the Python module of the cell's class, or of the first base class whose
    module has it (a subclass defined elsewhere uses the real mindformers helpers)."""
    for cls in type(cell).__mro__:
        fn = getattr(sys.modules.get(cls.__module__), name, None)
        if fn is not None:
            return fn
    raise HpCpError(
        f"`{type(cell).__name__}` is run under CP with the helpers of mindformers' "
        f"CompressedSparseAttention, but no module of its classes defines `{name}`; "
        "use (a subclass of) mindformers 2.1.0's CompressedSparseAttention."
    )


def install_construct(cell: nn.Cell, construct: Callable[..., Any]) -> Callable[[], None]:
    """Set ``cell.construct``; the returned undo restores exactly what was there."""
    had_own = "construct" in cell.__dict__
    previous = cell.__dict__.get("construct")
    object.__setattr__(cell, "construct", construct)

    def undo() -> None:
        if had_own:
            object.__setattr__(cell, "construct", previous)
        else:
            object.__delattr__(cell, "construct")

    return undo


class MindFormersDeepSeekV4CSAAdapter:
    """Hooks for a mindformers ``CompressedSparseAttention`` cell (real 2.1.0 or the reference).

    Args:
        csa_module: the cell; its ``construct(query, key, x, qr, actual_seq_len=None)`` is
            replaced under CP.
    """

    def __init__(self, csa_module: nn.Cell) -> None:
        self.module = csa_module

    # -- layer description (the design note's properties) ----------------------------------
    @property
    def compress_ratio(self) -> int:
        return int(getattr(self.module, "compress_ratio", 0) or 0)

    @property
    def window_size(self) -> int:
        return int(getattr(self.module, "window_size", 128))

    @property
    def force_unfused(self) -> bool:
        value = getattr(self.module, "force_unfused", None)
        if value is None:  # mindformers 2.1.0: the switch is apply_dsa_kernel_fusion
            return not bool(getattr(self.module, "apply_dsa_kernel_fusion", False))
        return bool(value)

    @property
    def has_indexer(self) -> bool:
        return getattr(self.module, "indexer", None) is not None

    def layer_spec(self) -> LayerSpec:
        ratio = self.compress_ratio
        if ratio > 0 and getattr(self.module, "compressor", None) is None:
            raise HpCpError(
                f"`{type(self.module).__name__}` has compress_ratio={ratio} but no compressor; "
                "expected the mindformers CompressedSparseAttention attribute `compressor`."
            )
        for name in _PRIMITIVES:  # found before any collective, or an HpCpError now
            _primitive(self.module, name)
        if not self.force_unfused:
            warnings.warn(
                f"`{type(self.module).__name__}` asks for the fused DSA kernels "
                "(apply_dsa_kernel_fusion=True); under CP hp_cp_mindformers runs the unfused "
                "small-op path (same math).",
                stacklevel=3,
            )
        return LayerSpec(
            compress_ratio=ratio,
            window_size=self.window_size,
            has_indexer=self.has_indexer and ratio == 4,
            force_unfused=self.force_unfused,
            packed_grid="global",
        )

    # -- stage hooks ------------------------------------------------------------------------
    def extract_ori_kv(self, key: Tensor) -> Tensor:
        if len(key.shape) == 3:
            return key
        return self.module.squeeze(key, 2)

    def compress_main(self, x: Tensor, halo_x: Any, call: CPContext) -> Tensor:
        return self._compress(self.module.compressor, x, halo_x, call)

    def compress_indexer(self, x: Tensor, halo_x: Any, call: CPContext) -> Tensor:
        # the cell feeds its indexer stop_gradient(x): the indexer learns from its KL loss only
        halo = None if halo_x is None else ops.stop_gradient(halo_x)
        return self._compress(self.module.indexer.compressor, ops.stop_gradient(x), halo, call)

    def _compress(self, compressor: Any, x: Tensor, halo_x: Any, call: Any) -> Tensor:
        plan = call.plan
        b = int(x.shape[1])
        if plan.gather_cap == 0:  # no slot on any rank: nothing is gathered
            return ops.zeros((0, b, 1, int(compressor.head_dim)), x.dtype)
        if plan.n_owned == 0:
            return self._empty_slots(compressor, x, halo_x, call)

        def compress(rows: Tensor, offset: int) -> Tensor:
            out = compressor(rows, rope_pos_offset=int(offset))
            if out is None:
                raise HpCpError(
                    f"the compressor returned None for {rows.shape[0]} rows (ratio "
                    f"{self.compress_ratio}); expected every CP segment to hold whole blocks."
                )
            return out

        return stage1_compress_with_halo(compress, x, halo_x, call)

    def _empty_slots(self, compressor: Any, x: Tensor, halo_x: Any, call: Any) -> Tensor:
        """0 slots that stay in the autograd graph (like the slots of the other ranks), so the
        all-gather's backward runs on this rank too: compress one block, keep none of it."""
        ops_ = call.ops
        r = self.compress_ratio
        x_ext = build_x_ext(ops_, x, halo_x, call.plan)
        rows = ops_.narrow(x_ext, 0, min(r, ops_.num_rows(x_ext)))
        rows = ops_.pad_rows(rows, r)
        out = compressor(rows, rope_pos_offset=0)
        return out[1:1]

    def run_attention(
        self, query: Tensor, ori_ext: Tensor, x: Tensor, qr: Tensor, call: CPContext
    ) -> Tensor:
        m, plan = self.module, call.plan
        n_local, b = int(query.shape[0]), int(query.shape[1])
        ori4 = mint.unsqueeze(ori_ext, 2) if len(ori_ext.shape) == 3 else ori_ext
        n_ext = int(ori4.shape[0])
        columns = PlanColumns(plan, n_ext)
        window = columns.window(0, n_local)
        cols = [np.broadcast_to(window[None], (b, n_local, window.shape[1]))]
        kv_full = ori4
        indexer_loss = None
        if call.cmp_kv_global is not None:
            # always in the graph (even with 0 rows): the all-gather's backward must run here
            kv_full = mint.cat([ori4, call.cmp_kv_global], 0)
            if self.has_indexer and call.cmp_idx_global is not None:
                picks = None
                if self._loss_wanted() and plan.n_slots_total > 0:
                    # every rank adds its share of the loss, even when its queries see no slot
                    picks, indexer_loss = self._indexer_select_with_loss(query, x, qr, call)
                elif plan.n_needed_slots > 0:
                    picks = self._indexer_select(query, x, qr, call)
                if picks is not None:
                    cols.append(columns.pool_rows(picks))
            elif plan.n_needed_slots > 0:
                hca = columns.pool_rows(columns.visible_slots(0, n_local))
                cols.append(np.broadcast_to(hca[None], (b, *hca.shape)))
        topk = Tensor(np.ascontiguousarray(np.concatenate(cols, axis=-1)).astype(np.int32))
        attend = _primitive(m, "unfused_compressed_sparse_attn")
        output = attend(query, kv_full, m.attn_sink, topk, m.softmax_scale)
        if indexer_loss is not None:
            output = m.indexer_loss_auto_scaler.apply(output, indexer_loss)
        return output

    # -- indexer ----------------------------------------------------------------------------
    def _loss_wanted(self) -> bool:
        m = self.module
        coeff = getattr(m, "dsa_indexer_loss_coeff", None) or 0
        return bool(
            m.training
            and getattr(m, "unfused_indexer_loss", None) is not None
            and getattr(m, "indexer_loss_auto_scaler", None) is not None
            and coeff > 0
        )

    def _indexer_queries(self, x: Tensor, qr: Tensor, pos_offset: int) -> tuple[Tensor, Tensor]:
        """Indexer queries ``[b, n, h, Di]`` and weights ``[b, n, h]`` of one contiguous run,
        from ``indexer.forward_before_topk`` (RoPE at ``pos_offset + t``)."""
        n = int(x.shape[0])
        r = self.compress_ratio
        if n < r:  # forward_before_topk also compresses x; it needs one whole block
            pad = [
                ops.zeros((r - n, *x.shape[1:]), x.dtype),
                ops.zeros((r - n, *qr.shape[1:]), qr.dtype),
            ]
            x, qr = mint.cat([x, pad[0]], 0), mint.cat([qr, pad[1]], 0)
        q, _, weights = self.module.indexer.forward_before_topk(x, qr, query_pos_offset=pos_offset)
        if n < r:
            q, weights = q[:, :n], weights[:, :n]
        return q, weights

    @staticmethod
    def _scores(q: Tensor, keys: Tensor, weights: Tensor) -> Tensor:
        """The unfused indexer score ``sum_h w_h * relu(q_h . k)``: ``[b, n, sk]`` fp32
        (``CSAIndexer.construct``'s math; ``keys`` is ``[b, sk, Di]``)."""
        q = ops.cast(q, mstype.float32)
        keys = ops.cast(keys, mstype.float32)
        weights = ops.cast(weights, mstype.float32)
        b, n, h, d = q.shape
        sk = keys.shape[1]
        s = mint.bmm(mint.reshape(q, (b, n * h, d)), mint.permute(keys, (0, 2, 1)))
        s = mint.nn.functional.relu(mint.reshape(s, (b, n, h, sk)))
        return mint.sum(s * mint.unsqueeze(weights, -1), dim=2)

    def _indexer_inputs(self, x: Tensor, qr: Tensor, call: Any) -> tuple:
        """Detached x / qr (the cell's indexer sees ``stop_gradient`` inputs) and the gathered
        indexer keys ``[b, N, Di]``."""
        keys = mint.permute(mint.squeeze(call.cmp_idx_global, 2), (1, 0, 2))
        return ops.stop_gradient(x), ops.stop_gradient(qr), keys

    def _indexer_select(self, query: Tensor, x: Tensor, qr: Tensor, call: Any) -> np.ndarray:
        """Global slot ids ``[b, L, index_topk]`` the indexer picks for every local query out of
        its visible slots only (``-1`` = none), chunk by chunk as the core plans them
        (:meth:`hp_cp_core.columns.PlanColumns.score_chunks`); host top-k, ties to the lower
        slot (the single-device order)."""
        plan = call.plan
        n_local, b = int(query.shape[0]), int(query.shape[1])
        topk = int(self.module.indexer.index_topk)
        xd, qrd, keys = self._indexer_inputs(x, qr, call)
        picks = np.full((b, n_local, topk), -1, dtype=np.int64)
        runs = plan.attention_runs()
        queries = [
            self._indexer_queries(
                xd[r.local_start : r.local_stop], qrd[r.local_start : r.local_stop], r.pos_offset
            )
            for r in runs
        ]
        for chunk in PlanColumns(plan, 0).score_chunks(call.config.query_chunk):
            k = next(i for i, r in enumerate(runs) if r.local_start <= chunk.lo < r.local_stop)
            (q_run, w_run), a = queries[k], chunk.lo - runs[k].local_start
            rows = slice(a, a + chunk.hi - chunk.lo)
            scores = self._scores(
                q_run[:, rows], keys[:, chunk.slot_start : chunk.slot_stop], w_run[:, rows]
            ).asnumpy()
            picks[:, chunk.lo : chunk.hi] = select_topk_numpy(scores, chunk, topk)
        return picks

    def _indexer_select_with_loss(self, query: Tensor, x: Tensor, qr: Tensor, call: Any):
        """Training with the indexer KL loss: score every global slot (the loss's softmax runs
        over all of them on one device too), pick exactly the single-device top-k, and attach
        this rank's share of the global token-weighted mean (the cell's local mean times its
        rows over all ranks' rows, Note [Indexer loss under CP] in hp_cp_core.indexer_loss),
        so gradients summed over ranks equal the single-device ones."""
        m, plan = self.module, call.plan
        b = int(query.shape[1])
        xd, qrd, keys = self._indexer_inputs(x, qr, call)
        n_total = int(plan.n_slots_total)
        k_eff = min(int(m.indexer.index_topk), n_total)
        pad = n_total - int(keys.shape[1])
        if pad:
            keys = mint.cat([keys, ops.zeros((b, pad, keys.shape[2]), keys.dtype)], 1)
        visible = PlanColumns(plan, 0).visibility(0, plan.n_local, 0, n_total)  # [L, N]
        mask = np.where(visible, 0.0, -np.inf).astype(np.float32)
        parts = []
        for run in plan.attention_runs():
            lo, hi = run.local_start, run.local_stop
            q_run, w_run = self._indexer_queries(xd[lo:hi], qrd[lo:hi], run.pos_offset)
            parts.append(self._scores(q_run, keys, w_run))
        scores = parts[0] if len(parts) == 1 else mint.cat(parts, 1)
        mask_t = Tensor(mask[None])
        scores = scores + mask_t
        host = scores.asnumpy()
        raw = np.argsort(-host, axis=-1, kind="stable")[..., :k_eff]
        raw_t = Tensor(raw.astype(np.int64))
        selected = mint.gather(scores, -1, raw_t)
        best = np.take_along_axis(host, raw, axis=-1)
        picks = np.where(np.isneginf(best), -1, raw)
        cmp_kv = ops.stop_gradient(call.cmp_kv_global)
        kpad = n_total - int(cmp_kv.shape[0])
        if kpad:
            cmp_kv = mint.cat([cmp_kv, ops.zeros((kpad, *cmp_kv.shape[1:]), cmp_kv.dtype)], 0)
        query_d, raw_i = ops.stop_gradient(query), Tensor(raw.astype(np.int32))
        real = call.extra.get("real_rows")
        counted = int(query.shape[0]) if real is None else int(real.sum())
        if real is not None and 0 < counted < int(query.shape[0]):
            # padding rows are out of the loss (Note [Padding to the layout]); the cell's loss
            # is a mean over its query rows, so it runs on the real rows only
            keep = Tensor(np.flatnonzero(real).astype(np.int64))
            selected, raw_i, mask_t = (
                mint.index_select(t, 1, keep) for t in (selected, raw_i, mask_t)
            )
            query_d = mint.index_select(query_d, 0, keep)
        loss = m.unfused_indexer_loss(selected, raw_i, query_d, cmp_kv, mask=mask_t)
        loss = loss * (b * counted * indexer_loss_weight(call))
        self._log_indexer_loss(loss, call)
        return picks, loss

    def _log_indexer_loss(self, loss: Tensor, call: Any) -> None:
        """Log the GLOBAL loss (the same on every rank) where the cell logs its own: the real
        cell's module-level ``save_to_indexer_losses_tracker`` (mindformers 2.1.0) and / or a
        ``last_indexer_loss`` attribute."""
        m = self.module
        tracker = getattr(
            sys.modules.get(type(m).__module__), "save_to_indexer_losses_tracker", None
        )
        if tracker is None and not hasattr(m, "last_indexer_loss"):
            return
        value = Tensor(global_indexer_loss(call, float(loss.asnumpy())), mstype.float32)
        if hasattr(m, "last_indexer_loss"):
            m.last_indexer_loss = value
        if tracker is not None:
            config = m.config
            tracker(value, m.layer_number, config.num_layers + (config.mtp_num_layers or 0))

    # -- the replaced construct ---------------------------------------------------------------
    def cu_seqlens(self, actual_seq_len: Any, query: Tensor, cp_size: int) -> np.ndarray | None:
        """Global ``cu_seqlens`` (leading 0) from the GLOBAL ``actual_seq_len`` (document ends,
        maybe padded with repeats), with the cell's own ``parse_cu_seqlens`` semantics."""
        if actual_seq_len is None:
            return None
        sq, b = int(query.shape[0]), int(query.shape[1])
        if b != 1:
            raise HpCpError(
                f"packed input (actual_seq_len given) needs batch 1 (SBND with b = 1); got "
                f"b = {b}. Pack the batch into one sequence or drop actual_seq_len."
            )
        if not isinstance(actual_seq_len, Tensor):
            actual_seq_len = Tensor(np.asarray(actual_seq_len, dtype=np.int64))
        ends = _primitive(self.module, "parse_cu_seqlens")(actual_seq_len, sq * cp_size)
        if ends is None:
            return None
        return np.concatenate([[0], np.asarray(ends, dtype=np.int64)])

    def make_forward(self, cp_forward: Callable[..., Any], group: Any) -> Callable[..., Any]:
        def construct(query, key, x, qr, actual_seq_len=None, **kwargs):
            if any(v is not None for v in kwargs.values()):
                raise HpCpError(
                    "a CompressedSparseAttention under CP takes (query, key, x, qr, "
                    f"actual_seq_len=None); got {sorted(kwargs)}."
                )
            # Note [Validate, agree, then communicate]: a bad actual_seq_len on one rank must
            # raise on every rank, so it is a problem for agree(), not an error raised here
            problems, cu = [], None
            try:
                cu = self.cu_seqlens(actual_seq_len, query, group.size)
            except HpCpError as exc:
                problems.append(str(exc))
            # every real row counts in the indexer loss's global mean: the cell takes no loss
            # mask, so the rows handle.shard(..., pad_value=) appended are left out here
            n_local, b = int(query.shape[0]), int(query.shape[1])
            real = cp_forward.real_rows(n_local)
            wanted = self._loss_wanted() or cp_forward.spec.has_indexer
            extra = {"real_rows": real}
            if wanted:
                extra["loss_rows_total"] = cp_forward.loss_rows_total(n_local, b)
            shapes = " ".join(str(list(t.shape[1:])) for t in (query, key, x, qr) if t is not None)
            check = cp_forward.inspect(int(x.shape[0]), cu, problems=problems, signature=shapes)
            call = cp_forward.agree(check, extra)
            return cp_forward(query, key, x, qr, call=call)

        return construct


def _looks_like_csa(cell: Any) -> bool:
    return all(hasattr(cell, a) for a in _CSA_ATTRS)


def adapter_for(module: Any) -> MindFormersDeepSeekV4CSAAdapter | None:
    """The adapter for ``module``, or ``None`` when the mindformers plugin does not own it."""
    if not isinstance(module, nn.Cell):
        return None
    explicit = module.__dict__.get(ADAPTER_ATTR)
    if explicit is not None:
        return explicit
    if _looks_like_csa(module):
        return MindFormersDeepSeekV4CSAAdapter(module)
    return None


def patch_mindformers_deepseek_v4_csa_forward(
    csa_module: nn.Cell, *, cp_mesh: Any, config: CPConfig | None = None
) -> Any:
    """Run a mindformers ``CompressedSparseAttention`` cell under CP.

    Args:
        csa_module: the cell (mindformers 2.1.0 ``CompressedSparseAttention`` or a cell with
            the same attributes and ``construct(query, key, x, qr, actual_seq_len=None)``).
        cp_mesh: a HyperParallel-style 1-D mesh (``size()``, ``get_local_rank()``,
            ``get_group()``) or a ``mindspore.communication`` group name.
        config: :class:`~hp_cp_core.CPConfig` options.

    Returns:
        The ``enable_cp`` handle; ``disable_cp(handle)`` restores the cell.
    """
    if not isinstance(csa_module, nn.Cell):
        raise HpCpError(
            f"patch_mindformers_deepseek_v4_csa_forward needs a mindspore nn.Cell, got a "
            f"{type(csa_module).__name__}."
        )
    object.__setattr__(csa_module, ADAPTER_ATTR, MindFormersDeepSeekV4CSAAdapter(csa_module))
    try:
        handle = enable_cp(csa_module, cp_mesh, config, backend="mindformers")
    except BaseException:
        object.__delattr__(csa_module, ADAPTER_ATTR)
        raise
    handle.on_disable(lambda: csa_module.__dict__.pop(ADAPTER_ATTR, None))
    return handle


def patch_deepseek_v4_compressed_sparse_attention_forward(
    csa_module: nn.Cell, *, cp_mesh: Any, config: CPConfig | None = None
) -> Any:
    """The design note's name for :func:`patch_mindformers_deepseek_v4_csa_forward`."""
    return patch_mindformers_deepseek_v4_csa_forward(csa_module, cp_mesh=cp_mesh, config=config)

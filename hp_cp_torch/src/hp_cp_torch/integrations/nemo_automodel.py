"""NeMo Automodel's DeepSeek V4 (``nemo_automodel.components.models.deepseek_v4``) under CP.

``hp_cp_core.enable_cp(model, mesh)`` on a NeMo ``DeepseekV4ForCausalLM`` /
``DeepseekV4Model`` (or one ``DeepseekV4Attention``) replaces the forward of every attention
layer (sliding window, CSA r = 4, HCA r = 128) with hp_cp's; hyper-connections, MoE (its
single-process expert path), norms and the head are token-local and run unchanged on each
rank's rows. Each rank then::

    batch = cp_nemo_batch(handle, input_ids)          # any S; padded, shifted, sharded
    labels, n_tokens = batch.pop("labels"), batch.pop("n_tokens")
    out = model(**batch)
    loss = cp_causal_lm_loss(out.logits, labels, n_tokens)

The stages reuse NeMo's own parameters and helpers op for op (interleaved partial RoPE,
the per-head rsqrt on q, the fp32 compressor with NeMo's overlap transform, the ReLU
indexer score, the sink column, the grouped output); its adapter derives from the HF one
and defines only the hooks whose ops differ.

NeMo's own CP (``model.prepare_model_inputs_for_cp`` / ``make_dsv4_contiguous_shard_cp_
batch_and_ctx``, which hands ``_dsv4_cp_group`` to the forward, or ``setup_cp_attention``)
must stay off: both at once is one :class:`~hp_cp_core.HpCpError` on every rank, before any
collective. Packed input in NeMo's format (``seq_lens`` rows padded with -1000, or
``packed_seq_ids``) becomes hp_cp's ``cu_seqlens`` in :func:`cp_nemo_batch`, which then
takes the core's one batch path (``handle.batch``); documents are not re-padded, each is
compressed from its own first row.

The same ``enable_cp`` / ``cp_nemo_batch`` take NeMo's DeepSeek V4.1 (``nemo_automodel_v41``)
and GLM-5 (``nemo_automodel_dsa``, where NeMo's DeepSeek V3.2 is refused, with the reason).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hp_cp_core import (
    CPHandle,
    HpCpError,
    LayerSpec,
    cu_seqlens_from_ids,
    cu_seqlens_from_lengths,
)
from hp_cp_torch._removed import ADAPTER_FOR, DISABLE, ENABLE, NEMO_BATCH, removed_names
from hp_cp_torch.integrations.nemo_automodel_v41 import is_v41_model, v41_batch_inputs
from hp_cp_torch.integrations.transformers import (
    DeepseekV4AttentionAdapter,
    ModelCallInputs,
    RopeForwardState,
    cp_causal_lm_loss,
    cp_shift_labels,
    cp_sum_gradients,
)
from hp_cp_torch.model.spec import ForwardState, IndexerParams, ModelHandle, Projection
from hp_cp_torch.model.validation import TensorChecks

__all__ = [
    "NemoDeepseekV4AttentionAdapter",
    "cp_causal_lm_loss",
    "cp_nemo_batch",
    "cp_shift_labels",
    "cp_sum_gradients",
]

__getattr__ = removed_names(
    __name__,
    enable_cp=ENABLE,
    disable_cp=DISABLE,
    nemo_cp_batch=NEMO_BATCH,
    nemo_adapter_for=ADAPTER_FOR,
)

LAYERS = "nemo_automodel.components.models.deepseek_v4.layers"
OPTIMIZED = "nemo_automodel.components.models.deepseek_v4.optimized_kernels"
SEQ_LENS_PADDING = -1000  # NeMo's _SEQ_LENS_PADDING_VALUE: unused seq_lens entries
NEMO_CP_KWARG = "_dsv4_cp_group"


def _nemo() -> Any:
    return sys.modules[LAYERS]


def _compress_rows(comp: nn.Module, rotary: nn.Module, rows: torch.Tensor, offset: int) -> Any:
    """NeMo's compressor body (``DeepseekV4Compressor`` / the indexer's pool) on rows
    ``[B, n, hidden]``: every complete block of ``r`` rows gives one slot at RoPE position
    ``offset + j*r``; ``[B, n // r, head_dim]``."""
    nemo, dtype, x32 = _nemo(), rows.dtype, rows.float()
    r, d, overlap = int(comp.compress_ratio), int(comp.head_dim), bool(comp.overlap)
    batch, n = rows.shape[0], rows.shape[1] // r
    kv, gate = comp.wkv(x32)[:, : n * r], comp.wgate(x32)[:, : n * r]
    feat = kv.shape[-1]
    kv_w = kv.reshape(batch, n, r, feat)
    gate_w = gate.reshape(batch, n, r, feat) + comp.ape_param(x32)
    if overlap:
        kv_w = nemo._overlap_transform(kv_w, d, fill_value=0.0)
        gate_w = nemo._overlap_transform(gate_w, d, fill_value=float("-inf"))
        all_masked = torch.isneginf(gate_w).all(dim=2, keepdim=True)
        gate_w = torch.where(all_masked, torch.zeros_like(gate_w), gate_w)
    pooled = comp.kv_norm((kv_w * gate_w.softmax(dim=2)).sum(dim=2).to(dtype))  # [B, n, d]
    positions = (torch.arange(n, device=rows.device) * r + int(offset)).unsqueeze(0)
    cos, sin = rotary(pooled, positions.expand(batch, -1))
    pooled = nemo._apply_partial_rope(pooled.unsqueeze(1), cos, sin, comp.rope_head_dim)
    return pooled.squeeze(1)


class NemoDeepseekV4AttentionAdapter(DeepseekV4AttentionAdapter):
    """Hooks for NeMo's ``DeepseekV4Attention``; the HF adapter's checks and attention."""

    def layer_spec(self) -> LayerSpec:
        m = self.module
        ratio = int(m.compress_ratio)
        if ratio and (ratio == 4) != self._is_csa:
            raise HpCpError(
                f"NeMo DeepseekV4Attention layer {m.layer_idx} has compress ratio {ratio} "
                f"{'with' if self._is_csa else 'without'} an indexer; hp_cp supports the "
                "indexer (overlapping) layers only at ratio 4. Use compress_ratios of 0, 4, 128."
            )
        return LayerSpec(
            compress_ratio=ratio,
            window_size=int(m.sliding_window),
            has_indexer=self._is_csa,
            force_unfused=True,
        )

    def compress(self, rows: torch.Tensor, start: int, state: RopeForwardState) -> torch.Tensor:
        return _compress_rows(self.module.compressor, state.inputs.rotary_compress, rows, start)

    def compress_index_keys(
        self, rows: torch.Tensor, start: int, state: RopeForwardState
    ) -> torch.Tensor:
        indexer = self.module.compressor.indexer
        return _compress_rows(indexer, state.inputs.rotary_compress, rows, start)

    def index_queries(self, state: RopeForwardState) -> tuple[torch.Tensor, torch.Tensor]:
        """NeMo's indexer queries (interleaved partial RoPE) and per-head weights."""
        ix, x = self.module.compressor.indexer, state.hidden
        with torch.no_grad():
            q = ix.wq_b(state.qr).view(*x.shape[:2], ix.n_heads, ix.head_dim).transpose(1, 2)
            q = _nemo()._apply_partial_rope(q, state.cos, state.sin, ix.rope_head_dim)
            return q.transpose(1, 2), ix.weights_proj(x).float() * (ix.n_heads**-0.5)

    def index_scores(self, state: ForwardState, lo: int, hi: int, keys: torch.Tensor) -> Any:
        """NeMo's ``indexer_scores_torch``."""
        (q, weights), ix = state.index_queries, self.module.compressor.indexer
        scores = sys.modules[OPTIMIZED].indexer_scores_torch
        return scores(q[:, lo:hi], keys, weights[:, lo:hi], ix.softmax_scale)

    def indexer_params(self) -> IndexerParams | None:
        if not self._is_csa:
            return None
        ix = self.module.compressor.indexer
        return IndexerParams(int(ix.index_topk), int(ix.n_heads))

    def output(self, o: torch.Tensor, state: RopeForwardState) -> torch.Tensor:
        """NeMo's tail: inverse interleaved RoPE, grouped ``wo_a``, ``wo_b``."""
        m, cos, sin = self.module, state.cos, state.sin
        o = _nemo()._apply_partial_rope(o.transpose(1, 2), cos, -sin, m.rope_head_dim)
        o = o.transpose(1, 2)
        grouped = o.reshape(o.shape[0], o.shape[1], m.config.o_groups, -1)
        return m.wo_b(m.wo_a(grouped).flatten(2))

    def check_inputs(self, inputs: NemoCallInputs, checks: TensorChecks) -> None:
        """The HF adapter's, and what hp_cp cannot take from NeMo's attention call."""
        super().check_inputs(inputs, checks)
        m = self.module
        kwargs, start_pos, rotary = inputs.kwargs, inputs.start_pos, inputs.rotary_compress
        if kwargs.get(NEMO_CP_KWARG) is not None or getattr(m, "_cp_group", None) is not None:
            checks.fail(_NEMO_CP_ON)
        if kwargs.get("packed_seq_ids") is not None:
            checks.fail(
                "got NeMo packing metadata (packed_seq_ids / seq_lens with qkv_format='thd'); "
                "under hp_cp pass the batch from cp_nemo_batch(handle, input_ids, seq_lens=...), "
                "which turns it into cu_seqlens."
            )
        if kwargs.get("vision_token_types") is not None:
            checks.fail("visual tokens are not supported under CP; pass text-only batches.")
        if int(start_pos) != 0:
            checks.fail(f"start_pos={start_pos} (a cache offset) is not supported under CP.")
        if m.compressor is not None and rotary is None:
            checks.fail("needs rotary_compress from the model; call the model, not the layer.")

    @staticmethod
    def prepare_model(model: nn.Module, layers: list[nn.Module], handle: ModelHandle) -> None:
        """Refuse NeMo's own CP at enable time, and install a forward pre-hook on ``model``
        that refuses it per call, before the model runs (so before any collective)."""
        if any(getattr(layer, "_cp_group", None) is not None for layer in layers):
            raise HpCpError(_NEMO_CP_ON)

        def guard(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            if kwargs.get(NEMO_CP_KWARG) is not None or any(
                getattr(layer, "_cp_group", None) is not None for layer in layers
            ):
                raise HpCpError(_NEMO_CP_ON)

        handle.on_disable(model.register_forward_pre_hook(guard, with_kwargs=True).remove)

    def read_inputs(
        self,
        hidden_states: Any,
        position_embeddings: Any = None,
        attention_mask: Any = None,
        position_embeddings_compress: Any = None,
        rotary_compress: Any = None,
        start_pos: int = 0,
        position_ids: Any = None,
        **kwargs: Any,
    ) -> NemoCallInputs:
        return NemoCallInputs(
            hidden_states,
            position_ids,
            kwargs.get("cu_seqlens"),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            kwargs=kwargs,
            position_embeddings_compress=position_embeddings_compress,
            rotary_compress=rotary_compress,
            start_pos=start_pos,
        )

    def project(self, state: RopeForwardState) -> Projection:
        """NeMo's projections (RMS-normed, interleaved partial RoPE) on the local rows."""
        m, nemo, x, inputs = self.module, _nemo(), state.hidden, state.inputs
        tables = inputs.position_embeddings
        if m.compress_ratio and inputs.position_embeddings_compress is not None:
            tables = inputs.position_embeddings_compress
        state.cos, state.sin = tables
        state.qr = m.q_norm(m.wq_a(x))
        q = m.wq_b(state.qr).view(*x.shape[:2], m.num_heads, m.head_dim).transpose(1, 2)
        kv = m.kv_norm(m.wkv(x)).view(*x.shape[:2], 1, m.head_dim).transpose(1, 2)
        q = nemo._rms_norm_last_dim(q, m.config.rms_norm_eps)
        q = nemo._apply_partial_rope(q, state.cos, state.sin, m.rope_head_dim)  # [B, H, L, D]
        kv = nemo._apply_partial_rope(kv, state.cos, state.sin, m.rope_head_dim)  # [B, 1, L, D]
        return Projection(q.transpose(1, 2), kv[:, 0])


@dataclass
class NemoCallInputs(ModelCallInputs):
    """NeMo's ``DeepseekV4Attention`` call: HF's fields and NeMo's own."""

    position_embeddings_compress: Any = None
    rotary_compress: Any = None
    start_pos: int = 0


_NEMO_CP_ON = (
    "NeMo Automodel's own DeepSeek V4 CP is switched on as well (the batch carries "
    f"{NEMO_CP_KWARG!r} from make_dsv4_contiguous_shard_cp_batch_and_ctx / "
    "prepare_model_inputs_for_cp, or setup_cp_attention gave the layer a _cp_group); hp_cp "
    "owns the attention layers, so switch NeMo's CP off (cp_size 1 in its parallelizer, no "
    "cp_sharder) and shard the batch with cp_nemo_batch(handle, ...) instead."
)


def _as_numpy(value: Any) -> Any:
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value


# --------------------------------------------------------------------------- batches


def cp_nemo_batch(
    handle: CPHandle,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    seq_lens: Any = None,
    packed_seq_ids: Any = None,
    ignore_index: int = -100,
) -> dict[str, Any]:
    """NeMo's batch format on the one batch path (:meth:`hp_cp_core.CPHandle.batch`):
    this rank's part of a causal-LM batch of any length, padded, shifted and sharded.

    ``input_ids`` / ``labels`` are the FULL sequences ``[B, S]`` (labels default to the
    inputs). Packed input (``B == 1``) in NeMo's format, ``seq_lens`` (``[1, n_docs]``,
    unused entries -1000) or ``packed_seq_ids`` (one id per token), becomes ``cu_seqlens``
    for ``handle.batch``: each document keeps its own rows (no re-padding), its positions
    restart at 0 and its last token has no target. The sequence is padded at the end to
    what the layout needs (token 0, label ``ignore_index``); a packed or padded batch runs
    the CP path on a group of one too (NeMo's forward would let the documents attend to each
    other, or score the padding in its top-k rows).

    Returns:
        The model's keyword arguments in NeMo's names, ``input_ids`` and ``position_ids``
        (``[B, local rows]``) and, packed, ``cu_seqlens`` (global boundaries including the
        padding; DeepSeek V4.1 instead: ``packed_seq_ids`` and ``attention_mask`` of this
        rank's rows), plus ``labels`` (this rank's shifted targets) and ``n_tokens``
        (targets of the whole batch): pop the last two before ``model(**batch)``.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise HpCpError(
            "input_ids must be the full token ids [B, S] (a 2-D tensor); got "
            f"{type(input_ids).__name__} {list(getattr(input_ids, 'shape', []))}."
        )
    labels = input_ids if labels is None else labels
    if tuple(labels.shape) != tuple(input_ids.shape):
        raise HpCpError(
            f"labels {list(labels.shape)} must have the shape of input_ids "
            f"{list(input_ids.shape)} (unshifted; cp_nemo_batch shifts them)."
        )
    if seq_lens is not None and packed_seq_ids is not None:
        raise HpCpError("pass seq_lens or packed_seq_ids, not both.")
    total = int(input_ids.shape[1])
    cu = None
    if seq_lens is not None:
        cu = cu_seqlens_from_lengths(_as_numpy(seq_lens), total, unused=SEQ_LENS_PADDING)
    elif packed_seq_ids is not None:
        cu = cu_seqlens_from_ids(_as_numpy(packed_seq_ids), total)
    if cu is not None and input_ids.shape[0] != 1:
        raise HpCpError(
            f"packed input has batch {input_ids.shape[0]}; pack the documents of a step into "
            "one row, input_ids [1, S]."
        )
    batch = handle.batch(input_ids, labels=labels, cu_seqlens=cu, ignore_index=ignore_index)
    if is_v41_model(handle.module):  # V4.1 reads per-row document ids, not cu_seqlens
        out = v41_batch_inputs(handle, batch, input_ids)
    else:
        out = {
            "input_ids": batch.input_ids,
            "position_ids": batch.position_ids.expand(int(input_ids.shape[0]), -1).contiguous(),
        }
        if batch.cu_seqlens is not None:
            out["cu_seqlens"] = batch.cu_seqlens
    out["labels"] = batch.labels
    out["n_tokens"] = batch.n_tokens
    return out

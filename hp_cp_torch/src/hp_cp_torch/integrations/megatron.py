"""megatron-core 0.19.2's DeepSeek sparse attention (V3.2, GLM-5) under CP.

``enable_cp(model, parallel_state.get_context_parallel_group(), config)`` on a ``GPTModel``
built from Megatron's own DSA spec replaces the forward of every ``AbsorbedMLASelfAttention``
(the rest is token-local); the batch comes from ``handle.batch`` with :func:`megatron_labels`
and :func:`packed_seq_params` in place of ``get_batch_on_this_cp_rank``.
Megatron keeps its ``context_parallel_size`` and CP group (Note [Megatron's CP group under
hp_cp] in :mod:`.megatron_batch`); hp_cp owns the attention layers, DSA's
``LayerSpec(compress_ratio=1, window_size=0, has_indexer=True)``: the slot of token ``j`` is
its MLA latent ``[kv_layernorm(c_kv) ; roped k_pos_emb]`` with its indexer key. The stages are
Megatron's ops on the module's own parameters, sequence-major (docs/megatron.md walks through
them and lists what is refused: tensor parallelism, attention masks, inference contexts).
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hp_cp_core import HpCpError, LayerSpec
from hp_cp_torch.integrations.megatron_batch import (
    check_packed,
    megatron_labels,
    megatron_loss,
    packed_seq_params,
)
from hp_cp_torch.integrations.megatron_kernel import megatron_sparse_attention
from hp_cp_torch.kernels.request import AttentionRequest
from hp_cp_torch.model.runner import model_argument, watch_model_argument
from hp_cp_torch.model.spec import (
    AttentionParams,
    ForwardState,
    IndexerParams,
    Latent,
    LayerInputs,
    ModelAdapter,
    ModelHandle,
    PlanView,
    Projection,
    Traits,
)
from hp_cp_torch.model.validation import TensorChecks

__all__ = ["MegatronDSAAttentionAdapter", "megatron_labels", "megatron_loss", "packed_seq_params"]

ABSORBED_MLA = "megatron.core.transformer.experimental_attention_variant.absorbed_mla"
DSA = "megatron.core.transformer.experimental_attention_variant.dsa"
DSA_MASKING = "megatron.core.transformer.experimental_attention_variant.dsa_masking"
DSA_LOSS = "megatron.core.transformer.experimental_attention_variant.dsa_indexer_loss"
ROPE_UTILS = "megatron.core.models.common.embeddings.rope_utils"
GPT_MODEL = "megatron.core.models.gpt.gpt_model"
MEGATRON_ARGS = (
    "key_value_states inference_context rotary_pos_emb rotary_pos_cos rotary_pos_sin "
    "rotary_pos_cos_sin attention_bias packed_seq_params position_ids sequence_len_offset"
).split()
"""``AbsorbedMLASelfAttention.forward``'s arguments after ``attention_mask``, in order."""
POSITIONS_HINT = (
    "got position_ids that are not hp_cp's positions of this rank's rows (the global row, or "
    "the position within the document when packed): a batch sharded by Megatron's "
    "get_batch_on_this_cp_rank (its zigzag) or not sharded. Under hp_cp build the batch with "
    "handle.batch(tokens, cu_seqlens=...) and pass its input_ids and position_ids."
)

# Note [Megatron's RoPE is position-blind]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Megatron's MLA and indexer rope positions 0 .. S-1 of the local rows and cut the table by
# their own zigzag at context_parallel_size > 1; position_ids never reach the layers. Under
# hp_cp the adapter reads the layer's own table (RotaryEmbedding.get_emb, Yarn's too, before
# any CP cut) at hp_cp's positions of the local rows: row p of the table is the same whatever
# its length, so each row is roped as on one process (packed: per document, as thd RoPE).

# Note [The Megatron indexer loss under hp_cp]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Megatron's KL (compute_dsa_indexer_loss): per query row, the teacher is the absorbed
# attention's softmax per head (query and latents detached), summed over heads and
# L1-normalised; the student the log-softmax of the indexer scores; over every visible key
# (dense, the default) or only the top-k picks (dsa_indexer_use_sparse_loss). Each local
# query's visible keys are in the gathered latents and indexer keys, so indexer_row_kl is
# Megatron's own masked_softmax / normalize_indexer_target / indexer_kl_per_row on them; the
# runner sums the real rows over all ranks' count, or not with calculate_per_token_loss
# (loss_mean=False), and loss_attach hands the loss x coeff to Megatron's logging (summed over
# the CP group) and DSAIndexerLossAutoScaler (the schedule's loss scale, as on one process).


def _module(name: str) -> Any:
    return importlib.import_module(name)


@dataclass
class MegatronCallInputs(LayerInputs):
    """``AbsorbedMLASelfAttention.forward``'s call: the hidden rows and what hp_cp checks."""

    attention_mask: Any = None
    packed_seq_params: Any = None
    unsupported: tuple[str, ...] = ()


@dataclass(kw_only=True)
class MegatronDSAState(ForwardState):
    """One forward's values: ``linear_proj``'s bias for :meth:`finish`."""

    bias: Any = None


class MegatronDSAAttentionAdapter(ModelAdapter):
    """Hooks for megatron-core's ``AbsorbedMLASelfAttention`` with ``DSAttention`` (sequence-
    major ``[S, B, hidden]``, packed ``[T, 1, hidden]``): Megatron's MLA projections and
    indexer at global positions, attention on the latents, Megatron's indexer loss."""

    claims = (f"{ABSORBED_MLA}.AbsorbedMLASelfAttention",)
    traits = Traits(
        state_class=MegatronDSAState,
        sequence_dim=0,
        packed_topk_row="stream",  # Megatron's thd top-k: one row per packed stream
        per_forward=("position_ids",),  # the GPTModel's, from its pre-hook
        model_group="pg_collection.cp",  # Megatron's CP group must be hp_cp's
        rows_are_slots=True,  # the indexer's input detached: its loss only, as Megatron
    )

    @property
    def _indexer(self) -> Any:
        """The layer's ``DSAIndexer``, or ``None`` on a layer IndexShare skips."""
        return getattr(self.module.core_attention, "indexer", None)

    @classmethod
    def prepare_model(cls, model: nn.Module, layers: list[nn.Module], handle: ModelHandle) -> None:
        """Refuse tensor parallelism before any exchange; a forward pre-hook on each
        ``GPTModel`` hands the layers its ``position_ids`` (kept per forward: ``traits.
        per_forward``), so that a batch Megatron sharded is refused, not roped at the wrong
        rows (a Megatron CP group not hp_cp's is refused: ``traits.model_group``)."""
        for layer in layers:
            if int(layer.config.tensor_model_parallel_size) != 1:
                raise HpCpError(
                    f"AbsorbedMLASelfAttention layer {getattr(layer, 'layer_number', '?')} "
                    "under CP: tensor_model_parallel_size="
                    f"{layer.config.tensor_model_parallel_size}; hp_cp runs Megatron's DSA at "
                    "tensor parallel size 1 (its heads and indexer are not split). Use "
                    "tensor_model_parallel_size=1 with context, data, pipeline or expert "
                    "parallelism."
                )
        gpt = getattr(sys.modules.get(GPT_MODEL), "GPTModel", None)
        if gpt is not None:  # GPTModel.forward(input_ids, position_ids, ...)
            watch_model_argument(model, gpt, "position_ids", 1, layers, handle)

    def layer_spec(self) -> LayerSpec:
        return LayerSpec(
            compress_ratio=1,
            window_size=0,
            has_indexer=True,
            force_unfused=True,
            reuses=() if self._indexer is not None else ("selection",),
        )

    def layer_name(self) -> str:
        number = getattr(self.module, "layer_number", None)
        shared = " (IndexShare)" if self._indexer is None else ""
        return f"AbsorbedMLASelfAttention layer {number}{shared}"

    def read_inputs(
        self,
        hidden_states: Any,
        attention_mask: Any = None,
        *args: Any,
        packed_seq_params: Any = None,
        **kwargs: Any,
    ) -> MegatronCallInputs:
        """``AbsorbedMLASelfAttention.forward``'s call; the model's ``position_ids`` are the
        ``GPTModel``'s (hp_cp keeps each forward's: ``traits.per_forward``)."""
        given = {**dict(zip(MEGATRON_ARGS, args)), **kwargs}
        psp = given.pop("packed_seq_params", packed_seq_params)  # 8th positional
        cu = None if psp is None else getattr(psp, "cu_seqlens_q", None)
        return MegatronCallInputs(
            hidden_states,
            model_argument(self.module, "position_ids"),
            cu,
            attention_mask=attention_mask,
            packed_seq_params=psp,
            unsupported=tuple(
                k for k, v in given.items() if k != "position_ids" and v not in (None, False)
            ),
        )

    def check_inputs(self, inputs: MegatronCallInputs, checks: TensorChecks) -> None:
        """The hidden rows, and what hp_cp cannot take from Megatron's call."""
        config = self.module.config
        checks.layer_input(self.module, inputs, hidden_size=int(config.hidden_size))
        if inputs.unsupported:
            checks.fail(
                f"got {', '.join(inputs.unsupported)}; under CP the layer runs training and "
                "evaluation forwards of the whole sequence (no inference context, no rotary "
                "tables or biases passed in: hp_cp ropes at its own global positions)."
            )
        if inputs.attention_mask is not None:
            checks.fail(
                "got an attention_mask; under CP pass attention_mask=None (the causal and "
                "document masks are hp_cp's plan: handle.batch pads at the end, where no real "
                "token sees the padding; build the data without attention masks, Megatron's "
                "--no-create-attention-mask-in-dataloader)."
            )
        psp = inputs.packed_seq_params
        if psp is not None:
            check_packed(psp, checks)
        if self.module.attn_mask_type.name != "causal":
            checks.fail(f"attn_mask_type={self.module.attn_mask_type.name}; CP runs causal DSA.")

    def value_checks(self, inputs: MegatronCallInputs, plan: PlanView) -> list[tuple[Any, str]]:
        """The model's ``position_ids`` (when it was given any) are hp_cp's positions of the
        local rows."""
        pos = inputs.position_ids
        if not isinstance(pos, torch.Tensor):
            return []
        want = torch.as_tensor(plan.positions, device=pos.device)
        return [((pos.reshape(-1, want.numel()) != want).any(), POSITIONS_HINT)]

    # ------------------------------------------------------------------ projections
    def _rope_table(self, rope: nn.Module, state: ForwardState) -> tuple[torch.Tensor, float]:
        """The layer's rotary table at the local rows' positions ``[L, 1, 1, D]`` and its
        mscale (Note [Megatron's RoPE is position-blind])."""
        positions = state.positions[0]
        count = int(state.view.positions.max()) + 1 if state.view.positions.size else 1
        table = rope.get_emb(count)
        table, mscale = table if isinstance(table, tuple) else (table, 1.0)
        return table.index_select(0, positions.to(table.device).long()), float(mscale)

    def project(self, state: ForwardState) -> Projection:
        """Megatron's MLA projections (``get_query_key_value_tensors`` without its up
        absorption) and, on a layer with its own indexer, the indexer's queries, weights and
        keys (``forward_before_topk``), sequence-major, at global positions."""
        m, config = self.module, self.module.config
        apply_rope = _module(ROPE_UTILS).apply_rotary_pos_emb
        x = state.hidden.transpose(0, 1)  # [L, B, hidden], Megatron's layout
        length, batch = x.shape[:2]
        if config.q_lora_rank is not None:
            q_compressed = m.q_layernorm(m.linear_q_down_proj(x)[0])
            q = m.linear_q_up_proj(q_compressed)[0]
        else:
            q_compressed = x
            q = m.linear_q_proj(x)[0]
        kv_combined = m.linear_kv_down_proj(x)[0]
        kv_compressed, k_pos_emb = torch.split(
            kv_combined, [config.kv_lora_rank, config.qk_pos_emb_head_dim], dim=-1
        )
        kv_compressed = m.kv_layernorm(kv_compressed)
        q = q.view(length, batch, m.num_attention_heads_per_partition, m.q_head_dim)
        q_no_pe, q_pos_emb = torch.split(
            q, [config.qk_head_dim, config.qk_pos_emb_head_dim], dim=-1
        )
        table, mscale = self._rope_table(m.rotary_pos_emb, state)
        rope = dict(config=config, mscale=mscale, mla_rotary_interleaved=True)
        q_pos_emb = apply_rope(q_pos_emb, table, **rope)
        k_pos_emb = apply_rope(k_pos_emb.unsqueeze(-2), table, **rope).squeeze(-2)
        query = torch.cat([q_no_pe, q_pos_emb], dim=-1).transpose(0, 1)  # [B, L, H, D]
        latents = torch.cat([kv_compressed, k_pos_emb], dim=-1).transpose(0, 1)  # [B, L, c+r]
        index_keys = None
        if self._indexer is not None:
            index_keys = self._indexer_projection(x, q_compressed, state)
        return Projection(query, latents, index_keys=index_keys)

    def _loss_on(self) -> bool:
        """Megatron's ``use_indexer_loss``: training, with autograd, a positive coefficient,
        on a layer that computes its top-k."""
        coeff = self.module.config.dsa_indexer_loss_coeff or 0.0
        return (
            self._indexer is not None
            and self.module.training
            and torch.is_grad_enabled()
            and coeff > 0
        )

    def _indexer_projection(
        self, x: torch.Tensor, qr: torch.Tensor, state: ForwardState
    ) -> torch.Tensor:
        """``DSAIndexer.forward_before_topk`` at global positions on the detached ``x`` /
        ``qr`` (``[L, B, ...]``): keeps ``(q [L, B, h, d], weights [L, B, h])`` as
        ``state.index_queries`` and returns the keys ``[B, L, d]``."""
        ix, config = self._indexer, self.module.config
        rotate = _module(DSA).rotate_activation  # looked up per call (a test may replace it)
        x, qr = x.detach(), qr.detach()
        length, batch = x.shape[:2]
        with torch.enable_grad() if self._loss_on() else torch.no_grad():
            table, mscale = self._rope_table(ix.rotary_pos_emb, state)
            q = ix.linear_wq_b(qr)[0].reshape(length, batch, ix.index_n_heads, ix.index_head_dim)
            q = ix._apply_rope(q, table, mscale)
            k = ix.linear_wk(x)[0]
            if config.dsa_indexer_k_norm_fp32:
                k = ix.k_norm(k.float()).to(dtype=k.dtype)
            else:
                k = ix.k_norm(k)
            k = ix._apply_rope(k.reshape(length, batch, 1, ix.index_head_dim), table, mscale)
            k = k.reshape(length, batch, ix.index_head_dim)
            if config.dsa_indexer_rotate_activation:
                q, k = rotate(q), rotate(k)
            weights = ix.linear_weights_proj(x)[0]
            weights = weights * (ix.index_n_heads**-0.5) * ix.softmax_scale
        state.index_queries = (q, weights)
        return k.transpose(0, 1)

    def index_scores(self, state: ForwardState, lo: int, hi: int, keys: torch.Tensor) -> Any:
        """Megatron's ``_compute_index_scores`` of local queries ``lo:hi`` over ``keys [B, s,
        d]``: ``[B, hi - lo, s]``."""
        q, weights = state.index_queries
        score = _module(DSA)._compute_index_scores
        relu = bool(self.module.config.dsa_indexer_scoring_relu)
        return score(q[lo:hi], weights[lo:hi], keys.transpose(0, 1), use_relu=relu)

    def indexer_params(self) -> IndexerParams | None:
        """The indexer's top-k, heads and Megatron's loss (Note [The Megatron indexer loss
        under hp_cp]); ``None`` on a layer IndexShare skips."""
        ix, config = self._indexer, self.module.config
        if ix is None:
            return None
        return IndexerParams(
            topk=int(ix.index_topk),
            heads=int(ix.index_n_heads),
            loss_coeff=float(config.dsa_indexer_loss_coeff) if self._loss_on() else None,
            loss_mean=not config.calculate_per_token_loss,
            loss_attach=self._attach_loss,
        )

    def attention_params(self) -> AttentionParams:
        m, config = self.module, self.module.config
        dims = Latent(
            int(config.qk_head_dim),
            int(config.qk_pos_emb_head_dim),
            int(config.v_head_dim),
            int(config.kv_lora_rank),
            m.linear_kv_up_proj.weight,
        )
        return AttentionParams(float(m.core_attention.softmax_scale), kind="latent", latent=dims)

    def attention(self, request: AttentionRequest, state: ForwardState) -> torch.Tensor:
        """Megatron's own sparse attention (its fused backends where ``dsa_kernel_backend``
        names one, else its unfused path) on the gathered latents: ``attention_kernel=
        "megatron"`` (or ``"model_ops"``, ``attention_precision="model"``); Note [Megatron's
        kernel on hp_cp's prefix]."""
        return megatron_sparse_attention(self.module, request, state.view)

    def output(self, o: torch.Tensor, state: ForwardState) -> torch.Tensor:
        """``linear_proj`` of the heads' values ``o [B, L, H, v_head_dim]`` (its bias kept for
        :meth:`finish`)."""
        out, state.bias = self.module.linear_proj(o.reshape(o.shape[0], o.shape[1], -1))
        return out

    def finish(self, out: torch.Tensor, state: ForwardState) -> Any:
        """``(output, bias)`` as Megatron's attention returns them."""
        return out, state.bias

    # ------------------------------------------------------------------ the indexer loss
    def _attach_loss(self, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` (this rank's share, times the coefficient) to Megatron's logging (summed
        over the CP group when reduced) and attached with its ``DSAIndexerLossAutoScaler``."""
        m, dsa = self.module, _module(DSA)
        cp = getattr(getattr(m, "pg_collection", None), "cp", None)
        dsa.DSAIndexerLossLoggingHelper.save_loss_to_tracker(
            loss=loss,
            layer_number=m.layer_number,
            num_layers=m.config.num_layers,
            reduce_group=cp if cp is not None and cp.size() > 1 else None,
        )
        return dsa.DSAIndexerLossAutoScaler.apply(out, loss)

    def indexer_row_kl(self, state: ForwardState, lo: int, hi: int) -> torch.Tensor:
        """Megatron's KL of the local queries ``lo:hi`` ``[B, hi - lo]``, dense (every slot
        a row sees) or sparse (its picks): Note [The Megatron indexer loss under hp_cp]."""
        m, config = self.module, self.module.config
        masking, kl = _module(DSA_MASKING), _module(DSA_LOSS)
        q_idx, weights = state.index_queries
        keys = state.keys  # [B, N, d], with autograd back to each key's owner
        batch, device = keys.shape[0], keys.device
        start = torch.as_tensor(state.view.slot_start[lo:hi], device=device).long()
        stop = start + torch.as_tensor(state.view.slot_count[lo:hi], device=device).long()
        n = int(stop.max())
        cols = torch.arange(n, device=device)
        valid = ((cols >= start[:, None]) & (cols < stop[:, None])).expand(batch, -1, -1)
        if config.dsa_indexer_use_sparse_loss:
            picks = state.selected[:, lo:hi].to(device).long()
            picked = torch.zeros(batch, hi - lo, n + 1, dtype=torch.bool, device=device)
            picked.scatter_(-1, torch.where((picks >= 0) & (picks < n), picks, n), True)
            valid = valid & picked[..., :n]
        query = state.projection.query[:, lo:hi].detach()
        q_no_pe, q_pe = torch.split(query, [config.qk_head_dim, config.qk_pos_emb_head_dim], -1)
        k_up, _ = m._get_kv_up_weights()
        q_abs = torch.einsum("...nd,ndk->...nk", q_no_pe, k_up.detach())
        q_abs = torch.cat([q_abs, q_pe], dim=-1).float()  # [B, l, H, c + r]
        latents = state.slots[:, :n].detach().float()  # [B, n, c + r]
        scale = float(m.core_attention.softmax_scale)
        logits = torch.einsum("blhd,bnd->bhln", q_abs, latents) * scale
        target = masking.masked_softmax(logits, valid.unsqueeze(1).expand_as(logits))
        target = kl.normalize_indexer_target(target.sum(dim=1))  # [B, l, n]
        relu = bool(config.dsa_indexer_scoring_relu)
        scores = _module(DSA)._compute_index_scores(
            q_idx[lo:hi], weights[lo:hi], keys[:, :n].transpose(0, 1), use_relu=relu
        )
        return kl.indexer_kl_per_row(target, masking.masked_log_softmax(scores.float(), valid))

"""megatron-core 0.19.2's DeepSeek sparse attention (V3.2, GLM-5) under CP.

``enable_cp(model, cp_group, config)`` on a Megatron ``GPTModel`` built from Megatron's own spec
(``get_transformer_layer_with_experimental_attention_variant_spec``: ``TransformerLayer`` ->
``AbsorbedMLASelfAttention`` -> ``DSAttention`` -> ``DSAIndexer``) replaces the forward of every
``AbsorbedMLASelfAttention``; embeddings, MLP / MoE, norms and the output layer are token-local
and run unchanged on each rank's rows. Each rank::

    cp_group = parallel_state.get_context_parallel_group()   # Megatron's own CP group
    handle = enable_cp(model, cp_group, DeepSeekV4CPConfig(layout="load_balanced"))
    batch = handle.batch(tokens, cu_seqlens=cu)      # in place of get_batch_on_this_cp_rank
    out = model(batch.input_ids, batch.position_ids, None, labels=megatron_labels(batch),
                packed_seq_params=packed_seq_params(batch))

The mapping (Note [Megatron's CP group under hp_cp]): Megatron keeps its
``context_parallel_size`` and CP group, so its data loading, DDP reduction over data x context
parallel ranks and its schedule's loss scales are unchanged; hp_cp owns the attention layers,
so Megatron's all-gather DSA CP, its zigzag RoPE slicing and its per-rank indexer loss never run.

The layer is DSA, the core's ``LayerSpec(compress_ratio=1, window_size=0, has_indexer=True)``:
every token is its own slot, the slot of token ``j`` is its MLA latent ``[kv_layernorm(c_kv)
(kv_lora_rank) ; roped k_pos_emb (qk_pos_emb_head_dim)]`` and its indexer key, so one exchange
per layer moves each rank the latents and indexer keys of the causal prefix its queries read,
never per-head keys and values. A layer Megatron's IndexShare skips
(``dsa_indexer_topk_freq``) has no indexer: it reuses the picks of the last layer that
computed them through the core's sharing plan and moves no indexer keys.

The stages are Megatron's ops on the module's own parameters, sequence-major as Megatron runs
them (``Traits(sequence_dim=0)``):

* RoPE at global positions: the layer's own ``RotaryEmbedding.get_emb`` (Yarn's too) table,
  read at hp_cp's positions of the local rows (the global row, or the position within the
  document when packed), applied by ``apply_rotary_pos_emb``; Megatron's own forward counts
  the local rows from 0 and slices by its own zigzag (Note [Megatron's RoPE is
  position-blind]);
* the indexer (``linear_wq_b``, ``linear_wk``, ``k_norm``, ``linear_weights_proj``, the
  Hadamard ``rotate_activation``) on the detached layer input, as Megatron; its keys are
  computed by the rank that owns the token and moved with the latents; scores by Megatron's
  ``_compute_index_scores`` (ReLU as ``dsa_indexer_scoring_relu`` says);
* top-k as Megatron's ``torch.topk`` picks it on one process (its row is the whole sequence,
  or the whole packed stream: ``packed_topk_row="stream"``);
* attention on the gathered latents (Note [DSA attention on the latents] in
  :mod:`hp_cp_torch.latent_attention`: the absorbed form Megatron's ``AbsorbedMLA`` computes),
  or with ``attention_kernel="megatron"`` Megatron's own sparse attention on them (Note
  [Megatron's kernel on hp_cp's prefix] in :mod:`.megatron_kernel`), then ``linear_proj``;
* the indexer loss (Note [The Megatron indexer loss under hp_cp]).

Not supported under CP (an :class:`~hp_cp_core.HpCpError` on every rank, before any
exchange): tensor parallelism (``tensor_model_parallel_size > 1``), a Megatron CP group that
is not hp_cp's group, an ``attention_mask`` (hp_cp's causal masks are the plan's), packed
batches with Megatron's per-document padding (``cu_seqlens_q_padded``) or a
``real_token_mask_q``, inference contexts.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hp_cp_core import CPHandle, HpCpError, LayerSpec
from hp_cp_core.api import cp_state_not_copyable
from hp_cp_torch.integrations.megatron_kernel import megatron_sparse_attention
from hp_cp_torch.kernels.request import AttentionRequest
from hp_cp_torch.model_adapter import (
    AttentionParams,
    ForwardState,
    IndexerParams,
    Latent,
    LayerInputs,
    ModelAdapter,
    PlanView,
    Projection,
    Traits,
)
from hp_cp_torch.validation import TensorChecks

__all__ = [
    "MegatronDSAAttentionAdapter",
    "megatron_labels",
    "megatron_loss",
    "packed_seq_params",
]

ABSORBED_MLA = "megatron.core.transformer.experimental_attention_variant.absorbed_mla"
DSA = "megatron.core.transformer.experimental_attention_variant.dsa"
DSA_MASKING = "megatron.core.transformer.experimental_attention_variant.dsa_masking"
DSA_LOSS = "megatron.core.transformer.experimental_attention_variant.dsa_indexer_loss"
ROPE_UTILS = "megatron.core.models.common.embeddings.rope_utils"
GPT_MODEL = "megatron.core.models.gpt.gpt_model"
POSITIONS_ATTR = "_hp_cp_model_positions"
"""Where each layer finds the :class:`_ModelPositions` of its handle (Megatron hands the layers
no positions: they are kept per forward, Note [Model values per forward] in
:mod:`hp_cp_torch.runner`)."""

POSITIONS_HINT = (
    "got position_ids that are not hp_cp's positions of this rank's rows (the global row, or "
    "the position within the document when packed): a batch sharded by Megatron's "
    "get_batch_on_this_cp_rank (its zigzag) or not sharded. Under hp_cp build the batch with "
    "handle.batch(tokens, cu_seqlens=...) and pass its input_ids and position_ids."
)

# Note [Megatron's CP group under hp_cp]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Two mappings were possible: Megatron at context_parallel_size 1 with hp_cp's group beside it,
# or Megatron's own CP group and size reused as hp_cp's group. hp_cp takes the second:
#
# * Megatron's data loading gives every rank of a CP group the same micro-batch only when it
#   knows they are CP ranks; at context_parallel_size 1 they would be data-parallel ranks and
#   read different batches.
# * DDP reduces gradients over data x context parallel ranks scaled by 1 / (dp x cp), and the
#   schedule scales the indexer loss by cp (``forward_step_calc_loss``, schedules.py:386-392).
#   hp_cp's indexer loss on each rank is its rows' KL sum over the rows of ALL ranks (a share
#   of the global mean, not a local mean), so cp x (1 / cp) applies exactly the one-process
#   gradient. At context_parallel_size 1 the same shares would be averaged over the CP ranks
#   as data-parallel ranks: the indexer gradient 1 / cp of the one-process one.
# * Megatron's own CP code in the attention (the all-gather of keys, values and indexer keys,
#   the zigzag RoPE slice, the per-rank indexer loss) lives in the layer hp_cp replaces; the
#   batch is sharded by handle.batch in place of get_batch_on_this_cp_rank.
#
# With calculate_per_token_loss the loss function returns this rank's token count and
# finalize_model_grads sums it over dp x cp; without it the schedule divides each rank's loss
# by the count the loss function returns, so megatron_loss returns sum x cp / (the batch's
# count) and a count of 1: the global mean after DDP's average, whatever each rank's count.

# Note [Megatron's RoPE is position-blind]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Megatron's MLA and indexer compute their rotary table for positions 0 .. S-1 of the local
# rows (RotaryEmbedding.forward) and, at context_parallel_size > 1, cut it with their own
# zigzag (get_pos_emb_on_this_cp_rank); position_ids never reach the layers. Under hp_cp a
# rank's rows are any of the layout's, so the adapter reads the layer's own table
# (RotaryEmbedding.get_emb / YarnRotaryEmbedding.get_emb, before any CP cut) at hp_cp's
# positions of the local rows: row p of the table is the same numbers whatever its length, so
# each row is roped exactly as on one process (packed: per document, as Megatron's thd RoPE).

# Note [The Megatron indexer loss under hp_cp]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Megatron's KL (compute_dsa_indexer_loss): per query row, the teacher is the absorbed
# attention's softmax per head (query and latents detached), summed over heads and
# L1-normalised; the student the log-softmax of the indexer scores; over every visible key
# (dense, the default) or only the top-k picks (dsa_indexer_use_sparse_loss). Under hp_cp each
# local query's visible keys are in the gathered latents and indexer keys (the causal prefix),
# so the adapter's indexer_row_kl computes its rows' KL with Megatron's own masked_softmax /
# masked_log_softmax / normalize_indexer_target / indexer_kl_per_row, and hp_cp's runner
# chunks the rows, sums the real ones and divides by the rows of ALL ranks (batch x real rows),
# or not at all with calculate_per_token_loss (IndexerParams.loss_mean=False: Megatron's sum).
# The loss, times dsa_indexer_loss_coeff, is attached with Megatron's own
# DSAIndexerLossAutoScaler (IndexerParams.loss_attach), so the schedule's loss scale applies as
# on one process, and each rank's share goes to Megatron's DSAIndexerLossLoggingHelper with
# the CP group as its reduce group (a sum: the global value, as one process logs it).
# Gradients reach the indexer's queries and weights locally and its keys through the
# exchange's backward, at the rank that computed them.


def _module(name: str) -> Any:
    return importlib.import_module(name)


class _ModelPositions:
    """The ``position_ids`` the running ``GPTModel`` forward was given (``None`` outside one);
    hp_cp keeps each forward's (``traits.per_forward``)."""

    def __init__(self) -> None:
        self.latest: Any = None

    def hook(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        """The ``GPTModel`` forward pre-hook: its ``position_ids`` (``None`` when not given:
        Megatron's RoPE needs none, hp_cp's plan has them)."""
        pos = kwargs["position_ids"] if "position_ids" in kwargs else (args[1:2] or (None,))[0]
        self.latest = pos

    def done(self, *_: Any) -> None:
        """The ``GPTModel`` forward hook (always called): a layer run outside the model's
        forward takes no model's positions (hp_cp's plan has them)."""
        self.latest = None

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused, as the installed forward is: it belongs to the CP handle's forwards."""
        raise cp_state_not_copyable("AbsorbedMLASelfAttention")


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


def packed_seq_params(batch: Any) -> Any:
    """Megatron's ``PackedSeqParams`` (``qkv_format="thd"``) of a packed ``handle.batch``: the
    global boundaries of the padded stream, or ``None`` for a padded (unpacked) batch."""
    cu = getattr(batch, "cu_seqlens", None)
    if cu is None:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.as_tensor(cu, dtype=torch.int32, device=batch.input_ids.device)
    longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def megatron_labels(batch: Any, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels, loss_mask)`` for Megatron's ``GPTModel(..., labels=labels)`` from a
    ``handle.batch``: its shifted labels with ``ignore_index`` (padding, document ends) set to
    0 and masked out, as Megatron's cross entropy takes only vocabulary ids."""
    labels = batch.labels
    mask = labels != ignore_index
    return torch.where(mask, labels, torch.zeros_like(labels)), mask.to(torch.float32)


def megatron_loss(
    losses: torch.Tensor, loss_mask: torch.Tensor, batch: Any, cp_size: int, per_token: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, num_tokens)``, the first two values a Megatron ``loss_func`` returns under
    hp_cp (Note [Megatron's CP group under hp_cp]), from ``GPTModel``'s per-token losses and
    :func:`megatron_labels`' mask. With ``calculate_per_token_loss``: this rank's loss sum and
    target count (Megatron sums the counts over data x context parallel ranks). Without it:
    the sum times ``cp_size`` over the batch's targets (``batch.n_tokens``, all ranks) and a
    count of 1, so that DDP's average over the CP ranks gives the global mean whatever each
    rank's own count (Megatron's per-rank mean is exact only for equal counts)."""
    mask = loss_mask.reshape(-1).to(torch.float32)
    total = torch.sum(losses.reshape(-1).float() * mask)
    if per_token:
        return total, mask.sum().to(torch.int)
    n_tokens = torch.as_tensor(batch.n_tokens, device=total.device).to(torch.float32)
    one = torch.ones((), dtype=torch.int, device=total.device)
    return total * (cp_size / n_tokens.clamp(min=1)), one


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
        model_group="pg_collection.cp",  # Note [Megatron's CP group under hp_cp]
        rows_are_slots=True,  # the indexer's input detached: its loss only, as Megatron
    )

    @property
    def _indexer(self) -> Any:
        """The layer's ``DSAIndexer``, or ``None`` on a layer IndexShare skips."""
        return getattr(self.module.core_attention, "indexer", None)

    @classmethod
    def prepare_model(cls, model: nn.Module, layers: list[nn.Module], handle: CPHandle) -> None:
        """Refuse tensor parallelism before any exchange; a forward pre-hook on each
        ``GPTModel`` hands the layers its ``position_ids`` (hp_cp keeps them per forward:
        ``traits.per_forward``), so that a batch Megatron sharded is refused, not silently
        roped at the wrong rows. (hp_cp refuses a Megatron CP group that is not its own:
        ``traits.model_group``.)"""
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
        positions = _ModelPositions()
        gpt = getattr(sys.modules.get(GPT_MODEL), "GPTModel", None)
        for mod in model.modules():
            if gpt is not None and isinstance(mod, gpt):
                handle.on_disable(
                    mod.register_forward_pre_hook(positions.hook, with_kwargs=True).remove
                )
                handle.on_disable(
                    mod.register_forward_hook(positions.done, always_call=True).remove
                )
        for layer in layers:
            layer.__dict__[POSITIONS_ATTR] = positions
        handle.on_disable(lambda: [layer.__dict__.pop(POSITIONS_ATTR, None) for layer in layers])

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
        key_value_states: Any = None,
        inference_context: Any = None,
        rotary_pos_emb: Any = None,
        rotary_pos_cos: Any = None,
        rotary_pos_sin: Any = None,
        rotary_pos_cos_sin: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
        position_ids: Any = None,
        sequence_len_offset: Any = None,
        *,
        inference_params: Any = None,
    ) -> MegatronCallInputs:
        given = {
            "key_value_states": key_value_states,
            "inference_context": inference_context,
            "inference_params": inference_params,
            "rotary_pos_emb": rotary_pos_emb,
            "rotary_pos_cos": rotary_pos_cos,
            "rotary_pos_sin": rotary_pos_sin,
            "rotary_pos_cos_sin": rotary_pos_cos_sin,
            "attention_bias": attention_bias,
            "sequence_len_offset": sequence_len_offset,
        }
        cu = None
        if packed_seq_params is not None:
            cu = getattr(packed_seq_params, "cu_seqlens_q", None)
        positions = self.module.__dict__.get(POSITIONS_ATTR)
        return MegatronCallInputs(
            hidden_states,
            None if positions is None else positions.latest,  # the model's, kept per forward
            cu,
            attention_mask=attention_mask,
            packed_seq_params=packed_seq_params,
            unsupported=tuple(k for k, v in given.items() if v is not None and v is not False),
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
            self._check_packed(psp, checks)
        if self.module.attn_mask_type.name != "causal":
            checks.fail(f"attn_mask_type={self.module.attn_mask_type.name}; CP runs causal DSA.")

    def _check_packed(self, psp: Any, checks: TensorChecks) -> None:
        fix = (
            "pass packed_seq_params(batch) of handle.batch(tokens, cu_seqlens=cu): the global "
            "boundaries of the stream, padded at its end by hp_cp."
        )
        if psp.qkv_format != "thd":
            checks.fail(f"got packed_seq_params with qkv_format={psp.qkv_format!r}; {fix}")
        pairs = (
            ("cu_seqlens_kv", psp.cu_seqlens_kv),
            ("cu_seqlens_q_padded", psp.cu_seqlens_q_padded),
            ("cu_seqlens_kv_padded", psp.cu_seqlens_kv_padded),
        )
        for name, other in pairs:
            if other is not None and not torch.equal(
                torch.as_tensor(other).cpu().long(), torch.as_tensor(psp.cu_seqlens_q).cpu().long()
            ):
                checks.fail(f"packed_seq_params.{name} differs from cu_seqlens_q; {fix}")
        if getattr(psp, "real_token_mask_q", None) is not None:
            checks.fail(f"packed_seq_params carries real_token_mask_q; {fix}")
        if getattr(psp, "local_cp_size", None) is not None:
            checks.fail(f"packed_seq_params.local_cp_size is set (dynamic CP); {fix}")

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
        return megatron_sparse_attention(self.module, request)

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

"""NeMo Automodel's GLM-5 (``nemo_automodel.components.models.glm_moe_dsa``) under CP.

``hp_cp_core.enable_cp(model, mesh)`` on a NeMo
``GlmMoeDsaForCausalLM`` / ``GlmMoeDsaModel`` (or one ``GlmMoeDsaMLA``) replaces the forward
of every ``GlmMoeDsaMLA``; MoE, norms and the head are token-local and run unchanged on each
rank's rows. Each rank then, as for NeMo's DeepSeek V4::

    batch = cp_nemo_batch(handle, input_ids)          # any S; padded, shifted, sharded
    labels, n_tokens = batch.pop("labels"), batch.pop("n_tokens")
    out = model(**batch)
    loss = cp_causal_lm_loss(out.logits, labels, n_tokens)

The layer is DSA, the core's ``LayerSpec(compress_ratio=1, window_size=0, has_indexer=True)``,
exactly as transformers' GLM-5 (:mod:`hp_cp_torch.integrations.transformers_dsa`, whose
adapter this one subclasses); only NeMo's ops differ: the complex ``freqs_cis`` RoPE
(interleaved on the MLA, half-split or interleaved on the indexer as
``indexer_rope_interleave`` says), the indexer's flattened score GEMM, the attention's
``softmax_scale``. A ``"shared"`` layer (``config.indexer_types``) reuses the previous full
layer's selection through the core's sharing plan: no indexer, no index keys moved. The
forward returns ``(output, selection)`` as NeMo's block expects, the selection as global token
ids ``[B, L, topk]`` (``-1``: none); the ``prev_topk_indices`` NeMo threads in are not read.

The layers read positions only through the ``freqs_cis`` the model computes from
``position_ids``; a forward pre-hook on each ``GlmMoeDsaModel`` hands the layers those
``position_ids`` (as ``hp_cp_position_ids``) so that missing or unsharded positions are one
:class:`~hp_cp_core.HpCpError` on every rank, not a silently wrong RoPE.

Packed documents (``cp_nemo_batch(..., seq_lens=...)``, batch 1) are each scored and attended
alone, as NeMo's TileLang / cuDNN DSA kernels do with ``cu_seqlens`` on a GPU; NeMo's CPU
dense path has no document mask in its indexer, so the tests compare with each document run
alone on one process. Not supported under CP (an :class:`~hp_cp_core.HpCpError` on every
rank, before any exchange): NeMo's ``qkv_format="thd"`` batches, NeMo's own GLM DSA CP
(``_glm_dsa_cp_group``), an ``attention_mask`` that hides tokens, and NeMo's DeepSeek V3.2
``DeepseekV32MLA`` (see :data:`V32_NOT_CAUSAL`).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hp_cp_torch._removed import ADAPTER_FOR, ENABLE, removed_names
from hp_cp_torch.integrations.transformers import (
    ModelCallInputs,
    call_problems,
    call_value_checks,
)
from hp_cp_torch.integrations.transformers_dsa import (
    DSAAttentionAdapter,
    dense_latent_attention,
    latent_params,
)
from hp_cp_torch.kernels.request import AttentionRequest
from hp_cp_torch.model.spec import (
    AttentionParams,
    ForwardState,
    ModelHandle,
    PlanView,
    Projection,
    refuse,
)
from hp_cp_torch.model.validation import TensorChecks

__all__ = [
    "V32_NOT_CAUSAL",
    "NemoGlmDsaAttentionAdapter",
]

__getattr__ = removed_names(
    __name__,
    enable_cp_dsa=ENABLE,
    nemo_dsa_adapter_for=ADAPTER_FOR,
    is_dsa_model=ADAPTER_FOR,
)

GLM_LAYERS = "nemo_automodel.components.models.glm_moe_dsa.layers"
GLM_MODEL = "nemo_automodel.components.models.glm_moe_dsa.model"
V32_LAYERS = "nemo_automodel.components.models.deepseek_v32.layers"
NEMO_DSA_CP_KWARG = "_glm_dsa_cp_group"
POSITIONS_KWARG = "hp_cp_position_ids"

V32_NOT_CAUSAL = (
    "NeMo Automodel 0.7.0's DeepSeek V3.2 (DeepseekV32MLA) cannot run under hp_cp: its "
    "indexer scores every token of the row, later ones included (no causal mask before its "
    "top-k), so on one process its dense SDPA path lets a token attend to later tokens and "
    "its TE path spends top-k picks on tokens the causal mask then drops. No context "
    "parallelism can equal that one-process run. Train DeepSeek V3.2 with transformers' "
    "DeepseekV32ForCausalLM (hp_cp_torch.integrations.transformers_dsa), whose indexer is "
    "causal, or NeMo's GlmMoeDsaForCausalLM."
)
"""Why NeMo's ``DeepseekV32MLA`` is refused (raised by the plugin's discovery, so by
``hp_cp_core.enable_cp``)."""


NemoDeepseekV32Refusal = refuse(V32_NOT_CAUSAL)
"""Registered for NeMo's ``DeepseekV32MLA``: refuses it (:data:`V32_NOT_CAUSAL`)."""


NO_ROPE_HINT = (
    "needs the freqs_cis the model computes from position_ids; call the model "
    "(GlmMoeDsaForCausalLM / GlmMoeDsaModel under enable_cp), not the layer."
)
MASK_HINT = (
    "got an attention mask that hides tokens (padding, or a custom mask); under CP pass "
    "no attention_mask: cp_nemo_batch pads at the end, where no real token sees the padding."
)
POSITIONS_HINT = (
    "got position_ids that are not the global row numbers of this rank's rows (packed: "
    "restarting per document); pass position_ids=batch['position_ids'] from "
    "cp_nemo_batch(handle, input_ids)."
)


class NemoGlmDsaAttentionAdapter(DSAAttentionAdapter):
    """Hooks for NeMo's ``GlmMoeDsaMLA`` (batch-major ``[B, S, hidden]``): transformers'
    GLM-5 with NeMo's ops (complex RoPE, the flattened score GEMM, ``softmax_scale``)."""

    traits = dataclasses.replace(
        DSAAttentionAdapter.traits,
        # packed, each document is scored alone, as NeMo's TileLang / cuDNN DSA kernels do
        # with cu_seqlens (its CPU dense path has no document mask: not what packing means)
        packed_topk_row="document",
    )

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module, GLM_LAYERS)
        self.glm = True

    @classmethod
    def prepare_model(cls, model: nn.Module, layers: list[nn.Module], handle: ModelHandle) -> None:
        """A forward pre-hook on each ``GlmMoeDsaModel`` in ``model`` hands its layers the
        ``position_ids`` (whichever ``enable_cp`` was called); ``disable_cp`` removes it."""
        model_cls = getattr(sys.modules.get(GLM_MODEL), "GlmMoeDsaModel", None)
        for mod in model.modules():
            if model_cls is not None and isinstance(mod, model_cls):
                hook = mod.register_forward_pre_hook(_pass_positions, with_kwargs=True)
                handle.on_disable(hook.remove)

    def attention_params(self) -> AttentionParams:
        return latent_params(self.module, float(self.module.softmax_scale))

    def layer_name(self) -> str:
        return type(self.module).__name__ + (" (shared)" if self._shared else "")

    def _rope(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        """NeMo's interleaved complex RoPE (``apply_rotary_emb``, bshd)."""
        return self._mod().apply_rotary_emb(x, freqs_cis, qkv_format="bshd")

    def _nemo_indexer_qk(
        self, hidden_states: torch.Tensor, q_resid: torch.Tensor, freqs_cis: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's roped queries ``[B, L, H_I, D_I]`` and keys ``[B, L, D_I]``, NeMo's
        ops (rope slice first), without autograd (its top-k feeds integer ids only)."""
        ix = self.module.indexer
        with torch.no_grad():
            batch, length, _ = hidden_states.shape
            q = ix.wq_b(q_resid).view(batch, length, ix.num_heads, ix.head_dim)
            split = [ix.qk_rope_head_dim, ix.qk_nope_head_dim]
            q_pe, q_nope = torch.split(q, split, dim=-1)
            k_pe, k_nope = torch.split(ix.k_norm(ix.wk(hidden_states)), split, dim=-1)
            if ix.rope_interleave:
                q_pe = self._rope(q_pe, freqs_cis)
                k_pe = self._rope(k_pe.unsqueeze(-2), freqs_cis).squeeze(-2)
            else:
                half_split = self._mod()._apply_index_rope_half_split
                q_pe = half_split(q_pe, freqs_cis, "bshd")
                k_pe = half_split(k_pe, freqs_cis, "bshd")
        return torch.cat([q_pe, q_nope], dim=-1), torch.cat([k_pe, k_nope], dim=-1)

    def index_scores(self, state: ForwardState, lo: int, hi: int, keys: torch.Tensor) -> Any:
        """NeMo's dense indexer scores: one GEMM over (query, head) rows, ``softmax_scale``
        then ReLU in place, the per-head weights as a matmul."""
        (q, weights), ix = state.index_queries, self.module.indexer
        s = torch.matmul(q[:, lo:hi].float().flatten(-3, -2), keys.float().transpose(-1, -2))
        s = s.unflatten(-2, (hi - lo, ix.num_heads)).mul_(ix.softmax_scale).relu_()
        return torch.matmul(weights[:, lo:hi].unsqueeze(-2), s).squeeze(-2)

    def attention(self, request: AttentionRequest, state: ForwardState) -> torch.Tensor:
        """NeMo's dense path: ``kv_b_proj`` of every latent, ``k = [k_nope ; k_pe]``
        (:func:`~hp_cp_torch.integrations.transformers_dsa.dense_latent_attention`)."""
        m, latent = self.module, request.cmp_kv
        batch, n_slots = latent.shape[:2]
        kv, k_pe = torch.split(latent, [m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = m.kv_b_proj(kv).view(batch, n_slots, m.n_heads, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = torch.split(kv, [m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k_pe = k_pe.unsqueeze(2).expand(batch, n_slots, m.n_heads, m.qk_rope_head_dim)
        keys = torch.cat([k_nope, k_pe], dim=-1).transpose(1, 2)
        return dense_latent_attention(request, keys, v.transpose(1, 2), float(m.softmax_scale))

    def check_inputs(self, inputs: NemoDSACallInputs, checks: TensorChecks) -> None:
        """transformers' checks with NeMo's words, and what hp_cp cannot take from NeMo's
        call."""
        hidden_states, freqs_cis = inputs.hidden, inputs.position_embeddings
        attention_mask, kwargs = inputs.attention_mask, inputs.kwargs
        width = int(self.module.q_a_proj.in_features)
        checks.hidden_states(hidden_states, width, inputs.cu_seqlens is not None)
        problems = call_problems(inputs, self.module.training, 0.0, NO_ROPE_HINT)  # no dropout
        if kwargs.get(NEMO_DSA_CP_KWARG) is not None:
            problems.append(
                "NeMo Automodel's own GLM DSA CP is switched on as well (the batch carries "
                f"{NEMO_DSA_CP_KWARG!r} from shard_glm_dsa_packed_cp_batch); hp_cp owns the "
                "attention layers, so switch NeMo's CP off and shard the batch with "
                "cp_nemo_batch(handle, ...) instead."
            )
        thd = isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 2
        if kwargs.get("qkv_format") == "thd" or thd:
            problems.append(
                "got NeMo's thd layout (qkv_format='thd'); under hp_cp pass the batch of "
                "cp_nemo_batch(handle, input_ids, seq_lens=...): [1, L] rows with the documents "
                "as cu_seqlens."
            )
        if POSITIONS_KWARG not in kwargs:
            if freqs_cis is not None:  # (no freqs_cis at all fails with the same words)
                problems.append(NO_ROPE_HINT)
        elif kwargs[POSITIONS_KWARG] is None:
            problems.append(
                "the model was called without position_ids, so NeMo's RoPE would count this "
                "rank's rows from 0; pass position_ids=batch['position_ids'] from "
                "cp_nemo_batch(handle, input_ids)."
            )
        length = hidden_states.shape[-2] if isinstance(hidden_states, torch.Tensor) else None
        if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] != length:
            problems.append(
                f"got an attention_mask of {attention_mask.shape[-1]} columns for {length} local "
                "rows; under CP pass no attention_mask (cp_nemo_batch pads at the end, where no "
                "real token sees the padding)."
            )
        for problem in problems:
            checks.fail(problem)

    def value_checks(self, inputs: NemoDSACallInputs, plan: PlanView) -> list[tuple[Any, str]]:
        return call_value_checks(inputs, plan, MASK_HINT, POSITIONS_HINT)

    def read_inputs(
        self,
        x: Any,
        freqs_cis: Any = None,
        attention_mask: Any = None,
        prev_topk_indices: Any = None,
        return_topk_indices: bool = False,
        **kwargs: Any,
    ) -> NemoDSACallInputs:
        return NemoDSACallInputs(
            x,
            kwargs.get(POSITIONS_KWARG),
            kwargs.get("cu_seqlens"),
            position_embeddings=freqs_cis,
            attention_mask=attention_mask,
            kwargs=kwargs,
            return_topk_indices=return_topk_indices,
        )

    def project(self, state: ForwardState) -> Projection:
        """NeMo's MLA projections (its complex RoPE on the rope slices) and indexer."""
        m, x, freqs_cis = self.module, state.hidden, state.inputs.position_embeddings
        batch, length = x.shape[:-1]
        q_resid = m.q_a_layernorm(m.q_a_proj(x))
        q = m.q_b_proj(q_resid).view(batch, length, m.n_heads, m.qk_head_dim)
        q_nope, q_pe = torch.split(q, [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        kv, k_pe = torch.split(m.kv_a_proj_with_mqa(x), [m.kv_lora_rank, m.qk_rope_head_dim], -1)
        q_pe = self._rope(q_pe, freqs_cis)
        k_pe = self._rope(k_pe.unsqueeze(2), freqs_cis).squeeze(2)
        query = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)  # [B, H, L, D]
        index_k = None
        if not self._shared:
            ix = self.module.indexer
            index_q, index_k = self._nemo_indexer_qk(x, q_resid, freqs_cis)
            with torch.no_grad():  # the per-head weights [B, L, H_I]
                weights = ix.weights_proj(x).float() * (ix.num_heads**-0.5)
                state.index_queries = (index_q, weights)
        latents = torch.cat([m.kv_a_layernorm(kv), k_pe], dim=-1)
        return Projection(query.transpose(1, 2), latents, index_keys=index_k)

    def finish(self, out: torch.Tensor, state: ForwardState) -> Any:
        return (out, state.selected) if state.inputs.return_topk_indices else out


@dataclass
class NemoDSACallInputs(ModelCallInputs):
    """NeMo's ``GlmMoeDsaMLA`` call: HF's fields (``freqs_cis`` as the RoPE tables) and
    whether it returns its top-k."""

    return_topk_indices: bool = False


def _pass_positions(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
    """Forward pre-hook of a ``GlmMoeDsaModel``: its layers get the ``position_ids`` too."""
    return args, {**kwargs, POSITIONS_KWARG: kwargs.get("position_ids")}

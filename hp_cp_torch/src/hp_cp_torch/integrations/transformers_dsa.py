"""Hugging Face transformers' DSA models under CP: ``DeepseekV32ForCausalLM`` (DeepSeek V3.2)
and ``GlmMoeDsaForCausalLM`` (GLM-5), transformers 5.23.

``enable_cp(model, mesh)`` replaces the forward of every ``DeepseekV32Attention`` /
``GlmMoeDsaAttention``; the rest of the model (MoE, norms, head) is token-local. Each rank::

    handle = enable_cp(model, cp_group, CPConfig(layout="load_balanced"))
    batch = handle.batch(input_ids)  # shifted labels, padding, shards, positions
    out = model(**batch.model_inputs(), use_cache=False)
    cp_causal_lm_loss(out.logits, batch.labels, batch.n_tokens).backward()

DSA is the core's ``LayerSpec(compress_ratio=1, window_size=0, has_indexer=True)`` (Note [The
sparse-attention family] in :mod:`hp_cp_core.sharing`): every token is its own slot, the
slot of token j is its MLA latent ``[kv_a_layernorm(kv) (kv_lora_rank) ; roped k_rot
(qk_rope_head_dim)]`` and its indexer key ``[roped k_rot ; k_pass] (index_head_dim)``; query t
picks its ``index_topk`` among tokens ``0 .. t`` of its document (itself included). So one
point-to-point exchange per layer moves, to each rank, the latents and index keys of the
earlier tokens its queries can see (the causal prefix), nothing else; no halo exchange.
A GLM-5 ``"shared"`` layer (``config.indexer_types``) reuses the previous ``"full"`` layer's
selection through the core's sharing plan (``LayerSpec.reuses=("selection",)``): it moves
only its own latents, no index keys, and runs no indexer.

The stages are HF's ops on the module's own parameters:

* MLA: ``q_a_proj, q_a_layernorm, q_b_proj``, ``kv_a_proj_with_mqa, kv_a_layernorm``,
  interleaved RoPE on ``q_rot`` / ``k_rot``; attention runs on the gathered latents with
  ``kv_b_proj`` folded into the queries and the output (Note [DSA attention on the latents] in
  :mod:`hp_cp_torch.kernels.latent_attention`), or, with ``attention_kernel="model_ops"``, in
  transformers' op order (``expand_kv`` of every gathered token, dense rows);
* the indexer (``wq_b, wk, k_norm, weights_proj, softmax_scale, index_topk``) under
  ``torch.no_grad`` as in HF (its top-k feeds only integer ids: no gradient, no indexer
  loss in transformers): RoPE half-split for V3.2, interleaved for GLM-5; scores
  ``relu(q . k) * softmax_scale`` weighted per head, exactly HF's op sequence;
* top-k as transformers picks it on one process, exact ties included (Note [The one-process
  top-k row] in :mod:`hp_cp_core.columns`): HF calls ``torch.topk`` on each query's row of
  every token of the sequence, the invisible ones masked; which of several equal scores it
  keeps depends on that whole row (ReLU scores tie at 0 for every token no head likes). So
  each query's scores are placed in the row one process scores and go through the same
  ``torch.topk``: padded, the real tokens (not the padding ``handle.batch`` appends); packed,
  one row for the whole packed stream (HF's one-process packed mask is block-diagonal over
  one row: ``one_process_row="stream"``);
* attention: each query's logits over the tokens it selected, ``scaling``, softmax in fp32
  (HF's dense row with the unselected at ``finfo.min`` gives them exactly 0), then ``o_proj``.

Packed documents (batch 1): pass ``hp_cp_cu_seqlens=`` (``handle.batch(...,
cu_seqlens=...).model_inputs()`` does) with positions restarting per document, as HF's one-process
packing detects them from ``position_ids``. Not supported under CP (an
:class:`~hp_cp_core.HpCpError` on every rank, before any exchange): a KV cache, attention
masks that hide tokens (padding; use ``handle.batch``'s trailing padding), attention
dropout in training.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hp_cp_core import LayerSpec
from hp_cp_core.batch import CU_SEQLENS_KWARG
from hp_cp_core.columns import PlanColumns
from hp_cp_torch._removed import REGISTRY, deprecated, removed_names
from hp_cp_torch.integrations.transformers import (
    ModelCallInputs,
    TransformersAttention,
    cp_causal_lm_loss,
    cp_shift_labels,
    cp_sum_gradients,
)
from hp_cp_torch.kernels.request import AttentionRequest
from hp_cp_torch.model.registry import registered_adapter
from hp_cp_torch.model.spec import (
    AttentionParams,
    ForwardState,
    IndexerParams,
    Latent,
    Projection,
    Traits,
)

__all__ = [
    "DSAAttentionAdapter",
    "cp_causal_lm_loss",
    "cp_shift_labels",
    "cp_sum_gradients",
    "dsa_adapter_for",
]

__getattr__ = removed_names(__name__, cp_dsa_batch="handle.batch(input_ids, cu_seqlens=cu)")

MODELINGS = {
    "DeepseekV32Attention": "transformers.models.deepseek_v32.modeling_deepseek_v32",
    "GlmMoeDsaAttention": "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa",
}
"""The attention class of each DSA model and its modeling file."""


def dsa_adapter_for(module: Any) -> Any:
    """The adapter for a transformers DSA attention layer (V3.2 or GLM-5), else ``None``
    (never imports a modeling file).

    .. deprecated:: 0.5.0
        Removed in 0.6.0: use ``hp_cp_torch.adapter.adapter_for(module)``, which reads the
        ``hp_cp.torch_models`` entry points (``register_model_adapter`` for a class of your
        own).
    """
    deprecated(f"{__name__}.dsa_adapter_for", REGISTRY)
    return registered_adapter(module, DSAAttentionAdapter)


def latent_params(m: nn.Module, scale: float) -> AttentionParams:
    """The attention of an MLA layer ``m``: on its latents, no sink."""
    dims = Latent(
        m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank, m.kv_b_proj.weight
    )
    return AttentionParams(scale, kind="latent", latent=dims)


def dense_latent_attention(
    request: AttentionRequest, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """transformers' op order (``attention_kernel="model_ops"``) on the expanded latents
    ``keys [B, H, N, qk_head_dim]`` / ``values [B, H, N, v_head_dim]``: each query chunk's
    dense row over the tokens up to its last visible one, the unselected at ``finfo.min``. The
    closest to transformers' rounding (Note [DSA attention on the latents]); keeps the
    expanded keys and each chunk's weights for backward, ``O(S * S / cp)`` a rank. Returns
    ``[B, L, H, v_head_dim]``."""
    q, plan = request.q.transpose(1, 2), request.plan  # [B, H, L, D]
    selected = request.selected.to(q.device)
    batch = keys.shape[0]
    stop = plan.cmp_start + plan.cmp_count
    neg = torch.finfo(q.dtype).min
    outs = []
    for lo, hi in PlanColumns(plan, 0).chunks(request.query_chunk):
        s1 = max(int(stop[lo:hi].max()) if hi > lo else 0, 1)
        sel = selected[:, lo:hi]  # [B, l, k]
        keep = torch.zeros((batch, hi - lo, s1 + 1), dtype=torch.bool, device=q.device)
        keep.scatter_(-1, torch.where(sel >= 0, sel, s1).long(), True)
        bias = torch.where(keep[..., :s1], 0.0, neg).to(q.dtype).unsqueeze(1)  # [B,1,l,n]
        k_c, v_c = keys[:, :, :s1], values[:, :, :s1]
        w = torch.matmul(q[:, :, lo:hi], k_c.transpose(2, 3)) * scale + bias
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        outs.append(torch.matmul(w, v_c))  # [B, H, l, v]
    return torch.cat(outs, dim=2).transpose(1, 2)


class DSAAttentionAdapter(TransformersAttention):
    """The model adapter of ``DeepseekV32Attention`` / ``GlmMoeDsaAttention`` (batch-major):
    MLA's projections, the indexer, attention on the latents. The projection's rows are the
    slots (ratio 1): each token's latent and its indexer key."""

    traits = Traits(
        packed_topk_row="stream",  # HF's packed mask: block-diagonal over one stream row
        rows_are_slots=True,
    )

    def __init__(self, module: nn.Module, modeling: str | None = None) -> None:
        super().__init__(module)
        if modeling is None:  # the modeling file of the claimed class (the registry's match)
            found = (MODELINGS.get(c.__name__) for c in type(module).__mro__)
            modeling = next((m for m in found if m is not None), type(module).__module__)
        self.modeling = modeling
        self.glm = modeling.endswith("glm_moe_dsa")

    def _mod(self) -> Any:
        return importlib.import_module(self.modeling)

    @property
    def _shared(self) -> bool:
        """A GLM-5 ``"shared"`` layer: no indexer of its own, the previous full layer's picks."""
        return self.module.indexer is None

    def layer_spec(self) -> LayerSpec:
        return LayerSpec(
            compress_ratio=1,
            window_size=0,
            has_indexer=True,
            force_unfused=True,
            reuses=("selection",) if self._shared else (),
        )

    def read_inputs(
        self,
        hidden_states: Any,
        position_embeddings: Any = None,
        attention_mask: Any = None,
        past_key_values: Any = None,
        position_ids: Any = None,
        prev_topk_indices: Any = None,
        **kwargs: Any,
    ) -> ModelCallInputs:
        return ModelCallInputs(
            hidden_states,
            position_ids,
            kwargs.get(CU_SEQLENS_KWARG),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            kwargs=kwargs,
        )

    def project(self, state: ForwardState) -> Projection:
        """HF's MLA projections: the queries, the latents (the owned slots) and, on a layer
        with its own indexer, the indexer's queries and keys."""
        m, x = self.module, state.hidden
        batch, length = x.shape[:-1]
        cos, sin = state.inputs.position_embeddings
        q_resid = m.q_a_layernorm(m.q_a_proj(x))
        q_states = m.q_b_proj(q_resid).view(batch, length, -1, m.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q_states, [m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        kv_pass, k_rot = torch.split(
            m.kv_a_proj_with_mqa(x), [m.kv_lora_rank, m.qk_rope_head_dim], -1
        )
        k_rot = k_rot.view(batch, 1, length, m.qk_rope_head_dim)
        q_rot, k_rot = self._mod().apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
        query = torch.cat((q_pass, q_rot), dim=-1)  # [B, H, L, qk_head_dim]
        latents = torch.cat([m.kv_a_layernorm(kv_pass), k_rot[:, 0]], dim=-1)
        index_k = None
        if not self._shared:
            index_q, index_k = self._indexer_qk(x, q_resid, cos, sin)
            with torch.no_grad():
                state.index_queries = (index_q, self._index_weights(x))
        return Projection(query.transpose(1, 2), latents, index_keys=index_k)

    def _indexer_qk(
        self, hidden_states: torch.Tensor, q_resid: torch.Tensor, cos: Any, sin: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's roped queries ``[B, L, H_I, D_I]`` and keys ``[B, L, D_I]``, HF's
        ops, without autograd (HF's ``@torch.no_grad`` indexer)."""
        ix = self.module.indexer
        mod = self._mod()
        rope = mod.apply_rotary_pos_emb_interleave if self.glm else mod.apply_rotary_pos_emb
        with torch.no_grad():
            batch, length, _ = hidden_states.shape
            q = ix.wq_b(q_resid).view(batch, length, ix.n_heads, ix.head_dim)
            split = [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim]
            q_rot, q_pass = torch.split(q, split, dim=-1)
            k = ix.k_norm(ix.wk(hidden_states)).unsqueeze(2)
            k_rot, k_pass = torch.split(k, split, dim=-1)
            q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
            q = torch.cat([q_rot, q_pass], dim=-1)
            k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
        return q, k

    def _index_weights(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The indexer's per-head weights ``[B, L, H_I]`` (fp32)."""
        ix = self.module.indexer
        weights = ix.weights_proj(hidden_states.to(ix.weights_proj.weight.dtype)).float()
        return weights * (ix.n_heads**-0.5)

    def index_scores(self, state: ForwardState, lo: int, hi: int, keys: torch.Tensor) -> Any:
        """HF's indexer scores of local queries ``lo:hi`` over ``keys`` (in place, fp32)."""
        (q, weights), ix = state.index_queries, self.module.indexer
        s = torch.matmul(q[:, lo:hi].float(), keys.transpose(-1, -2).float().unsqueeze(1))
        s = s.mul_(ix.softmax_scale).relu_()  # [B, l, H_I, n]; HF's ops, in place
        return torch.matmul(weights[:, lo:hi].unsqueeze(-2), s).squeeze(-2)

    def indexer_params(self) -> IndexerParams | None:
        """The indexer's top-k and heads (transformers names them ``n_heads``, NeMo
        ``num_heads``); a shared layer has none."""
        ix = self.module.indexer
        if ix is None:
            return None
        heads = getattr(ix, "n_heads", None) or ix.num_heads
        return IndexerParams(int(ix.index_topk), int(heads))

    def attention_params(self) -> AttentionParams:
        return latent_params(self.module, float(self.module.scaling))

    def attention(self, request: AttentionRequest, state: ForwardState) -> torch.Tensor:
        """transformers' op order: every gathered latent through HF's ``expand_kv``
        (:func:`dense_latent_attention`)."""
        m, latent = self.module, request.cmp_kv
        batch, n_slots = latent.shape[:2]
        kv_pass, k_rot = torch.split(latent, [m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        keys, values = m.expand_kv(
            kv_pass.view(batch, 1, n_slots, m.kv_lora_rank),
            k_rot.reshape(batch, 1, n_slots, m.qk_rope_head_dim),
        )
        return dense_latent_attention(request, keys, values, float(m.scaling))

    def output(self, o: torch.Tensor, state: ForwardState) -> torch.Tensor:
        """``o_proj`` of the heads' values ``o [B, L, H, v_head_dim]``."""
        return self.module.o_proj(o.reshape(o.shape[0], o.shape[1], -1))

    def finish(self, out: torch.Tensor, state: ForwardState) -> Any:
        return (out, None, state.selected) if self.glm else (out, None)

"""Hugging Face transformers ``DeepseekV4Attention`` (transformers >= 5.x) under CP.

``enable_cp(model, mesh)`` on a ``DeepseekV4ForCausalLM`` / ``DeepseekV4Model`` (or on one
``DeepseekV4Attention``) replaces the forward of every attention layer (sliding, CSA, HCA)
with the CP one; the decoder layers, MoE, hyper-connections, norms and head are token-local
and run unchanged on each rank's rows. Each rank then calls::

    S = input_ids.shape[1]
    pos = torch.arange(S).unsqueeze(0)
    out = model(input_ids=handle.shard(input_ids, 1),
                position_ids=handle.shard(pos, 1), use_cache=False)

The stages reuse the module's own parameters and submodules, op for op as HF's forward:

* projections: ``q_a_proj, q_a_norm, q_b_proj, q_b_norm, kv_proj, kv_norm`` with the
  ``(cos, sin)`` the model computed from the (sharded, global) ``position_ids``
  (``position_embeddings[module.rope_layer_type]``);
* compressors (CSA / HCA): ``compressor.{kv_proj, gate_proj, position_bias, kv_norm,
  rotary_emb}``, slot j of a segment roped at ``rope_pos_offset + j*r`` (the plan's global
  slot positions), CSA overlap exactly as HF (previous block's first half, -inf gate for a
  missing predecessor);
* indexer (CSA): ``compressor.indexer.{kv_proj, gate_proj, position_bias, kv_norm,
  rotary_emb, q_b_proj, scorer, index_topk}``, run without autograd like HF (whose top-k
  gives the indexer no gradient);
* attention: the window and visible-slot ranges of the plan, the indexer picks for CSA,
  every visible slot for HCA, with the per-head ``sinks`` inside the softmax max (HF's extra
  logit column), ``scaling``; then the inverse RoPE at the query position and the grouped
  ``o_a_proj`` / ``o_b_proj``.

Not supported under CP (a clear :class:`~hp_cp_core.HpCpError` on every rank, before any
exchange): a KV cache (``past_key_values``, or ``use_cache=True``, the config default),
attention masks that hide tokens, position ids that are not the plan's, attention dropout in
training. Training (``handle.batch``, the loss and gradient helpers re-exported here) and HF's
own parallelism next to CP (:func:`cp_layout_from_hf_model`): ``docs/huggingface.md``.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hp_cp_core import HpCpError, LayerSpec
from hp_cp_core.batch import CU_SEQLENS_KWARG
from hp_cp_torch._removed import ADAPTER_FOR, removed_names
from hp_cp_torch.attention import chunk_columns
from hp_cp_torch.integrations.hf_layout import (
    HFCPLayout,
    cp_layout_from_hf_model,
    freeze_csa_indexer,
)
from hp_cp_torch.kernels.request import AttentionRequest
from hp_cp_torch.kernels.smallop import gather_rows
from hp_cp_torch.model.spec import (
    AttentionParams,
    ForwardState,
    IndexerParams,
    LayerInputs,
    ModelAdapter,
    PlanView,
    Projection,
    Traits,
)
from hp_cp_torch.model.validation import TensorChecks
from hp_cp_torch.training import cp_causal_lm_loss, cp_shift_labels, cp_sum_gradients

# re-exported: the training helpers (hp_cp_torch.training) and HF's layout
# (hp_cp_torch.integrations.hf_layout) serve any model, so they live outside the model files
__all__ = [
    "DeepseekV4AttentionAdapter",
    "TransformersAttention",
    "HFCPLayout",
    "cp_causal_lm_loss",
    "cp_shift_labels",
    "cp_layout_from_hf_model",
    "cp_sum_gradients",
    "freeze_csa_indexer",
]

__getattr__ = removed_names(
    __name__,
    cp_causal_lm_batch="handle.batch(input_ids, labels=labels)",
    hf_adapter_for=ADAPTER_FOR,
)

MODELING = "transformers.models.deepseek_v4.modeling_deepseek_v4"


def _hf() -> Any:
    return importlib.import_module(MODELING)


def _rope_of(module: nn.Module) -> Any:
    """The ``apply_rotary_pos_emb`` of the layer's own modeling file (a generated copy, such as
    VeOmni's, has its own), else transformers' DeepSeek V4 one."""
    own = getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)
    return own or _hf().apply_rotary_pos_emb


def _compress_rows(
    comp: nn.Module, overlap: bool, rows: torch.Tensor, offset: int, apply_rope: Any = None
) -> torch.Tensor:
    """HF's stateless compressor body on rows ``[B, n, hidden]``.

    Every complete block of ``r`` rows gives one slot (trailing rows are ignored, as HF drops
    them); with ``overlap`` (CSA / indexer) slot j also pools block j-1's first-half channels,
    the first block's predecessor being kv 0 / gate -inf (weight 0). Slot j is roped at
    ``offset + j*r``. Returns ``[B, n // r, head_dim]``. With no complete block the
    parameters still enter the graph, so every rank gets a (zero) gradient for them.
    ``apply_rope`` is the modeling file's own ``apply_rotary_pos_emb`` (default: HF's).
    """
    apply_rope = apply_rope or _hf().apply_rotary_pos_emb
    r, d = int(comp.compress_rate), int(comp.head_dim)
    batch, n = rows.shape[0], rows.shape[1] // r
    kv, gate = comp.kv_proj(rows), comp.gate_proj(rows)
    chunk_kv = kv[:, : n * r].reshape(batch, n, r, kv.shape[-1])
    chunk_gate = gate[:, : n * r].reshape(batch, n, r, gate.shape[-1]) + comp.position_bias
    if overlap:
        new_kv = chunk_kv.new_zeros((batch, n, 2 * r, d))
        new_gate = chunk_gate.new_full((batch, n, 2 * r, d), float("-inf"))
        new_kv[:, :, r:] = chunk_kv[..., d:]
        new_gate[:, :, r:] = chunk_gate[..., d:]
        if n > 1:
            new_kv[:, 1:, :r] = chunk_kv[:, :-1, :, :d]
            new_gate[:, 1:, :r] = chunk_gate[:, :-1, :, :d]
        chunk_kv, chunk_gate = new_kv, new_gate
    weights = chunk_gate.softmax(dim=2, dtype=torch.float32).to(chunk_kv.dtype)
    compressed = comp.kv_norm((chunk_kv * weights).sum(dim=2))  # [B, n, d]
    positions = torch.arange(n, device=rows.device) * r + int(offset)
    positions = positions.unsqueeze(0).expand(batch, -1)
    cos, sin = comp.rotary_emb(compressed, position_ids=positions, layer_type="compress")
    return apply_rope(compressed.unsqueeze(1), cos, sin).squeeze(1)


def _mask_is_unsupported(mask: Any) -> torch.Tensor | bool:
    """Whether the mask HF passes down hides some token from itself (padding) or is custom.

    HF's eager sliding-window mask always lets a token see itself; padding (a 2-D
    ``attention_mask`` with zeros) masks the padded token's own column, so it shows on the
    diagonal. Returns a 0-dim bool tensor (one host sync later) or ``False``.
    """
    if not isinstance(mask, torch.Tensor):
        return False
    if mask.dim() == 2:  # a raw padding mask handed straight to the layer
        return (mask == 0).any()
    if mask.dim() != 4:
        return True
    q_len, k_len = mask.shape[-2], mask.shape[-1]
    diag = torch.diagonal(mask, offset=k_len - q_len, dim1=-2, dim2=-1)
    return (~diag).any() if mask.dtype == torch.bool else (diag != 0).any()


@dataclass
class ModelCallInputs(LayerInputs):
    """A transformers / NeMo / VeOmni attention layer's call: the base's inputs and the rest.

    Attributes:
        position_embeddings: the RoPE tables the model computed (HF's ``(cos, sin)`` or a
            dict of them by layer type; NeMo GLM-5's ``freqs_cis``).
        attention_mask: the mask the model passed down, or ``None``.
        past_key_values: a KV cache (refused), or ``None``.
        kwargs: the call's other keyword arguments.
    """

    position_embeddings: Any = None
    attention_mask: Any = None
    past_key_values: Any = None
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class RopeForwardState(ForwardState):
    """One forward of a V4 layer (HF's, NeMo's, VeOmni's): the base's fields and the RoPE.

    Attributes:
        cos, sin: the RoPE tables of the local rows (set by ``project``).
        qr: the query's low-rank residual ``[B, L, q_lora]`` (computed while the halo
            travels).
    """

    cos: Any = None
    sin: Any = None
    qr: Any = None


# the errors of a transformers-style call, each with its fix
NO_ROPE_HINT = (
    "needs the position_embeddings the model computes; call the model, not the layer, "
    "or pass position_embeddings={'main': (cos, sin), 'compress': (cos, sin)}."
)

MASK_HINT = (
    "got an attention mask that hides tokens (padding, or a custom mask); HF's "
    "compressors ignore padding, so CP supports only unpadded sequences. Pass "
    "attention_mask=None (or all ones) and equal-length sequences."
)

POSITIONS_HINT = (
    "got position_ids that are not the global row numbers of the local rows. Pass "
    "position_ids=handle.shard(torch.arange(S).unsqueeze(0), 1) with the same layout as "
    "the inputs (packed: positions restarting per document, with the documents' "
    "boundaries as hp_cp_cu_seqlens=...)."
)

LOCAL_LOSS_HINT = (
    "got labels without shift_labels and num_items_in_batch: HF's loss would shift them "
    "within this rank's rows. Pass labels=batch.labels, shift_labels=batch.labels, "
    "num_items_in_batch=batch.n_tokens (batch = handle.batch(ids): the loss is then this "
    "rank's share), or use cp_causal_lm_loss(out.logits, batch.labels, batch.n_tokens)."
)


def call_problems(
    inputs: ModelCallInputs, training: bool, dropout: float, no_rope: str = NO_ROPE_HINT
) -> list[str]:
    """What CP cannot take from a transformers-style attention call: no RoPE tables
    (``no_rope``, the fix), a KV cache, attention ``dropout`` in ``training``."""
    problems = []
    if inputs.position_embeddings is None:
        problems.append(no_rope)
    if inputs.past_key_values is not None:
        problems.append(
            "got a KV cache (past_key_values); caches and generation are not supported "
            "under CP. Call the model with use_cache=False (config.use_cache defaults to "
            "True) and without past_key_values."
        )
    if training and dropout > 0:
        problems.append(
            f"attention dropout ({dropout}) in training is not supported; set "
            "config.attention_dropout=0.0 or call model.eval()."
        )
    return problems


def call_value_checks(
    inputs: ModelCallInputs, plan: PlanView, mask: str = MASK_HINT, positions: str = POSITIONS_HINT
) -> list[tuple[Any, str]]:
    """A mask that hides a token; position ids that are not the plan's (``mask`` /
    ``positions``: the errors, with the fix)."""
    position_ids, bad_positions = inputs.position_ids, False
    if position_ids is not None:
        want = torch.as_tensor(plan.positions, device=position_ids.device)
        got = position_ids.reshape(-1, position_ids.shape[-1])
        bad_positions = got.shape[-1] != len(plan.rows) or (got != want).any()
    return [(_mask_is_unsupported(inputs.attention_mask), mask), (bad_positions, positions)]


class TransformersAttention(ModelAdapter, abstract=True):
    """The hooks every transformers-style attention layer shares (the DeepSeek V4 and the DSA
    adapters derive from it, filling the layer's): its call's checks (:func:`call_problems`,
    :func:`call_value_checks`) and the refusal of HF's own loss on local rows."""

    @classmethod
    def prepare_model(cls, model: nn.Module, layers: list[nn.Module], handle: Any) -> None:
        """On a transformers ``*ForCausalLM`` at cp > 1, refuse (before any exchange) the
        ``labels`` HF's loss would shift within this rank's rows: a silently wrong loss."""
        if handle.cp_size == 1 or not callable(getattr(model, "loss_function", None)):
            return
        if not type(model).__module__.startswith("transformers."):
            return
        signature, where = inspect.signature(model.forward), f"{type(model).__name__} under CP"

        def refuse_local_shift(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if signature.bind_partial(*args, **kwargs).arguments.get("labels") is None:
                return
            if kwargs.get("shift_labels") is None or kwargs.get("num_items_in_batch") is None:
                raise HpCpError(f"{where}: {LOCAL_LOSS_HINT}")

        hook = model.register_forward_pre_hook(refuse_local_shift, with_kwargs=True)
        handle.on_disable(hook.remove)

    def check_inputs(self, inputs: ModelCallInputs, checks: TensorChecks) -> None:
        m = self.module
        checks.hidden_states(
            inputs.hidden, int(m.config.hidden_size), inputs.cu_seqlens is not None
        )
        for problem in call_problems(inputs, m.training, float(m.attention_dropout)):
            checks.fail(problem)

    def value_checks(self, inputs: ModelCallInputs, plan: PlanView) -> list[tuple[Any, str]]:
        return call_value_checks(inputs, plan)


class DeepseekV4AttentionAdapter(TransformersAttention):
    """The model adapter of transformers' ``DeepseekV4Attention`` (batch-major ``[B, S,
    hidden]``): its call, projections, compressors, indexer, attention and tail. NeMo's and
    VeOmni's V4 adapters derive from it (the same layer)."""

    traits = Traits(
        state_class=RopeForwardState,
        packed_topk_row="document",  # the indexer's top-k of a packed document: its own row
        indexer_grad="none",  # the indexer only feeds integer top-k ids: no gradient
    )

    @property
    def _is_csa(self) -> bool:
        comp = self.module.compressor
        return comp is not None and getattr(comp, "indexer", None) is not None

    def _rope(self, *args: Any) -> Any:
        return _rope_of(self.module)(*args)

    def layer_spec(self) -> LayerSpec:
        m, comp = self.module, self.module.compressor
        ratio = 0 if comp is None else int(comp.compress_rate)
        if comp is not None and (ratio == 4) != self._is_csa:
            kind = "CSA (overlapping, with indexer)" if self._is_csa else "HCA (non-overlapping)"
            raise HpCpError(
                f"layer {m.layer_idx} ({m.layer_type}) is a {kind} layer with compress rate "
                f"{ratio}; hp_cp supports overlapping compression only at rate 4 and "
                "non-overlapping compression at rates other than 4. Use compress_rates "
                "{'compressed_sparse_attention': 4, 'heavily_compressed_attention': 128}."
            )
        return LayerSpec(
            compress_ratio=ratio,
            window_size=int(m.sliding_window),
            has_indexer=self._is_csa,
            force_unfused=True,
        )

    def compress(self, rows: torch.Tensor, start: int, state: ForwardState) -> torch.Tensor:
        return _compress_rows(self.module.compressor, self._is_csa, rows, start, self._rope)

    def compress_index_keys(
        self, rows: torch.Tensor, start: int, state: ForwardState
    ) -> torch.Tensor:
        return _compress_rows(self.module.compressor.indexer, True, rows, start, self._rope)

    def index_queries(self, state: RopeForwardState) -> torch.Tensor:
        """The indexer's roped queries ``[B, L, H_I, D_I]`` (no gradient, as in HF)."""
        ix, x = self.module.compressor.indexer, state.hidden
        with torch.no_grad():
            cos, sin = ix.rotary_emb(x, position_ids=state.positions, layer_type=ix.rope_layer_type)
            q = ix.q_b_proj(state.qr).view(*x.shape[:2], -1, ix.head_dim).transpose(1, 2)
            return self._rope(q, cos, sin).transpose(1, 2)

    def index_scores(self, state: ForwardState, lo: int, hi: int, keys: torch.Tensor) -> Any:
        ix = self.module.compressor.indexer
        return ix.scorer(state.index_queries[:, lo:hi], keys, state.hidden[:, lo:hi])

    def indexer_params(self) -> IndexerParams | None:
        if not self._is_csa:
            return None
        ix = self.module.compressor.indexer
        return IndexerParams(int(ix.index_topk), int(ix.num_heads))

    def attention_params(self) -> AttentionParams:
        return AttentionParams(float(self.module.scaling), self.module.sinks)

    def attention(self, request: AttentionRequest, state: ForwardState) -> torch.Tensor:
        """HF's ``eager_attention_forward`` on gathered columns instead of a dense mask.

        Each query attends to its plan columns (window, then the indexer picks for CSA or
        every visible slot for HCA); the op sequence and dtypes are HF's: logits in the
        model dtype, the ``sinks`` logit column inside the max, softmax in the logits' dtype,
        probabilities cast to the value dtype (dropout in training is refused). Query chunks
        bound the memory.
        """
        m, q, ori, cmp = self.module, request.q, request.ori_ext, request.cmp_kv
        batch = q.shape[0]
        pool = ori if cmp is None else torch.cat([ori, cmp], dim=1)
        if pool.shape[1] == 0:
            pool = pool.new_zeros((batch, 1, pool.shape[-1]))
        columns = request.columns  # the plan's, in the request's ext frame
        outs = []
        for lo, hi in columns.chunks(request.query_chunk):
            window, slots = chunk_columns(
                columns, lo, hi, request.selected, cmp is not None, batch, q.device
            )
            cols = [window] if slots is None else [window, slots]
            idx = torch.cat(cols, dim=-1)  # [B, l, K]
            kv = gather_rows(pool, idx.clamp(min=0))  # [B, l, K, D]; K == V
            qc = q[:, lo:hi]  # [B, l, H, D]
            logits = torch.matmul(qc, kv.transpose(-1, -2)) * m.scaling  # [B, l, H, K]
            bias = torch.zeros((), dtype=logits.dtype, device=q.device)
            bias = torch.where(idx >= 0, bias, float("-inf"))[:, :, None, :]
            logits = logits + bias
            sinks = m.sinks.reshape(1, 1, -1, 1).expand(batch, hi - lo, -1, 1)
            logits = torch.cat([logits, sinks], dim=-1)
            logits = logits - logits.max(dim=-1, keepdim=True).values
            probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(kv.dtype)
            outs.append(torch.matmul(probs, kv))  # [B, l, H, D]
        return torch.cat(outs, dim=1)

    def output(self, o: torch.Tensor, state: RopeForwardState) -> torch.Tensor:
        """Inverse RoPE at the query position, grouped ``o_a_proj``, ``o_b_proj`` (HF's tail)."""
        m = self.module
        o = self._rope(o.transpose(1, 2), state.cos, -state.sin).transpose(1, 2)
        grouped = o.reshape(o.shape[0], o.shape[1], m.config.o_groups, -1)
        return m.o_b_proj(m.o_a_proj(grouped).flatten(2))

    def read_inputs(
        self,
        hidden_states: Any,
        position_embeddings: Any = None,
        position_ids: Any = None,
        attention_mask: Any = None,
        past_key_values: Any = None,
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

    def project(self, state: RopeForwardState) -> Projection:
        """HF's projections: the shared KV now; the query residual and the indexer's queries
        while the halo travels, the queries while the slots do (Note [Overlapped exchanges]
        in hp_cp_core.collectives; each holds work with a gradient, so backward overlaps both
        exchanges too)."""
        m, rope, x = self.module, self._rope, state.hidden
        tables = state.inputs.position_embeddings
        state.cos, state.sin = tables[m.rope_layer_type] if isinstance(tables, dict) else tables
        shape = (*x.shape[:2], -1, m.head_dim)
        kv = rope(m.kv_norm(m.kv_proj(x)).view(shape).transpose(1, 2), state.cos, state.sin)
        projection = Projection(None, kv[:, 0])  # [B, L, D]

        def residual_and_indexer_queries() -> None:
            state.qr = m.q_a_norm(m.q_a_proj(x))
            if self._is_csa:
                state.index_queries = self.index_queries(state)

        def queries() -> None:
            q = m.q_b_norm(m.q_b_proj(state.qr).view(shape).transpose(1, 2))
            projection.query = rope(q, state.cos, state.sin).transpose(1, 2)  # [B, L, H, D]

        projection.local_work = (residual_and_indexer_queries, queries)
        return projection

    def finish(self, out: torch.Tensor, state: ForwardState) -> Any:
        return out, None  # HF returns (output, attn_weights)

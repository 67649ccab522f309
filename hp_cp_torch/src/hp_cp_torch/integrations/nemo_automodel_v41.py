"""NeMo Automodel's DeepSeek V4.1 (``nemo_automodel.components.models.deepseek_v41``) under CP.

``hp_cp_core.enable_cp(model, mesh)`` (:func:`prepare_v41_model` runs the model-level part)
on a NeMo ``DeepseekV41ForCausalLM`` replaces the forward
of every ``DeepseekV41Attention`` (CSA2: sliding-window, Full, Reindex and Reuse layers at
ratios 0, 1 and >= 2) and of the Engram n-gram hash with hp_cp's; hyper-connections, MoE,
the Engram lookups, norms and the head are token-local and run unchanged on each rank's
rows. :func:`~hp_cp_torch.integrations.nemo_automodel.cp_nemo_batch` ``(handle, input_ids,
seq_lens=...)`` lays a batch out.

Note [NeMo DeepSeek V4.1 under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
What each piece of NeMo's model reads across positions, and where hp_cp's plans bring it
(NeMo's own CP, ``deepseek_v41/cp.py``, all-gathers every layer's whole KV, its compressed
KV, index keys and the token ids instead, contiguous shards of whole compression groups)::

    piece (NeMo)                       reads                         under hp_cp
    ---------------------------------  ----------------------------  ---------------------------
    q, kv: wq_a/q_norm/wq_b, wkv/      the row itself                local (fp8 cache quant too)
      kv_norm, RoPE from position_ids
    window attention                   kv rows t-W+1 .. t (doc)      window halo (every layer)
    _Compressor (Full layer), ratio r  r rows of its group;          x halo for groups across a
      (channelwise softmax pooling, no   r = 1: the row itself         rank edge; slot owned by
      overlap), RoPE at the group's                                    the rank of its last row
      first position, nvfp4
    index keys (Full): wk, k_norm,     the slot's latent             computed by the slot owner,
      RoPE, mxfp4 of the latent                                        sent with the slots
    compressed KV + index keys         every earlier slot            one slot exchange per Full
                                                                       layer: each rank gets
                                                                       the slots its queries see
    Reindex / Reuse layers             the Full layer's slots/keys   that buffer, no exchange
                                                                       (Note [Layers that share
                                                                       their indexer])
    indexer selection (frozen,         the row's queries x the       local: the score row of a
      no_grad): scores = sum_h w_h *     visible keys, candidates      query has NeMo's width
      relu(q_h . k), -inf if not         from the candidate layer      (the document's slots),
      visible; topk(min(k, width),                                     -inf where invisible, and
      sorted=False), sorted ids                                        NeMo's own topk on it
    two-level candidates (candidate    block maxima of that row      local, NeMo's
      source): _select_candidate_                                      _select_candidate_blocks
      blocks (keep the last visible                                    on the same row
      block, topk of block maxima)
    sink attention, inverse RoPE,      the selected slots, window    hp_cp's attention kernels,
      wo_a / wo_b                                                      NeMo's _project_output
    Engram hash (DeepseekV41NgramHash) token ids t-n+1 .. t of the   a halo of n-1 token ids
                                         document (n-gram, n = 4)      (a window-n plan); the
                                                                       hash arithmetic is NeMo's
    Engram lookup / gate, MoE, mHC     the row itself                local

The selection is exact only on the same candidate row: ``torch.topk`` breaks ties by the
whole row (its length, where the -inf entries sit), and the fp4 cache quantization makes
ties common. So each query's row spans the slots NeMo's row spans (padded input: the real
sequence's slots; packed: its document's), with -inf where it sees nothing, and goes through
NeMo's own calls.

The schedule is the core's sharing plan (``handle.sharing.describe()``): a Full layer's
``LayerSpec`` reuses nothing, a Reindex layer reuses ``("compressed_kv", "index_keys")`` (and
``"candidates"`` after the two-level indexer's candidate source, whose ``index_block`` is
``candidate_block_size``), a Reuse layer ``("compressed_kv", "index_keys", "selection")``; all
pool without overlap (``overlapping=False``). What a layer reuses reaches it through the core
(``call.cmp_kv_global`` / ``call.cmp_idx_global``, the owner's gathered buffers in global slot
order, the slots this rank's queries can see; ``call.reused["selection"]`` ``[B, L, k]``, global
slot ids, -1 empty; ``call.reused["candidates"]`` ``[B, L, N]``), published by the owner's
``run_attention`` in ``call.outputs``. The state NeMo's model passes between layers
(``DeepseekV41AttentionState``) still gets the same tensors in NeMo's fields, as NeMo's
layer returns it, but hp_cp reads nothing from it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hp_cp_core import CPBatch, CPHandle, HpCpError, LayerSpec
from hp_cp_core.layout import Documents
from hp_cp_torch._removed import ENABLE, NEMO_BATCH, REGISTRY, deprecated, removed_names
from hp_cp_torch.adapter import install_forward
from hp_cp_torch.model.registry import registered_adapter
from hp_cp_torch.model.spec import (
    RECORDED,
    AttentionParams,
    ForwardState,
    IndexerParams,
    LayerInputs,
    ModelAdapter,
    ModelHandle,
    PlanView,
    Projection,
    Traits,
)
from hp_cp_torch.model.validation import TensorChecks

__all__ = [
    "NemoDeepseekV41AttentionAdapter",
    "is_v41_model",
    "nemo_v41_adapter_for",
]

__getattr__ = removed_names(__name__, enable_cp_v41=ENABLE, nemo_v41_cp_batch=NEMO_BATCH)

ATTENTION = "nemo_automodel.components.models.deepseek_v41.attention"
MODEL = "nemo_automodel.components.models.deepseek_v41.model"
QUANT = "nemo_automodel.components.models.deepseek_v41.quantization"


def _attn_mod() -> Any:
    return sys.modules[ATTENTION]


def _quantize(values: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    return sys.modules[QUANT].quantize_cache(values, format=fmt, block_size=block)


def nemo_v41_adapter_for(module: Any) -> Any:
    """The adapter for a NeMo ``DeepseekV41Attention``, else ``None`` (never imports NeMo).

    .. deprecated:: 0.5.0
        Removed in 0.6.0: use ``hp_cp_torch.adapter.adapter_for(module)``, which reads the
        ``hp_cp.torch_models`` entry points (``register_model_adapter`` for a class of your
        own).
    """
    deprecated(f"{__name__}.nemo_v41_adapter_for", REGISTRY)
    return registered_adapter(module, NemoDeepseekV41AttentionAdapter)


def is_v41_model(model: Any) -> bool:
    """Whether ``model`` is or holds a NeMo DeepSeek V4.1 attention layer."""
    if sys.modules.get(ATTENTION) is None or not isinstance(model, nn.Module):
        return False
    return any(
        registered_adapter(m, NemoDeepseekV41AttentionAdapter) is not None for m in model.modules()
    )


def layer_role(m: nn.Module) -> str:
    """``"window"``, ``"full"``, ``"reindex"`` or ``"reuse"`` (see the module's Note)."""
    if not m.compress_ratio:
        return "window"
    if m.is_kv_source:
        return "full"
    return "reindex" if m.is_index_source else "reuse"


_NEMO_CP_ON = (
    "NeMo Automodel's own DeepSeek V4.1 CP is switched on as well (a cp_group in the call, "
    "from its ContextParallelSharder / shard_cp_batch, or setup_cp_attention gave the layer a "
    "cp_group, or model.cp_mesh is set); hp_cp owns the attention layers, so switch NeMo's CP "
    "off (cp_size 1, no cp_sharder) and lay the batch out with cp_nemo_batch(handle, ...)."
)


@dataclass
class V41CallInputs(LayerInputs):
    """NeMo's ``DeepseekV41Attention`` call: the base's inputs and NeMo's own.

    Attributes:
        nemo_state: the ``DeepseekV41AttentionState`` NeMo's model passed in.
        attention_mask, cp_group, packed_seq_ids: as NeMo passed them (with
            ``packed_seq_ids``, ``cu_seqlens`` is the recorded boundaries: NeMo hands its
            layers per-row document ids only).
    """

    nemo_state: Any = None
    attention_mask: Any = None
    cp_group: Any = None
    packed_seq_ids: Any = None


@dataclass(kw_only=True)
class V41ForwardState(ForwardState):
    """One forward of a V4.1 layer: the base's fields and

    Attributes:
        angles: the local rows' RoPE angles.
        valid: ``[B, L]`` bool, the rows the attention mask keeps.
        latents: each compressed segment's latent, by ``(offset, rows)`` (the main
            compressor's, reused by the indexer's).
    """

    angles: Any = None
    valid: Any = None
    latents: dict[tuple[int, int], Any] = field(default_factory=dict)


class NemoDeepseekV41AttentionAdapter(ModelAdapter):
    """The model adapter of NeMo's ``DeepseekV41Attention`` (batch-major ``[B, L, hidden]``)."""

    traits = Traits(
        state_class=V41ForwardState,
        packed_topk_row="document",
        ascending_picks=True,  # NeMo's topk(sorted=False), then sorted ids
        indexer_grad="none",  # NeMo's indexer is frozen and runs under no_grad
    )

    @classmethod
    def prepare_model(cls, model: nn.Module, layers: list[nn.Module], handle: ModelHandle) -> None:
        """The model-level part (:func:`prepare_v41_model`)."""
        prepare_v41_model(model, layers, handle)

    @property
    def _role(self) -> str:
        return layer_role(self.module)

    def layer_spec(self) -> LayerSpec:
        m = self.module
        role, ratio = self._role, int(m.compress_ratio)
        if role == "window":
            return LayerSpec(compress_ratio=0, window_size=int(m.window_size))
        ix = m.indexer  # None on a Reuse layer
        block = 0
        reuses: tuple[str, ...] = ()
        if ix is not None and (ix.is_candidate_source or ix.uses_candidates):
            block = int(ix.candidate_block_size)
        if role == "reindex":
            reuses = ("compressed_kv", "index_keys")
            if ix.uses_candidates:
                reuses += ("candidates",)
        elif role == "reuse":
            reuses = ("compressed_kv", "index_keys", "selection")
        elif ix.uses_candidates:  # a Full layer after the candidate source (rejected)
            reuses = ("candidates",)
        return LayerSpec(
            compress_ratio=ratio,
            window_size=int(m.window_size),
            has_indexer=True,
            force_unfused=True,
            overlapping=False,
            index_block=block,
            reuses=reuses,
        )

    def _latent(self, rows: torch.Tensor) -> torch.Tensor:
        """NeMo's ``_Compressor`` on rows ``[B, n, hidden]``: ``[B, n//r, D]``."""
        return self.module.compressor(rows)

    def _slot_angles(self, latent: torch.Tensor, offset: int) -> torch.Tensor:
        r = int(self.module.compress_ratio)
        positions = torch.arange(latent.shape[1], device=latent.device) * r + int(offset)
        return self.module.rotary_emb(positions.unsqueeze(0).expand(latent.shape[0], -1))

    def compress(self, rows: torch.Tensor, start: int, state: V41ForwardState) -> torch.Tensor:
        """The owned slots: NeMo's latent, roped at each group's first position, nvfp4 (the
        latent is kept for :meth:`compress_index_keys`)."""
        latent = self._latent(rows)
        state.latents[(int(start), int(rows.shape[1]))] = latent.detach()
        slots = _attn_mod()._apply_rope(latent, self._slot_angles(latent, start))
        return _quantize(slots, "nvfp4", 16)

    def compress_index_keys(
        self, rows: torch.Tensor, start: int, state: V41ForwardState
    ) -> torch.Tensor:
        """The owned slots' index keys: ``mxfp4(rope(k_norm(wk(latent))))``, no gradient
        (``traits.indexer_grad``)."""
        ix = self.module.indexer
        latent = state.latents.get((int(start), int(rows.shape[1])))
        if latent is None:
            latent = self._latent(rows)
        keys = _attn_mod()._apply_rope(ix.k_norm(ix.wk(latent)), self._slot_angles(latent, start))
        return _quantize(keys, "mxfp4", 32)

    # ------------------------------------------------------------------ selection

    def index_queries(self, state: V41ForwardState) -> tuple[torch.Tensor, torch.Tensor]:
        """NeMo's indexer queries (roped, mxfp4) and per-head weights, without autograd (and
        the candidate source's empty candidates ``[B, L, N]``)."""
        ix, nemo, xb = self.module.indexer, _attn_mod(), state.hidden
        with torch.no_grad():
            q = ix.wq_b(state.projection.index_input).unflatten(-1, (ix.num_heads, ix.head_dim))
            q = _quantize(nemo._apply_rope(q, state.angles), "mxfp4", 32)
            w = ix.weights_proj(xb) * (ix.head_dim**-0.5 * ix.num_heads**-0.5)
        if ix.is_candidate_source:
            shape = (xb.shape[0], len(state.view.rows), state.keys.shape[1])
            state.candidates = torch.zeros(shape, dtype=torch.bool, device=xb.device)
        return q, w

    def index_scores(self, state: V41ForwardState, lo: int, hi: int, keys: torch.Tensor) -> Any:
        """NeMo's indexer scores ``sum_h w * relu(q . k)``."""
        q, w = state.index_queries
        s = torch.einsum("bshd,btd->bsht", q[:, lo:hi], keys)
        return (s.relu() * w[:, lo:hi].unsqueeze(-1)).sum(dim=2)

    def block_candidates(
        self, state: V41ForwardState, scores: torch.Tensor, lo: int, hi: int, row: Any
    ) -> torch.Tensor:
        """The two-level indexer on the one-process rows: the candidate source keeps the
        blocks NeMo's ``_select_candidate_blocks`` keeps (into ``state.candidates``); a layer
        that uses them picks only among them."""
        ix = self.module.indexer
        d0, width = row.start, row.length
        if ix.uses_candidates and not ix.is_candidate_source:
            allowed = state.candidates[:, lo:hi, d0 : d0 + width]
            allowed = F.pad(allowed, (0, width - allowed.shape[-1]))
            return scores.masked_fill(~allowed, float("-inf"))
        if not ix.is_candidate_source:
            return scores
        plan, n_buf = state.view, state.candidates.shape[-1]
        vis = torch.as_tensor(np.minimum(plan.slot_count[lo:hi], width), device=scores.device)
        keep = _attn_mod()._select_candidate_blocks(
            scores,
            vis.view(1, -1, 1).expand(scores.shape[0], -1, 1),
            topk_blocks=ix.candidate_topk_blocks,
            block_size=ix.candidate_block_size,
        ) & torch.isfinite(scores)
        stop = min(d0 + width, n_buf)
        state.candidates[:, lo:hi, d0:stop] = keep[..., : stop - d0]
        return scores

    def indexer_params(self) -> IndexerParams | None:
        ix = self.module.indexer
        return None if ix is None else IndexerParams(int(ix.topk), int(ix.num_heads))

    # ------------------------------------------------------------------ attention

    def attention_params(self) -> AttentionParams:
        return AttentionParams(self.module.head_dim**-0.5, self.module.attn_sink)

    def output(self, o: torch.Tensor, state: V41ForwardState) -> torch.Tensor:
        """NeMo's ``_project_output`` (inverse RoPE, masked rows, grouped output)."""
        o = o.to(state.projection.query.dtype)
        return self.module._project_output(o, state.angles, state.valid)

    def finish(self, out: torch.Tensor, state: V41ForwardState) -> Any:
        """NeMo's output and ``DeepseekV41AttentionState``: its own or the owner's buffers."""
        nemo_state = state.inputs.nemo_state
        if self._role != "window":
            nemo_state = type(nemo_state)(
                compressed_kv=state.slots,  # [B, N, D]
                index_keys=state.keys,  # [B, N, Di]
                topk_indices=state.selected,
                candidates=state.candidates,
                compression_ratio=int(self.module.compress_ratio),
            )
        return _attn_mod().DeepseekV41AttentionOutput(out, nemo_state)

    # ------------------------------------------------------------------ the call

    def read_inputs(
        self,
        hidden_states: Any,
        *,
        position_ids: Any,
        state: Any,
        attention_mask: Any = None,
        cp_group: Any = None,
        packed_seq_ids: Any = None,
    ) -> V41CallInputs:
        return V41CallInputs(
            hidden_states,
            position_ids,
            None if packed_seq_ids is None else RECORDED,  # cp_nemo_batch records them
            nemo_state=state,
            attention_mask=attention_mask,
            cp_group=cp_group,
            packed_seq_ids=packed_seq_ids,
        )

    def project(self, state: V41ForwardState) -> Projection:
        """NeMo's projections: RoPE'd queries, the fp8-quantized window KV, the residual."""
        m, nemo, x, mask = self.module, _attn_mod(), state.hidden, state.inputs.attention_mask
        state.angles = m.rotary_emb(state.positions)
        qr = m.q_norm(m.wq_a(x))
        query = nemo._apply_rope(m.wq_b(qr).unflatten(-1, (m.num_heads, m.head_dim)), state.angles)
        kv = _quantize(nemo._apply_rope(m.kv_norm(m.wkv(x)), state.angles), "fp8", 32)
        state.valid = x.new_ones(x.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
        return Projection(query, kv, index_input=qr)

    # ------------------------------------------------------------------ checks

    def check_inputs(self, inputs: V41CallInputs, checks: TensorChecks) -> None:
        """The hidden states, and what hp_cp cannot take from NeMo's call."""
        m, packed = self.module, inputs.cu_seqlens is not None
        checks.hidden_states(inputs.hidden, int(m.wq_a.in_features), packed)
        if inputs.packed_seq_ids is not None and inputs.cu_seqlens is None:
            checks.fail(
                "got packed_seq_ids without the packed boundaries of the sequence: lay "
                "packed batches out with cp_nemo_batch(handle, input_ids, seq_lens=...) "
                "(it records them on the handle), not NeMo's own packer."
            )
        if inputs.cp_group is not None or getattr(m, "cp_group", None) is not None:
            checks.fail(_NEMO_CP_ON)
        if m.training and m.attention_dropout > 0:
            checks.fail(
                f"attention dropout ({m.attention_dropout}) in training is not supported under "
                "CP; set attention_dropout=0.0 or call model.eval()."
            )

    def value_checks(self, inputs: V41CallInputs, plan: PlanView) -> list[tuple[Any, str]]:
        """The position ids, the mask and the document ids against the plan, on the device."""
        n_local, dev, position_ids = len(plan.rows), inputs.hidden.device, inputs.position_ids
        want = torch.as_tensor(plan.positions, device=dev)
        got = position_ids.reshape(-1, position_ids.shape[-1])
        bad = [got.shape[-1] != n_local or (got != want).any(), False, False]
        doc_ids = None
        if inputs.cu_seqlens is not None:
            docs = Documents.packed(inputs.cu_seqlens, plan.total_rows)
            ids = docs.doc_of(plan.rows) + 1
            if inputs.real_rows is not None:
                ids = np.where(plan.rows >= inputs.real_rows, 0, ids)
            doc_ids = torch.as_tensor(ids, device=dev)
            pid = inputs.packed_seq_ids.reshape(-1, inputs.packed_seq_ids.shape[-1])
            bad[2] = pid.shape[-1] != n_local or (pid != doc_ids).any()
        if inputs.attention_mask is not None:
            am = inputs.attention_mask.reshape(-1, inputs.attention_mask.shape[-1])
            if am.shape[-1] != n_local:
                bad[1] = True
            else:
                bad[1] = ((am == 0) if doc_ids is None else am.bool() != (doc_ids > 0)).any()
        return list(zip(bad, V41_VALUE_MESSAGES))


V41_VALUE_MESSAGES = (
    "got position_ids that are not the positions of the local rows: pass the batch of "
    "cp_nemo_batch(handle, ...) (global rows; packed: restarting at 0 in every document).",
    "got an attention_mask that hides real tokens; under CP only the padding cp_nemo_batch "
    "appends may be masked (packed: its trailing document).",
    "got packed_seq_ids that do not match the recorded packed boundaries; pass the batch of "
    "cp_nemo_batch(handle, ...) unchanged.",
)


# --------------------------------------------------------------------------- Engram hash


class EngramHashCP:
    """The forward of NeMo's ``DeepseekV41NgramHash`` on this rank's rows under CP.

    NeMo's hash of row t reads the token ids ``t-n+1 .. t`` of its document (n =
    ``max_ngram_size``): the rows before a rank's first row come as a halo of n - 1 ids
    (the runner's :class:`~hp_cp_torch.model.runner.RowExchange` of window n, ``handle.
    row_exchange``), instead of NeMo's all-gather of every id. The arithmetic is NeMo's
    (token map, blocked lookback, odd multipliers, xor, prime buckets, offsets);
    ``sequence_ids`` 0 (padding) blocks every lookback, as NeMo's.
    """

    def __init__(self, module: nn.Module, handle: ModelHandle) -> None:
        self.module = module
        self.rows = handle.row_exchange(int(module.max_ngram_size), "DeepseekV41NgramHash")

    def __call__(
        self,
        input_ids: torch.Tensor,
        *,
        token_mask: torch.Tensor | None = None,
        sequence_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.module
        ok = isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2
        problems, flags = ["input_ids must be [B, L] token ids (this rank's rows)."], []
        if ok:
            bad = ((input_ids < 0) | (input_ids >= h.token_map.numel())).any()
            problems, flags = [], [(bad, "input_ids holds a token id outside the vocabulary.")]
        cu = None if sequence_ids is None else RECORDED  # cp_nemo_batch records them
        plan = self.rows.agree(input_ids, cu_seqlens=cu, problems=problems, flags=flags)
        compressed = h.token_map[input_ids.long()]  # [B, L]
        if token_mask is not None:
            compressed = torch.where(token_mask, compressed, -1)
        ext = plan.exchange(compressed)  # [B, E]
        n = int(h.max_ngram_size)
        look = torch.as_tensor(plan.lookback, device=ext.device)  # [L, n]
        blocked = torch.zeros(compressed.shape, dtype=torch.bool, device=ext.device)
        if sequence_ids is not None:
            blocked = blocked | (sequence_ids == 0)
        tokens = []
        for shift in range(n):
            rows = look[:, shift]
            source = ext[:, rows.clamp_min(0)]
            blocked = blocked | (rows < 0)[None, :] | (source == -1)
            tokens.append(torch.where(blocked, h.pad_id, source))
        products = torch.stack(tokens, dim=-1).unsqueeze(2) * h.multipliers
        rolling, hashes = products[..., 0], []
        for shift in range(1, n):
            rolling = torch.bitwise_xor(rolling, products[..., shift])
            head = (shift - 1) * h.n_heads
            hashes.append(rolling.unsqueeze(-1) % h.primes[:, head : head + h.n_heads])
        return torch.cat(hashes, dim=-1) + h.offsets


# --------------------------------------------------------------------------- enable / batch


def _check_candidates(layers: list[nn.Module]) -> None:
    """A Full layer after the two-level indexer's candidate source starts a new NeMo state
    without the candidate blocks the layers after it would select among (NeMo's own forward
    then fails): refuse it before anything is installed."""
    for m in layers:
        ix = m.indexer
        if layer_role(m) == "full" and ix is not None and ix.uses_candidates:
            sources = [o.layer_idx for o in layers if o.indexer and o.indexer.is_candidate_source]
            cand = sources[0] if sources else "?"
            raise HpCpError(
                f"Full layer {m.layer_idx} comes after candidate source {cand}: its new state "
                "drops the candidate blocks the later layers select among. Make the candidate "
                "source the last KV source, or set candidate_source_layer_id -1."
            )


def prepare_v41_model(model: nn.Module, layers: list[nn.Module], handle: ModelHandle) -> None:
    """The model-level part of V4.1 under CP, whichever ``enable_cp`` was called: refuse
    NeMo's own CP and a candidate schedule hp_cp cannot plan, run every Engram hash under CP
    (:class:`EngramHashCP`), and guard each call against NeMo's CP."""
    holders = [mod for mod in model.modules() if hasattr(mod, "cp_mesh")]
    if any(layer.cp_group is not None for layer in layers) or any(
        getattr(h, "cp_mesh", None) is not None for h in holders
    ):
        raise HpCpError(_NEMO_CP_ON)
    _check_candidates(layers)
    for hasher in [mod for mod in model.modules() if type(mod).__name__ == "DeepseekV41NgramHash"]:
        if handle.cp_size == 1 and handle.config.single_rank_bypass:
            continue
        handle.on_disable(install_forward(hasher, EngramHashCP(hasher, handle)))

    def guard(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if kwargs.get("cp_group") is not None or any(
            getattr(h, "cp_mesh", None) is not None for h in holders
        ):
            raise HpCpError(_NEMO_CP_ON)

    handle.on_disable(model.register_forward_pre_hook(guard, with_kwargs=True).remove)


def v41_batch_inputs(handle: CPHandle, batch: CPBatch, input_ids: torch.Tensor) -> dict[str, Any]:
    """NeMo V4.1's keyword arguments for one batch of the core's batch path: ``input_ids``,
    ``position_ids`` (``[B, local rows]``) and, packed, ``packed_seq_ids`` (document
    ``1 ..``, the padding 0) and ``attention_mask`` of this rank's rows, with the packed
    boundaries recorded for the layers (V4.1 hands them per-row document ids only)."""
    plan = batch.plan
    out: dict[str, Any] = {
        "input_ids": batch.input_ids,
        "position_ids": batch.position_ids.expand(int(input_ids.shape[0]), -1).contiguous(),
    }
    if plan.packed:
        ids = np.where(np.arange(plan.padded_rows) < plan.rows, plan.documents + 1, 0)
        ids_t = torch.as_tensor(ids, dtype=torch.long, device=input_ids.device).unsqueeze(0)
        out["packed_seq_ids"] = handle.shard(ids_t, 1)
        out["attention_mask"] = out["packed_seq_ids"] > 0
        handle.sequence.record_documents(plan.cu_seqlens)
    return out

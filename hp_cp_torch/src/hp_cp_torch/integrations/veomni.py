"""VeOmni's DeepSeek V4 (``veomni.models.transformers.deepseek_v4``, 0.1.12) under hp_cp CP.

VeOmni's model is generated from transformers' ``modeling_deepseek_v4``; its attention layer
has the same parameters and op sequence (the indexer's ``weights_proj`` sits on the indexer
instead of ``indexer.scorer``), so the layers run through the HF integration's adapter
(:class:`~hp_cp_torch.integrations.transformers.DeepseekV4AttentionAdapter`) with VeOmni's
own ``apply_rotary_pos_emb`` and eager indexer score. Each rank then calls::

    handle = hp_cp_core.enable_cp(model, mesh)
    batch = cp_veomni_batch(handle, input_ids)  # or position_ids=/cu_seq_lens= when packed
    out = model(**batch.model_inputs(), use_cache=False)
    loss = cp_causal_lm_loss(out.logits, batch.labels, batch.n_tokens)

VeOmni's own sequence parallelism (``init_parallel_state(cp_size>1)`` or Ulysses) must be
off: ``enable_cp`` (:func:`prepare_veomni_model`) and every CP forward raise one
:class:`~hp_cp_core.HpCpError` on every rank (the parallel state is the same on every rank,
so no collective runs first).

Packed input in VeOmni's format (one row, ``position_ids`` restarting at each document,
``cu_seq_lens_q`` spanning the row) becomes hp_cp's ``cu_seqlens``: the documents are not
re-padded; only the row's end is padded to what the layout needs, as its own document.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hp_cp_core import CPBatch, HpCpError, cu_seqlens_from_positions
from hp_cp_torch._removed import ADAPTER_FOR, DISABLE, ENABLE, removed_names
from hp_cp_torch.integrations.transformers import (
    DeepseekV4AttentionAdapter,
    ModelCallInputs,
    cp_causal_lm_loss,
    cp_shift_labels,
    cp_sum_gradients,
)
from hp_cp_torch.model.spec import ForwardState
from hp_cp_torch.model.validation import TensorChecks

__all__ = [
    "VEOMNI_MODELING",
    "VeOmniBatch",
    "VeOmniDeepseekV4AttentionAdapter",
    "cp_causal_lm_loss",
    "cp_shift_labels",
    "cp_sum_gradients",
    "cp_veomni_batch",
    "prepare_veomni_model",
]

__getattr__ = removed_names(
    __name__, enable_cp=ENABLE, disable_cp=DISABLE, veomni_adapter_for=ADAPTER_FOR
)

VEOMNI_MODELING = (
    "veomni.models.transformers.deepseek_v4.generated.patched_modeling_deepseek_v4_gpu"
)


def _veomni_sp_problem() -> str | None:
    """Why VeOmni's own sequence parallelism is on, else ``None`` (no collective)."""
    ps_mod = sys.modules.get("veomni.distributed.parallel_state")
    if ps_mod is None:
        return None
    try:
        state = ps_mod.get_parallel_state()
    except Exception:  # noqa: BLE001 - no parallel state initialised: VeOmni's CP is off
        return None
    cp = int(getattr(state, "cp_size", 1) or 1)
    ulysses = int(getattr(state, "ulysses_size", 1) or 1)
    if cp > 1 or ulysses > 1:
        return (
            f"VeOmni's own sequence parallelism is on (cp_size={cp}, ulysses_size={ulysses}); "
            "it and hp_cp would both shard the sequence. Call "
            "veomni.distributed.parallel_state.init_parallel_state(...) with cp_size=1 and "
            "ulysses_size=1 and let hp_cp's enable_cp(model, mesh) own the CP dimension."
        )
    return None


def prepare_veomni_model(model: nn.Module, layers: list[nn.Module], handle: Any) -> None:
    """The model-level part of VeOmni under CP, whichever ``enable_cp`` was called: refuse
    VeOmni's own CP / Ulysses (an :class:`~hp_cp_core.HpCpError` on every rank, before
    anything is installed; each CP forward checks it again)."""
    problem = _veomni_sp_problem()
    if problem is not None:
        raise HpCpError(f"enable_cp on {type(model).__name__}: {problem}")


class VeOmniDeepseekV4AttentionAdapter(DeepseekV4AttentionAdapter):
    """The HF adapter on VeOmni's generated copy of ``DeepseekV4Attention`` (its own
    ``apply_rotary_pos_emb``, read from the layer's modeling file by the HF adapter)."""

    traits = dataclasses.replace(
        DeepseekV4AttentionAdapter.traits,
        # VeOmni's packed indexer scores one row of every slot of the packed stream, the
        # query's own document visible (``packed_compressed_causal_ranges``)
        packed_topk_row="stream",
    )

    @classmethod
    def prepare_model(cls, model: nn.Module, layers: list[nn.Module], handle: Any) -> None:
        prepare_veomni_model(model, layers, handle)

    def index_scores(self, state: ForwardState, lo: int, hi: int, keys: torch.Tensor) -> Any:
        """VeOmni's eager indexer score: ``sum_h w_h * relu(q_h . k) * scale`` (fp32)."""
        ix, q, x = self.module.compressor.indexer, state.index_queries[:, lo:hi], state.hidden
        scores = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))
        scores = F.relu(scores) * ix.softmax_scale  # [B, l, H, N]
        weights = ix.weights_proj(x[:, lo:hi]).float() * ix.weights_scaling  # [B, l, H]
        return (scores * weights.unsqueeze(-1)).sum(dim=2)

    def check_inputs(self, inputs: ModelCallInputs, checks: TensorChecks) -> None:
        """The HF adapter's, VeOmni's own sequence parallelism, and its packing metadata."""
        super().check_inputs(inputs, checks)
        problem = _veomni_sp_problem()
        if problem is not None:
            checks.fail(problem)
        for key in ("packed_sequence_slices", "packed_compression_metadata"):
            if inputs.kwargs.get(key) is not None:
                checks.fail(
                    f"got VeOmni's {key} under hp_cp: pass the batch of cp_veomni_batch "
                    "(packed boundaries as hp_cp_cu_seqlens), not cu_seq_lens_q."
                )


VeOmniBatch = CPBatch
"""The 0.2 name of what :func:`cp_veomni_batch` returns: the core's :class:`~hp_cp_core.CPBatch`
(a plain alias)."""


def _packed_bounds(seq_len: int, position_ids: Any, cu_seq_lens: Any) -> Any:
    """VeOmni's packed row (``cu_seq_lens_q``, else per-document ``position_ids``) as
    boundaries for ``handle.batch``; ``None`` for a padded batch or a row of one document."""
    if cu_seq_lens is not None:
        bounds = torch.as_tensor(cu_seq_lens).reshape(-1).cpu().numpy()
        if bounds[0] != 0 or bounds[-1] != seq_len or (np.diff(bounds) < 0).any():
            raise HpCpError(
                f"cu_seq_lens must rise from 0 to the row length {seq_len}, got "
                f"{bounds.tolist()}; pass VeOmni's cu_seq_lens_q of the whole packed row."
            )
        return bounds
    if position_ids is None:
        return None
    return cu_seqlens_from_positions(torch.as_tensor(position_ids).cpu().numpy(), seq_len)


def cp_veomni_batch(
    handle: Any,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> CPBatch:
    """VeOmni's batch format on the one batch path (:meth:`hp_cp_core.CPHandle.batch`).

    ``input_ids`` / ``labels`` are FULL ``[B, S]``. Padded batches: omit ``position_ids``.
    Packed (VeOmni's format, ``B == 1``): per-document ``position_ids`` and / or
    ``cu_seq_lens`` (VeOmni's ``cu_seq_lens_q``) become ``cu_seqlens``; each document's last
    token gets no target, the row end is padded as its own document, the documents are not
    re-padded. ``batch.model_inputs()`` is the model call's keyword arguments.
    """
    if input_ids.dim() != 2:
        raise HpCpError(f"input_ids must be [B, S], got shape {list(input_ids.shape)}.")
    batch, seq_len = input_ids.shape
    labels = input_ids if labels is None else labels
    if labels.shape != input_ids.shape:
        raise HpCpError(
            f"labels shape {list(labels.shape)} != input_ids shape {list(input_ids.shape)}."
        )
    bounds = _packed_bounds(seq_len, position_ids, cu_seq_lens)
    if bounds is not None and batch != 1:
        raise HpCpError(f"packed input needs batch size 1, got {batch}; pack into one row.")
    return handle.batch(input_ids, labels=labels, cu_seqlens=bounds, ignore_index=ignore_index)

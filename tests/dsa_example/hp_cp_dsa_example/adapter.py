"""The hp_cp model adapter of :class:`hp_cp_dsa_example.model.SparseAttention`.

Registered in this package's ``pyproject.toml`` (the entry point's name is the modeling
class, its value this adapter class), group ``hp_cp.torch_models``.

DSA is ``LayerSpec(compress_ratio=1, window_size=0, has_indexer=True)``: every token is its
own slot, so the projection's rows are the slots (``Traits(rows_are_slots=True)``: no
compressor) and each rank receives the K and V rows (and, on a layer with its own indexer,
the index keys) of the earlier tokens its queries can see. The layer without an indexer
reuses the previous layer's picks (``reuses=("selection",)``): hp_cp hands them on, the
``picks`` argument the model passes is not read. Only the model's math is here, as the
hooks of :class:`hp_cp_torch.model.spec.ModelAdapter`; the rest is hp_cp's runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hp_cp_core import LayerSpec
from hp_cp_torch.model.spec import (
    AttentionParams,
    ForwardState,
    IndexerParams,
    LayerInputs,
    ModelAdapter,
    Projection,
    Traits,
)
from hp_cp_torch.model.validation import TensorChecks


@dataclass
class RotaryInputs(LayerInputs):
    """The layer's call: ``LayerInputs`` and the ``(cos, sin)`` table of its local rows."""

    position_embeddings: Any = None


class SparseAttentionAdapter(ModelAdapter):
    claims = ("hp_cp_dsa_example.model.SparseAttention",)  # also named by the entry point
    traits = Traits(packed_topk_row="document", rows_are_slots=True)

    def layer_spec(self) -> LayerSpec:
        shares = self.module.indexer is None  # the previous layer's picks
        return LayerSpec(
            compress_ratio=1,
            window_size=0,
            has_indexer=True,
            reuses=("selection",) if shares else (),
        )

    def read_inputs(
        self, hidden, position_embeddings, cu_seqlens=None, picks=None
    ) -> RotaryInputs:  # as the model calls the layer; hp_cp hands the picks on itself
        return RotaryInputs(hidden, cu_seqlens=cu_seqlens, position_embeddings=position_embeddings)

    def check_inputs(self, inputs: RotaryInputs, checks: TensorChecks) -> None:
        checks.layer_input(self.module, inputs, hidden_size=self.module.dim)
        table = inputs.position_embeddings
        if not (isinstance(table, tuple) and len(table) == 2):
            checks.fail("position_embeddings must be the (cos, sin) pair of the decoder's rotary")
            return
        x, (cos, sin) = inputs.hidden, table
        for name, t in (("cos", cos), ("sin", sin)):
            if checks.tensor(name, t, (3,), "[B or 1, L, head_dim] (the local rows' table)"):
                checks.same("rows", {"x": (x, x.dim() - 2), name: (t, 1)})

    def project(self, state: ForwardState) -> Projection:
        m, x = self.module, state.hidden
        cos, sin = state.inputs.position_embeddings
        q, k, v = m.project(x, cos, sin)  # the model's own ops
        kv = torch.cat([k.flatten(2), v.flatten(2)], dim=-1)  # [k_0 k_1 ; v_0 v_1]
        if m.indexer is None:
            return Projection(q, kv)
        state.index_queries = m.indexer.queries(x.detach(), cos, sin)
        return Projection(q, kv, index_keys=m.indexer.keys(x.detach(), cos, sin))

    def index_scores(
        self, state: ForwardState, lo: int, hi: int, keys: torch.Tensor
    ) -> torch.Tensor:
        q, w = state.index_queries
        return self.module.indexer.scores(q[:, lo:hi], w[:, lo:hi], keys)

    def indexer_params(self) -> IndexerParams | None:
        m = self.module
        if m.indexer is None:
            return None
        return IndexerParams(topk=m.topk, heads=m.indexer.heads, loss_coeff=m.loss_coeff)

    def attention_params(self) -> AttentionParams:
        m = self.module  # no sink: sink=None
        return AttentionParams(scale=m.scale, kind="grouped", kv_heads=m.kv_heads)

    def output(self, o: torch.Tensor, state: ForwardState) -> torch.Tensor:
        return self.module.o_proj(o.flatten(2))

    def finish(self, out: torch.Tensor, state: ForwardState) -> tuple:
        return out, state.selected  # the model's (out, picks)

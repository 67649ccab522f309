"""The hp_cp model adapter of :class:`hp_cp_model_example.model.PooledAttention`.

Registered in this package's ``pyproject.toml`` (the entry point's name is the modeling
class, its value this adapter class), group ``hp_cp.torch_models``.

Only the model's math, as the hooks of :class:`hp_cp_torch.model.spec.ModelAdapter`:
everything else (checks, exchanges, selection, kernels, install) is hp_cp's runner.
"""

from __future__ import annotations

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


class PooledAttentionAdapter(ModelAdapter):
    claims = ("hp_cp_model_example.model.PooledAttention",)  # also named by the entry point
    traits = Traits(packed_topk_row="document")  # torch.topk on each document's own row

    def layer_spec(self) -> LayerSpec:
        m = self.module
        return LayerSpec(
            compress_ratio=m.ratio, window_size=m.window, has_indexer=m.picker is not None
        )

    def read_inputs(self, hidden, pos=None, doc_bounds=None) -> LayerInputs:
        return LayerInputs(hidden, position_ids=pos, cu_seqlens=doc_bounds)

    def check_inputs(self, inputs: LayerInputs, checks) -> None:
        checks.layer_input(self.module, inputs, hidden_size=self.module.dim)

    def project(self, state: ForwardState) -> Projection:
        q, kv = self.module.project(state.hidden, state.positions)  # the model's own op
        return Projection(q, kv)

    def _slot_positions(self, rows: torch.Tensor, start: int) -> torch.Tensor:
        ratio = self.module.ratio
        return start + torch.arange(rows.shape[1] // ratio, device=rows.device) * ratio

    def compress(self, rows: torch.Tensor, start: int, state: ForwardState) -> torch.Tensor:
        return self.module.pooler(rows, self._slot_positions(rows, start))

    def compress_index_keys(self, rows, start: int, state: ForwardState) -> torch.Tensor:
        return self.module.picker.pooler(rows, self._slot_positions(rows, start))

    def index_queries(self, state: ForwardState) -> tuple[torch.Tensor, torch.Tensor]:
        return self.module.picker.queries(state.hidden.detach(), state.positions)

    def index_scores(self, state: ForwardState, lo: int, hi: int, keys: torch.Tensor):
        q, w = state.index_queries
        return self.module.picker.scores(q[:, lo:hi], w[:, lo:hi], keys)

    def indexer_params(self) -> IndexerParams | None:
        picker = self.module.picker
        return None if picker is None else IndexerParams(topk=picker.topk, heads=picker.heads)

    def attention_params(self) -> AttentionParams:
        return AttentionParams(scale=self.module.scale, sink=self.module.sink)

    def output(self, o: torch.Tensor, state: ForwardState) -> torch.Tensor:
        return self.module.to_out(o.flatten(2))

"""The example's adapter as hp_cp 0.3.0's guide wrote it, kept unchanged: an adapter written
against 0.3.0's ``ModelAdapter`` keeps working through 0.4, each 0.3 name warning with the hook
that replaces it (``tests/torch/test_model_spec.py``). Not registered by an entry point: the
tests register it in-process. The 0.4 adapter is :mod:`hp_cp_model_example.adapter`.
"""

from __future__ import annotations

import torch

from hp_cp_core import LayerSpec
from hp_cp_torch.model.spec import ForwardState, LayerInputs, ModelAdapter, Projection


class PooledAttentionAdapter(ModelAdapter):
    claims = ("hp_cp_model_example.model.PooledAttention",)  # also named by the entry point
    packed_topk_row = "document"  # the model calls torch.topk on each document's own row

    def layer_spec(self) -> LayerSpec:
        m = self.module
        return LayerSpec(
            compress_ratio=m.ratio, window_size=m.window, has_indexer=m.picker is not None
        )

    def hidden_size(self) -> int:
        return self.module.dim

    def read_inputs(self, hidden, pos=None, doc_bounds=None) -> LayerInputs:
        return LayerInputs(hidden, position_ids=pos, cu_seqlens=doc_bounds)

    def project(self, state: ForwardState) -> Projection:
        q, kv = self.module.project(state.hidden, state.positions)  # the model's own op
        return Projection(q, kv)

    def _slot_positions(self, rows: torch.Tensor, start: int) -> torch.Tensor:
        ratio = self.module.ratio
        return start + torch.arange(rows.shape[1] // ratio, device=rows.device) * ratio

    def compress(self, rows: torch.Tensor, start: int) -> torch.Tensor:
        return self.module.pooler(rows, self._slot_positions(rows, start))

    def compress_index_keys(self, rows: torch.Tensor, start: int) -> torch.Tensor:
        return self.module.picker.pooler(rows, self._slot_positions(rows, start))

    def index_queries(self, state: ForwardState) -> tuple[torch.Tensor, torch.Tensor]:
        return self.module.picker.queries(state.hidden.detach(), state.positions)

    def index_scores(self, state: ForwardState, lo: int, hi: int, keys: torch.Tensor):
        q, w = state.index_queries
        return self.module.picker.scores(q[:, lo:hi], w[:, lo:hi], keys)

    def index_topk(self) -> int:
        return self.module.topk

    def sink(self) -> torch.Tensor:
        return self.module.sink

    def scale(self) -> float:
        return self.module.scale

    def output(self, o: torch.Tensor, state: ForwardState) -> torch.Tensor:
        return self.module.to_out(o.flatten(2))

"""A third party's model adapter written against hp_cp 0.3.0's ``ModelAdapter``, kept as it
was: it must keep running through 0.4 (each 0.3 name warns, naming the hook that replaces it).

:class:`ThirdPartyAdapter` runs the reference layer the way a third party brought its own
model in 0.3: a compressor that reads the forward's state (``compress(rows, start, state)``),
its own indexer student (``index_scores_at``), the indexer's constants and the attention's as
0.3's separate methods. ``indexer_loss_cases.run_loss_case_cp(case, "v03")`` trains with it
under CP against one process (``test_indexer_loss.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from hp_cp_core import LayerSpec
from hp_cp_torch.model.spec import ForwardState, LayerInputs, ModelAdapter, Projection


class ThirdPartyAdapter(ModelAdapter):
    def layer_spec(self) -> LayerSpec:
        m = self.module
        return LayerSpec(
            compress_ratio=m.compress_ratio,
            window_size=m.window_size,
            has_indexer=m.indexer is not None,
        )

    def read_inputs(self, x, position_ids=None, cu_seqlens=None, loss_mask=None) -> LayerInputs:
        return LayerInputs(x, position_ids, cu_seqlens, loss_mask)

    def project(self, state: ForwardState) -> Projection:
        q, kv, qr = self.module.project(state.hidden, state.positions)
        return Projection(q, kv, index_input=qr)

    def compress(self, rows: torch.Tensor, start: int, state: ForwardState) -> torch.Tensor:
        assert state.hidden.shape[-1] == rows.shape[-1]  # the forward's state reaches it
        return self.module.compressor(rows, start)

    def compress_index_keys(self, rows: torch.Tensor, start: int, state: Any) -> torch.Tensor:
        return self.module.indexer.compressor(rows, start)

    def index_queries(self, state: ForwardState) -> tuple[torch.Tensor, torch.Tensor]:
        ix, qr = self.module.indexer, state.projection.index_input
        return ix.queries(qr.detach(), state.positions), ix.weights(state.hidden.detach())

    def index_scores(self, state: ForwardState, lo: int, hi: int, keys: torch.Tensor) -> Any:
        q, w = state.index_queries
        return self.module.indexer.scores(q[:, lo:hi], w[:, lo:hi], keys)

    def index_scores_at(
        self, state: ForwardState, keys: torch.Tensor, selected: torch.Tensor
    ) -> torch.Tensor:
        """``sum_h w * relu(q . k)`` at each query's picks, written out."""
        q, w = state.index_queries
        batch, rows, k = selected.shape
        if keys.shape[1] == 0:
            keys = torch.cat([keys, keys.new_zeros(batch, 1, keys.shape[2])], dim=1)
        ids = selected.clamp(min=0).reshape(batch, rows * k, 1).expand(-1, -1, keys.shape[-1])
        picked = torch.gather(keys, 1, ids).view(batch, rows, k, -1).float()
        logits = torch.einsum("blhd,blkd->blhk", q.float(), picked).relu()
        return torch.einsum("blhk,blh->blk", logits, w.float())

    def index_topk(self) -> int:
        return int(self.module.config.index_topk)

    def index_heads(self) -> int:
        return int(self.module.indexer.n_heads)

    def indexer_loss_coeff(self) -> float | None:
        m = self.module
        return m.config.indexer_loss_coeff if m.computes_indexer_loss else None

    def sink(self) -> torch.Tensor:
        return self.module.attn_sink

    def scale(self) -> float:
        return self.module.softmax_scale

    def output(self, o: torch.Tensor, state: ForwardState) -> torch.Tensor:
        return self.module.output(o, state.positions)

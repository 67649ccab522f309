"""The indexer top-k as a model on one process picks it (Note [The one-process top-k row]):
``select_topk_chunked(..., one_process_row=...)`` on every rank's plan keeps exactly the slots
``torch.topk`` keeps on the row of every slot of the sequence (or document), where many scores
tie exactly at 0 (ReLU scores), for both layouts, padded (with ``handle.shard``'s padding
left out of the row) and packed, for CSA (r = 4) and DSA (r = 1, no window: a slot per
token)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hp_cp_core import LayerSpec
from hp_cp_core.plan import build_rank_plan
from hp_cp_torch.attention import select_topk_chunked
from hp_cp_torch.bench.memory import live_tensor_peak

TOPK = 6
SPECS = {
    4: LayerSpec(compress_ratio=4, window_size=24, has_indexer=True),
    1: LayerSpec(compress_ratio=1, window_size=0, has_indexer=True),
}


def _scores(rows: int, slots: int, seed: int) -> torch.Tensor:
    """Indexer-like scores: most exactly 0 (no head above 0), a few positive, some negative."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(1, rows, slots, generator=g)
    s = torch.where(torch.rand(1, rows, slots, generator=g) < 0.6, torch.zeros(()), s)
    return s.clamp(max=0.0).where(torch.rand(1, rows, slots, generator=g) < 0.7, s)


def _one_process(
    scores: torch.Tensor,
    rows: np.ndarray,
    starts: list[int],
    ends: list[int],
    row_start: int,
    row_len: int,
) -> list[set[int]]:
    out = []
    for g, a, b in zip(rows, starts, ends):
        row = torch.full((row_len,), float("-inf"))
        vis = scores[0, g, a:b]
        row[a - row_start : b - row_start] = vis
        values, ids = torch.topk(row, min(TOPK, row_len))
        out.append({int(i) + row_start for v, i in zip(values, ids) if not torch.isneginf(v)})
    return out


@pytest.mark.parametrize("layout", ["contiguous", "load_balanced"])
@pytest.mark.parametrize(
    "cp, total, real, cu",
    [
        (3, 612, 611, None),
        (2, 304, 304, None),
        (4, 536, 533, [0, 100, 237, 533, 536]),
    ],
)
@pytest.mark.parametrize("packed_row", ["document", "stream"])
@pytest.mark.parametrize("R", [4, 1])
def test_picks_equal_torch_topk_on_the_one_process_row(
    layout: str, cp: int, total: int, real: int, cu: list[int] | None, packed_row: str, R: int
) -> None:
    spec = SPECS[R]
    cu_np = None if cu is None else np.array(cu, dtype=np.int64)
    docs = np.array(cu if cu is not None else [0, total], dtype=np.int64)
    doc_slots = np.diff(docs) // R
    slot_cu = np.concatenate([[0], np.cumsum(doc_slots)])
    n_slots = int(slot_cu[-1])
    scores = _scores(total, n_slots, seed=cp + total)
    differs_from_lower_index = 0
    for rank in range(cp):
        plan = build_rank_plan(
            rank=rank,
            cp_size=cp,
            spec=spec,
            layout_kind=layout,
            total_rows=total,
            cu_seqlens=cu_np,
        )
        rows = plan.local_rows
        got = select_topk_chunked(
            lambda lo, hi, s0, s1: scores[:, rows[lo:hi], s0:s1],
            plan,
            TOPK,
            37,
            batch=1,
            one_process_row=packed_row,
            sequence_rows=None if real == total else real,
            cu_seqlens=cu_np,
        )
        plain = select_topk_chunked(
            lambda lo, hi, s0, s1: scores[:, rows[lo:hi], s0:s1], plan, TOPK, 37, batch=1
        )
        for q, g in enumerate(rows):
            if g >= real:
                continue  # the layout's padding: no one-process row
            d = int(np.searchsorted(docs, g, side="right") - 1)
            a = int(plan.cmp_start[q])
            b = a + int(plan.cmp_count[q])
            if cu is None:
                start, length = 0, real // R
            elif packed_row == "document":
                start, length = int(slot_cu[d]), int(doc_slots[d])
            else:
                start, length = 0, int(slot_cu[3])  # the three real documents
            (want,) = _one_process(scores, np.array([g]), [a], [b], start, length)
            assert {int(i) for i in got[0, q] if i >= 0} == want, (rank, q, int(g))
            differs_from_lower_index += {int(i) for i in plain[0, q] if i >= 0} != want
    assert differs_from_lower_index > 0  # the ties really decide picks here


def test_each_chunk_is_scored_with_no_earlier_chunk_alive() -> None:
    """The busiest rank's peak is one chunk's scoring (per-head scores, then their sum): no
    earlier chunk's masked scores stay alive through it (they did: a fifth more). The
    one-process row, as every integration picks; hp_cp's own top-k peaks in its int64 keys."""
    plan = build_rank_plan(
        rank=0, cp_size=1, spec=SPECS[1], layout_kind="contiguous", total_rows=2048
    )
    cells = []

    def score(lo: int, hi: int, s0: int, s1: int) -> torch.Tensor:
        cells.append((hi - lo) * (s1 - s0))
        return torch.rand(4, 1, hi - lo, s1 - s0).sum(0)  # four heads' scores, summed

    def select() -> None:
        select_topk_chunked(score, plan, TOPK, 256, batch=1, one_process_row="stream")

    peak = live_tensor_peak(select)
    scoring = 5 * 4 * max(cells)  # the last chunk's four heads and their sum, fp32
    assert len(cells) == 8
    assert peak < scoring * 1.05, (peak, scoring)


def test_chunks_bound_the_per_head_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every integration's score callable builds the per-head scores ``[rows, heads, slots]``
    in fp32 before summing the heads; with ``score_heads`` a chunk keeps them under
    ``SCORE_HEAD_CELLS`` (they were outside every budget: at V4-Flash's 64 index heads the
    rows of ``SCORE_CHUNK_CELLS`` alone let them reach 1 GiB). The budgets are scaled down to
    this tiny shape; the picks do not depend on the chunking."""
    from hp_cp_torch import attention

    heads, total = 64, 1024
    monkeypatch.setattr(attention, "SCORE_CHUNK_CELLS", 1 << 14)
    monkeypatch.setattr(attention, "SCORE_HEAD_CELLS", 1 << 16)
    plan = build_rank_plan(
        rank=0, cp_size=1, spec=SPECS[1], layout_kind="contiguous", total_rows=total
    )
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, total, heads, 8, generator=g).bfloat16()
    keys = torch.randn(1, total, 8, generator=g).bfloat16()
    w = torch.randn(1, total, heads, generator=g)
    cells: list[int] = []

    def score(lo: int, hi: int, s0: int, s1: int) -> torch.Tensor:
        per_head = torch.einsum("blhd,bnd->blhn", q[:, lo:hi].float(), keys[:, s0:s1].float())
        cells.append(per_head.numel())
        return torch.einsum("blhn,blh->bln", per_head.relu_(), w[:, lo:hi])

    def select(score_heads: int) -> torch.Tensor:
        return select_topk_chunked(score, plan, TOPK, total, batch=1, score_heads=score_heads)

    by_heads = select(heads)
    assert max(cells) <= 1 << 16
    peak = live_tensor_peak(lambda: select(heads))
    assert peak < 3 * 4 * (1 << 16), peak  # one chunk's fp32 per-head scores, and the rest
    cells.clear()
    unbounded = select(1)
    assert max(cells) > 1 << 18  # what the budget ignored: 16 rows x 64 heads x 1024 slots
    assert torch.equal(by_heads, unbounded)

"""The device-side inverse of the indexer's picks (:mod:`hp_cp_torch.kernels.pool_index`) against a
numpy reference written here: per pool row, its ``(query row, column)`` readers sorted by
query row, then column."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hp_cp_torch.kernels.pool_index import build_inverted_index

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(idx: np.ndarray, n_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The CSR by brute force: walk the rows, collect their readers in (query, column) order."""
    offsets, queries, columns = [0], [], []
    for r in range(n_rows):
        t, c = np.nonzero(idx == r)  # row-major: by query, then column
        queries += t.tolist()
        columns += c.tolist()
        offsets.append(len(queries))
    return np.array(offsets), np.array(queries, dtype=np.int64), np.array(columns, dtype=np.int64)


def picks(seq: int, k: int, n_rows: int, seed: int, p_empty: float = 0.3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, max(n_rows, 1), size=(seq, k))
    return np.where(rng.random((seq, k)) < p_empty, -1, idx) if n_rows else np.full((seq, k), -1)


CASES = {
    "duplicates, K not a power of two": (picks(9, 7, 5, 0), 5),
    "all -1": (np.full((4, 3), -1), 6),
    "empty pool rows": (picks(6, 5, 40, 1), 40),  # most rows read by nobody
    "single row": (np.array([[3, 3, -1, 0, 3]]), 4),
    "one column, every row read": (np.arange(8)[::-1, None] % 4, 4),
    "no columns": (np.zeros((3, 0), dtype=np.int64), 2),
    "no pool rows": (np.full((2, 2), -1), 0),
}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_numpy_reference(name, dtype):
    idx, n_rows = CASES[name]
    want = reference(idx, n_rows)
    got = build_inverted_index(torch.as_tensor(idx, dtype=dtype, device=DEVICE), n_rows)
    assert got.nnz == int((idx >= 0).sum())
    for a, b in zip((got.offsets, got.query_rows, got.columns), want):
        assert a.dtype == torch.int64
        assert np.array_equal(a.cpu().numpy(), b), (name, a, b)


def test_untrimmed_keeps_the_entries_of_rows_first():
    idx, n_rows = CASES["duplicates, K not a power of two"]
    offsets, queries, columns = reference(idx, n_rows)
    got = build_inverted_index(torch.as_tensor(idx, device=DEVICE), n_rows, trim=False)
    assert got.query_rows.numel() == idx.size
    assert np.array_equal(got.query_rows[: got.nnz].cpu().numpy(), queries)
    assert np.array_equal(got.columns[: got.nnz].cpu().numpy(), columns)
    rest = idx[got.query_rows[got.nnz :].cpu().numpy(), got.columns[got.nnz :].cpu().numpy()]
    assert (rest == -1).all()


def test_deterministic_mode_accepts_the_builder():
    idx, n_rows = CASES["duplicates, K not a power of two"]
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        got = build_inverted_index(torch.as_tensor(idx, device=DEVICE), n_rows)
    finally:
        torch.use_deterministic_algorithms(before)
    assert np.array_equal(got.offsets.cpu().numpy(), reference(idx, n_rows)[0])


def test_bad_shape_is_an_error():
    with pytest.raises(ValueError, match=r"\[S, K\]"):
        build_inverted_index(torch.zeros(2, 3, 4, dtype=torch.int64), 5)

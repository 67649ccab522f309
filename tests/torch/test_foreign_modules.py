"""Foreign modules under CP (issue 12): attention cores written from the DeepSeek V4
semantics alone, patched through the public API only (see ``foreign_cases.py``), equal one
device forward and backward (fp32, 1e-5) at cp 2, 3, 4, 8 and both layouts, including the
shapes that once deadlocked backward: a rank that owns no slot and receives no halo
(HCA, r = 128, W = 64, S = 384, cp = 4), L < r for r = 4 and 128, L < W - 1, an indexer whose
queries on some ranks see no slot, compressors returning fresh / detached / ``new_zeros``
tensors for empty input, attention that never touches ``cmp_kv`` on such ranks, and two
patched modules in a row.

Packed input too (issue 27): each module takes one packed stream with ``cu_seqlens`` and
is compared with the same module run on each document alone, the outputs concatenated, at
cp 2, 3, 4, 8 and both layouts: documents shorter than the window and than r (and empty),
documents spanning several ranks, a rank holding only the tail of one document. The modules'
indexers train through the attention logits (their picked score is a logit bonus); none has
an indexer KL loss, so there is none to compare.

One spawned job per cp size runs all of its cases under a wall limit, so a hang fails the
test, it does not stall CI. Run alone, its collectives time out after ``PG_TIMEOUT_S``
seconds; run with the other torch test modules it shares their job (``cases.JOINT_SUITES``).
"""

from __future__ import annotations

import pytest
from cases import result
from foreign_cases import PG_TIMEOUT_S, ForeignCase, check, foreign_cases

from hp_cp_core.layout import SequenceLayout

pytestmark = pytest.mark.slow

SUITE = "foreign_cases:foreign_suite"
WORLDS = (2, 3, 4, 8)


def _result(world: int, name: str) -> list[dict]:
    return result(SUITE, world, name, pg_timeout=PG_TIMEOUT_S)


PARAMS = [pytest.param(w, c, id=c.name) for w in WORLDS for c in foreign_cases(w)]


@pytest.mark.parametrize(("world", "case"), PARAMS)
def test_foreign_module_matches_single_device(world: int, case: ForeignCase) -> None:
    per_rank = _result(world, case.name)
    check(case, next(r for r in per_rank if r["cp_rank"] == 0))


def test_the_suite_covers_the_issue() -> None:
    cases = [c for w in WORLDS for c in foreign_cases(w)]
    assert {c.cp for c in cases} == set(WORLDS)
    assert {c.module for c in cases} == {"concat", "cmpfirst", "skipempty", "twolayers"}
    assert {c.layout for c in cases} == {"contiguous", "load_balanced"}
    # the reproducer, with every module
    repro = {c.module for c in cases if (c.cp, c.r, c.window, c.S) == (4, 128, 64, 384)}
    assert repro >= {"concat", "cmpfirst", "skipempty"}
    assert any(c.r == 4 and c.local < 4 for c in cases)
    assert any(c.r == 128 and c.local < 128 for c in cases)
    assert any(c.local < c.window - 1 for c in cases)


def _ranks_of_docs(case: ForeignCase) -> list[set[int]]:
    """Per document, the ranks holding its rows."""
    owner = SequenceLayout(case.layout, case.cp, case.S).rank_of(list(range(case.S)))
    cu = case.cu_seqlens
    return [{int(k) for k in owner[a:b]} for a, b in zip(cu[:-1], cu[1:])]


def _tail_only(case: ForeignCase) -> bool:
    """Some rank's rows all lie in the last part of one document that starts on another rank."""
    layout = SequenceLayout(case.layout, case.cp, case.S)
    cu = case.cu_seqlens
    for rank in range(case.cp):
        rows = layout.rank_rows(rank).tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            if a < rows[0] and rows[-1] == b - 1 and all(a <= t < b for t in rows):
                return True
    return False


def test_the_packed_cases_cover_the_issue() -> None:
    packed = [c for w in WORLDS for c in foreign_cases(w) if c.docs]
    assert {c.cp for c in packed} == set(WORLDS)
    assert {c.module for c in packed} >= {"concat", "cmpfirst", "skipempty"}
    assert {c.layout for c in packed} == {"contiguous", "load_balanced"}
    assert {c.r for c in packed} == {0, 4, 128}
    lengths = [(c, n) for c in packed for n in c.docs]
    assert any(0 < n < c.window for c, n in lengths)
    assert any(0 < n < c.r for c, n in lengths)
    assert any(n == 0 for _, n in lengths)
    assert any(len(ranks) >= 3 for c in packed for ranks in _ranks_of_docs(c))
    assert any(_tail_only(c) for c in packed)
    for w in WORLDS:  # at every cp size, both layouts and a document across ranks
        here = [c for c in packed if c.cp == w]
        assert {c.layout for c in here} == {"contiguous", "load_balanced"}
        assert any(len(ranks) > 1 for c in here for ranks in _ranks_of_docs(c))


def test_the_three_modules_are_one_semantics() -> None:
    """Written independently, the three modules agree on one device (same weights): a
    check of the modules themselves, so a parity failure points at CP, not at them."""
    from foreign_cases import single_device

    for r, S in ((128, 384), (4, 24), (0, 24)):
        outs = [
            single_device(ForeignCase(m, 4, r, S, window=64))
            for m in ("concat", "cmpfirst", "skipempty")
        ]
        for other in outs[1:]:
            assert (other["out"] - outs[0]["out"]).abs().max() <= 1e-5 * outs[0]["out"].abs().max()
            for a, b in zip(other["pgrads"], outs[0]["pgrads"]):
                if b is None:
                    assert a is None or not a.abs().any()
                else:
                    assert (a - b).abs().max() <= 1e-5 * b.abs().max()

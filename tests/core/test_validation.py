"""Validation before communication and cross-rank agreement, on the numpy fake backend.

Every check runs on each rank before any exchange; its verdict travels in the forward's one
metadata all-gather, so a problem on one rank, or ranks that disagree on the global metadata
(rows, cu_seqlens, tensor shapes, layer spec, config), make *every* rank raise the same
``HpCpError``. Each test asserts the message: the argument, its value and the fix.
See Note [Validate, agree, then communicate] in ``hp_cp_core.validation``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hp_cp_core import (
    DeepSeekV4CPConfig,
    HpCpError,
    LayerSpec,
    PlanError,
    disable_cp,
    enable_cp,
    hookimpl,
)
from hp_cp_core.plugins import PluginHost
from hp_cp_core.validation import (
    LocalCheck,
    agreement_message,
    check_group,
    check_layer_spec,
    check_rows,
    parse_cu_seqlens,
)
from hp_cp_fake import fake_backend as fb

# ------------------------------------------------------------------ local checks


def _cu_problem(cu: Any) -> str:
    check = LocalCheck(n_local=4)
    parse_cu_seqlens(cu, check)
    assert check.kind == 2, "a cu_seqlens problem is a PlanError"
    return check.message


@pytest.mark.parametrize(
    "cu, message",
    [
        (
            np.array([3, 8, 16]),
            "cu_seqlens must start at 0; got cu_seqlens[0] = 3 in [3, 8, 16]. Pass the "
            "boundaries of the whole packed sequence: [0, len(doc0), len(doc0) + len(doc1), "
            "..., S].",
        ),
        (
            [0, 9, 4, 16],
            "cu_seqlens must be non-decreasing; got cu_seqlens[2] = 4 < cu_seqlens[1] = 9 in "
            "[0, 9, 4, 16]. Pass cumulative document lengths (torch.cumsum of the lengths, "
            "with a leading 0).",
        ),
        (
            np.array([[0, 16]]),
            "cu_seqlens must be a 1-D sequence of integers (the global document boundaries "
            "[0, ..., S]); got shape [1, 2] of dtype int64. Pass e.g. torch.tensor([0, 5, 16]) "
            "or a list of ints.",
        ),
        (
            np.array([0.0, 2.5, 16.0]),
            "cu_seqlens must hold integers; got non-integer values [0.0, 2.5, 16.0]. Pass "
            "integer boundaries (torch.int32 / int64).",
        ),
        (
            [16],
            "cu_seqlens must have at least 2 entries [0, ..., S]; got [16]. Pass the boundaries "
            "of the whole packed sequence, e.g. [0, S] for one document.",
        ),
        (
            ["0", "a"],
            "cu_seqlens must be a 1-D sequence of integers (the global document boundaries "
            "[0, ..., S]); got shape [2] of dtype <U1. Pass e.g. torch.tensor([0, 5, 16]) or a "
            "list of ints.",
        ),
    ],
)
def test_cu_seqlens_problems_name_value_and_fix(cu: Any, message: str) -> None:
    assert _cu_problem(cu) == message


def test_integral_float_cu_seqlens_are_accepted() -> None:
    check = LocalCheck(n_local=4)
    parse_cu_seqlens(np.array([0.0, 5.0, 8.0]), check)
    assert check.ok and check.cu_seqlens.dtype == np.int64
    assert check.cu_seqlens.tolist() == [0, 5, 8]


def test_rows_must_fill_the_layout_and_cu_seqlens() -> None:
    check = LocalCheck(n_local=0)
    assert not check_rows(check, 2, "contiguous")
    assert check.message == (
        "this rank got 0 local rows; every rank needs at least one row. Shard a sequence of at "
        "least 2 rows with handle.shard(tensor, seq_dim)."
    )
    check = LocalCheck(n_local=3)
    assert not check_rows(check, 2, "load_balanced")
    assert check.message == (
        "a load_balanced layout over cp=2 ranks needs the sequence length to be a multiple of "
        "4; got 6 rows. Pad it at the end: handle.shard(t, dim, pad_value=...) pads tensors "
        "and handle.padding(rows).cu_seqlens(cu) the packed boundaries. (This rank holds 3 "
        "local rows: 6 in all if each of the 2 ranks holds as many.)"
    )
    check = LocalCheck(n_local=3, cu_seqlens=np.array([0, 4]))
    assert check_rows(LocalCheck(n_local=3), 2, "contiguous")
    assert not check_rows(check, 2, "contiguous")
    assert check.message == (
        "cu_seqlens ends at 4 but the ranks hold 3 x 2 = 6 rows. Pass the global cu_seqlens "
        "(the same on every rank) and each rank's local rows from handle.shard(x, 0)."
    )


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            LayerSpec(compress_ratio=4.0),
            "hp_cp_layer_spec for `ToyAttention` returned LayerSpec.compress_ratio=4.0 (float); "
            "expected an int. Convert it with int(...) in the hook.",
        ),
        (
            LayerSpec(compress_ratio=4, window_size="16"),
            "hp_cp_layer_spec for `ToyAttention` returned LayerSpec.window_size='16' (str); "
            "expected an int. Convert it with int(...) in the hook.",
        ),
        (
            LayerSpec(compress_ratio=4, has_indexer=1),
            "hp_cp_layer_spec for `ToyAttention` returned LayerSpec.has_indexer=1 (int); "
            "expected a bool. Convert it with bool(...) in the hook.",
        ),
        (
            (4, 128),
            "hp_cp_layer_spec returned a tuple for `ToyAttention`; expected a "
            "hp_cp_core.LayerSpec, got (4, 128). Return LayerSpec(compress_ratio=..., "
            "window_size=..., has_indexer=...) from the backend's hook.",
        ),
    ],
)
def test_unsupported_layer_spec_is_rejected_by_enable_cp(spec: Any, message: str) -> None:
    with pytest.raises(HpCpError) as err:
        check_layer_spec(spec, fb.ToyAttention())
    assert str(err.value) == message

    class Answer:
        @hookimpl(tryfirst=True)
        def hp_cp_layer_spec(self, module):
            return spec

    host = PluginHost(autoload=False)
    host.add(fb, "fake")
    host.add(Answer(), "answer")
    layer = fb.ToyAttention()
    with pytest.raises(HpCpError) as err:
        enable_cp(layer, fb.FakeMesh(fb.FakeWorld(2), 0), plugins=host)
    assert str(err.value) == message
    assert layer.cp_forward is None, "enable_cp installed a forward before raising"


class _Group:
    def __init__(self, rank: Any, size: Any) -> None:
        self.rank, self.size = rank, size


def test_group_must_contain_this_rank() -> None:
    check_group(_Group(1, 2), "mesh", "fake")
    for rank, size in ((-1, 2), (2, 2), (0, 0), (None, 2)):
        with pytest.raises(HpCpError) as err:
            check_group(_Group(rank, size), "mesh", "fake")
        assert str(err.value) == (
            f"backend 'fake' made a CP group of size {size!r} in which this process has rank "
            f"{rank!r} from enable_cp(mesh='mesh'); expected a rank in 0 .. size-1. Pass a mesh "
            "or group this process belongs to (each rank passes its own CP group)."
        )


def test_enable_cp_checks_the_backend_group(
    host: PluginHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = fb.FakeBackend.group

    def outside(self, mesh: Any) -> Any:
        group = original(self, mesh)
        group.rank = -1  # what torch reports on a rank outside a ProcessGroup
        return group

    monkeypatch.setattr(fb.FakeBackend, "group", outside)
    layer = fb.ToyAttention()
    with pytest.raises(HpCpError) as err:
        enable_cp(layer, fb.FakeMesh(fb.FakeWorld(2), 0), plugins=host)
    assert str(err.value).startswith(
        "backend 'fake' made a CP group of size 2 in which this process has rank -1 from "
        "enable_cp(mesh=<"
    )
    assert str(err.value).endswith("(each rank passes its own CP group).")
    assert layer.cp_forward is None


# ------------------------------------------------------------------ every rank raises


def run_ranks(
    host: PluginHost,
    cp: int,
    step: Callable[[int, fb.ToyAttention], Any],
    *,
    layer: Callable[[int], fb.ToyAttention] | None = None,
    config: Callable[[int], DeepSeekV4CPConfig] | None = None,
) -> tuple[list[BaseException | None], float, list[dict]]:
    """Each rank enables CP on its toy layer and runs ``step(rank, layer)``; returns each
    rank's exception (or ``None``), the seconds taken and the layer exchanges logged."""
    world = fb.FakeWorld(cp)

    def rank_fn(rank: int) -> BaseException | None:
        lay = layer(rank) if layer else fb.ToyAttention(compress_ratio=4, window_size=6)
        cfg = config(rank) if config else DeepSeekV4CPConfig()
        handle = enable_cp(lay, fb.FakeMesh(world, rank), cfg, plugins=host)
        try:
            step(rank, lay)
        except HpCpError as exc:
            return exc
        finally:
            disable_cp(handle)
        return None

    t0 = time.perf_counter()
    errors = world.run(rank_fn)
    return errors, time.perf_counter() - t0, list(world.log)


def _x(rows: int, width: int = 6) -> np.ndarray:
    return np.random.default_rng(rows).normal(size=(rows, width))


def assert_same_error(errors, elapsed, log, cls: type, message: str) -> None:
    """Every rank raised ``cls(message)``, fast, before any layer exchange."""
    assert elapsed < 20, "a rank waited on a collective the others never joined"
    assert all(type(e) is cls for e in errors), errors
    assert [str(e) for e in errors] == [message] * len(errors)
    assert log == [], f"data moved before the error: {log}"


def test_a_problem_on_one_rank_raises_on_every_rank(host: PluginHost) -> None:
    def step(rank: int, layer: fb.ToyAttention) -> None:
        cu = [1, 3, 12] if rank == 1 else [0, 5, 12]  # rank 1's does not start at 0
        layer(_x(4), cu_seqlens=np.array(cu))

    errors, elapsed, log = run_ranks(host, 3, step)
    assert_same_error(
        errors,
        elapsed,
        log,
        PlanError,
        "CP input check failed on rank 1 of 3 (every rank raises this error): cu_seqlens must "
        "start at 0; got cu_seqlens[0] = 1 in [1, 3, 12]. Pass the boundaries of the whole "
        "packed sequence: [0, len(doc0), len(doc0) + len(doc1), ..., S].",
    )


def test_backend_problems_travel_in_the_same_collective(host: PluginHost) -> None:
    """What a backend's own checks found (``problems=``) is raised everywhere as HpCpError,
    grouped by message when several ranks failed."""

    def step(rank: int, layer: fb.ToyAttention) -> None:
        fwd = layer.cp_forward
        problems = {1: ["x has dtype int8; cast it."], 2: ["x is on meta; move it."]}
        problems[3] = problems[1]
        check = fwd.inspect(4, problems=problems.get(rank, []))
        fwd.agree(check)

    errors, elapsed, log = run_ranks(host, 4, step)
    assert_same_error(
        errors,
        elapsed,
        log,
        HpCpError,
        "CP input checks failed on ranks [1, 2, 3] of 4 (every rank raises this error): "
        "[ranks [1, 3]] x has dtype int8; cast it. [rank 2] x is on meta; move it.",
    )


def test_the_same_problem_everywhere_keeps_its_own_message(host: PluginHost) -> None:
    errors, elapsed, log = run_ranks(
        host, 2, lambda rank, layer: layer(_x(4), cu_seqlens=np.array([0, 2, 4]))
    )
    assert_same_error(
        errors,
        elapsed,
        log,
        PlanError,
        "cu_seqlens ends at 4 but the ranks hold 4 x 2 = 8 rows. Pass the global cu_seqlens "
        "(the same on every rank) and each rank's local rows from handle.shard(x, 0).",
    )


def test_the_failing_rank_keeps_the_original_exception_as_cause(host: PluginHost) -> None:
    """A plan that cannot be built on one rank: that rank chains the planner's error."""

    def step(rank: int, layer: fb.ToyAttention) -> None:
        fwd = layer.cp_forward
        if rank == 1:  # the planner itself rejects what it is asked (a stand-in for a bug)
            fwd._plan = lambda n, cu: (_ for _ in ()).throw(ValueError("planner bug"))
        fwd.agree(fwd.inspect(4))

    errors, elapsed, log = run_ranks(host, 2, step)
    assert_same_error(
        errors,
        elapsed,
        log,
        HpCpError,
        "CP input check failed on rank 1 of 2 (every rank raises this error): building the CP "
        "plan failed: ValueError: planner bug",
    )
    assert errors[0].__cause__ is None
    assert isinstance(errors[1].__cause__, ValueError)


# ------------------------------------------------------------------ ranks that disagree

CU_FIX = (
    "Expected the same global cu_seqlens (the boundaries of the whole packed sequence, not of "
    "the local rows) on every rank, or None on every rank."
)


@pytest.mark.parametrize(
    "what, message",
    [
        (
            "rows",
            "CP ranks were given inconsistent inputs: local rows per rank [4, 4, 5]. Expected "
            "every rank to pass the same number of local rows: shard every input with "
            "handle.shard(tensor, seq_dim).",
        ),
        (
            "cu_seqlens",
            "CP ranks were given inconsistent inputs: cu_seqlens per rank [[0, 5, 12], "
            f"[0, 5, 12], [0, 7, 12]]. {CU_FIX}",
        ),
        (
            "packed",
            "CP ranks were given inconsistent inputs: cu_seqlens per rank [None, None, "
            f"[0, 12]]. {CU_FIX}",
        ),
        (
            "spec",
            "CP ranks were given inconsistent inputs: layer spec per rank [LayerSpec("
            "compress_ratio=4, window_size=6, has_indexer=True, force_unfused=True, "
            "packed_grid='per_document'), LayerSpec(compress_ratio=4, window_size=6, "
            "has_indexer=True, force_unfused=True, packed_grid='per_document'), LayerSpec("
            "compress_ratio=8, window_size=6, has_indexer=False, force_unfused=True, "
            "packed_grid='per_document')]. Expected every rank to run the same layer "
            "(compress_ratio, window_size, indexer): build the model identically on every rank "
            "before enable_cp.",
        ),
        (
            "layout",
            "CP ranks were given inconsistent inputs: CPConfig per rank "
            "[CPConfig(layout='contiguous', attention_kernel='banded', "
            "query_chunk=1024), CPConfig(layout='contiguous', attention_kernel="
            "'banded', query_chunk=1024), CPConfig(layout='load_balanced', "
            "attention_kernel='banded', query_chunk=1024)]. Expected enable_cp to get the same "
            "CPConfig on every rank: build it the same way everywhere.",
        ),
        (
            "tensors",
            "CP ranks were given inconsistent inputs: tensor shapes (row dim left out) and "
            "dtypes per rank [[5] [5] [6] [5], [5] [5] [6] [5], [7] [5] [6] [5]]. Expected "
            "every rank to pass inputs with the same batch size, heads, feature sizes and dtype.",
        ),
    ],
)
def test_ranks_that_disagree_all_raise_the_same_error(
    host: PluginHost, what: str, message: str
) -> None:
    odd = 2  # the last of 3 ranks differs; each rank's input is valid on its own

    def step(rank: int, layer: fb.ToyAttention) -> None:
        if what == "rows":
            layer(_x(5 if rank == odd else 4))
        elif what == "cu_seqlens":
            layer(_x(4), cu_seqlens=np.array([0, 7 if rank == odd else 5, 12]))
        elif what == "packed":
            layer(_x(4), cu_seqlens=np.array([0, 12]) if rank == odd else None)
        elif what == "tensors":  # the backend's tensors: the query is wider on one rank
            q, k, qi = layer.project(_x(4))
            if rank == odd:
                q = np.concatenate([q, q[:, :2]], axis=1)
            layer.cp_forward(q, k, _x(4), qi)
        else:
            layer(_x(4))

    def make_layer(rank: int) -> fb.ToyAttention:
        r = 8 if what == "spec" and rank == odd else 4
        return fb.ToyAttention(compress_ratio=r, window_size=6)

    def config(rank: int) -> DeepSeekV4CPConfig:
        lb = what == "layout" and rank == odd
        return DeepSeekV4CPConfig(layout="load_balanced" if lb else "contiguous")

    errors, elapsed, log = run_ranks(host, 3, step, layer=make_layer, config=config)
    assert_same_error(errors, elapsed, log, PlanError, message)


def test_local_only_options_need_not_agree(host: PluginHost) -> None:
    """The plan cache size only matters to its own rank: not part of the agreement."""
    errors, _, log = run_ranks(
        host,
        2,
        lambda rank, layer: layer(_x(4)),
        config=lambda rank: DeepSeekV4CPConfig(plan_cache_size=4 + rank),
    )
    assert errors == [None, None]
    assert [e["name"] for e in log].count("halo_exchange") == 2  # both ranks ran the layer


def test_failures_take_precedence_over_disagreement() -> None:
    reports = [
        {"problem": "", "facts": {"rows": "4"}},
        {"problem": "cu_seqlens must start at 0.", "facts": {"rows": "3"}},
    ]
    assert agreement_message(reports, [1], ["rows"]) == (
        "CP input check failed on rank 1 of 2 (every rank raises this error): cu_seqlens must "
        "start at 0. The ranks' inputs also differ: local rows per rank [4, 3]."
    )
    reports[1]["facts"]["tensors"] = "x float16"  # only the rows are added
    assert agreement_message(reports, [1], ["tensors"]) == (
        "CP input check failed on rank 1 of 2 (every rank raises this error): cu_seqlens must "
        "start at 0."
    )


# ------------------------------------------------------------------ the cost


@pytest.fixture
def meta_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Ranks of every ``all_gather_meta`` call."""
    calls: list[int] = []
    lock = threading.Lock()
    original = fb.FakeGroup.all_gather_meta

    def counting(self, values):
        with lock:
            calls.append(self.rank)
        return original(self, values)

    monkeypatch.setattr(fb.FakeGroup, "all_gather_meta", counting)
    return calls


def test_one_small_collective_per_forward_three_on_error(host, meta_calls) -> None:
    errors, _, _ = run_ranks(host, 3, lambda rank, layer: [layer(_x(4)) for _ in range(2)])
    assert errors == [None] * 3
    assert sorted(meta_calls) == [0, 0, 1, 1, 2, 2]  # one per forward, cached plan or not
    meta_calls.clear()
    errors, _, _ = run_ranks(host, 3, lambda rank, layer: layer(_x(4 + (rank == 1))))
    assert all(isinstance(e, PlanError) for e in errors)
    assert sorted(meta_calls) == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # + lengths, + messages


def test_a_count_is_summed_in_the_same_collective(host, meta_calls) -> None:
    """``extra["loss_rows"]`` travels in the agreement and arrives summed in the context."""
    seen: dict[int, int] = {}

    def step(rank: int, layer: fb.ToyAttention) -> None:
        fwd = layer.cp_forward
        call = fwd.agree(fwd.inspect(4), {"loss_rows": 10 * rank + 1, "keep": rank})
        seen[rank] = (call.loss_rows, call.extra)

    errors, _, _ = run_ranks(host, 3, step)
    assert errors == [None] * 3
    assert seen == {k: (33, {"keep": k}) for k in range(3)}
    assert sorted(meta_calls) == [0, 1, 2]


def test_without_the_cross_rank_check_only_the_failing_rank_raises(host) -> None:
    """``check_inputs_across_ranks=False`` skips the collective: the failing rank raises its
    own message, its peer is left to its next collective (the fake's barrier breaks)."""
    world = fb.FakeWorld(2)
    config = DeepSeekV4CPConfig(check_inputs_across_ranks=False)
    outcome: dict[int, BaseException] = {}

    def rank_fn(rank: int) -> None:
        layer = fb.ToyAttention(compress_ratio=4, window_size=6)
        handle = enable_cp(layer, fb.FakeMesh(world, rank), config, plugins=host)
        try:
            layer(_x(4), cu_seqlens=np.array([1, 8]) if rank == 1 else None)
        except BaseException as exc:
            outcome[rank] = exc
            raise
        finally:
            disable_cp(handle)

    with pytest.raises(PlanError) as err:
        world.run(rank_fn)
    assert str(err.value) == (
        "cu_seqlens must start at 0; got cu_seqlens[0] = 1 in [1, 8]. Pass the boundaries of "
        "the whole packed sequence: [0, len(doc0), len(doc0) + len(doc1), ..., S]."
    )
    assert type(outcome[0]).__name__ == "BrokenBarrierError"


class _Stack:
    """Three toy layers under one handle (the fake backend finds ``layers``)."""

    def __init__(self) -> None:
        self.layers = [fb.ToyAttention(compress_ratio=r, window_size=6) for r in (4, 0, 4)]


def test_later_layers_reuse_the_forward_agreement(host, meta_calls) -> None:
    """The first forward agrees in every layer; later forwards with the same inputs agree
    once, in their first layer, and the other layers reuse it (the same on every rank)."""

    def step(rank: int, model: Any) -> None:
        for _ in range(3):
            for lay in model.layers:
                lay(_x(4))

    errors, _, _ = run_ranks(host, 3, step, layer=lambda rank: _Stack())
    assert errors == [None] * 3
    assert sorted(meta_calls) == [r for r in range(3) for _ in range(3 + 1 + 1)]


def test_a_bad_input_after_reused_agreements_still_raises_on_every_rank(host, meta_calls) -> None:
    """Steady state (agreements reused), then rank 1's input changes: the forward's first
    layer agrees again, so every rank raises the same error before its exchanges."""
    seen: list[int] = []

    def step(rank: int, model: Any) -> None:
        for _ in range(2):
            for lay in model.layers:
                lay(_x(4))
        seen.append(rank)
        for lay in model.layers:
            lay(_x(4 + (rank == 1)))

    errors, _, _ = run_ranks(host, 3, step, layer=lambda rank: _Stack())
    assert sorted(seen) == [0, 1, 2]
    assert all(type(e) is PlanError for e in errors), errors
    assert len({str(e) for e in errors}) == 1
    assert "local rows" in str(errors[0]), errors[0]

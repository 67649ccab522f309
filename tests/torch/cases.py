"""Case functions run inside gloo ranks, the single-device runs they are compared with, and
the job cache that groups many cases into one spawned job per (suite, world size).

A spawned job costs several seconds (every rank imports torch and joins the group), so each
test file declares its cases per world size in :data:`SUITES`; the first test that needs a
case runs the whole suite for that world once (:func:`result`) and later tests read from the
cache. Inside a rank, :func:`job` runs every case of the list and records each one's return
value or traceback, so one failing case does not hide the others. Ranks only collect data
(outputs, gradients, indexer picks, traffic counters); every assertion runs in the pytest
process, against a single-device run built from the same seeds.

Sizes are tiny (hidden 32, two heads of 16, window 16) so that cp = 8 fits on two cores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import functools
import importlib
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hp_cp_core import DeepSeekV4CPConfig, HpCpError, disable_cp, enable_cp, hookimpl
from hp_cp_torch.attention import deterministic_topk
from hp_cp_torch.kernels.smallop import sparse_attention_smallop
from hp_cp_torch.reference import (
    Compressor,
    DeepSeekV4Attention,
    DeepSeekV4AttentionConfig,
    RotaryEmbedding,
    rope_frequencies,
)

JOB_TIMEOUT = {1: 120, 2: 240, 3: 240, 4: 300, 8: 420}
"""Seconds a job of each world size may take before its ranks are declared hung."""

# ------------------------------------------------------------------------------ the cases


@dataclass(frozen=True)
class Case:
    """One parity run of the reference layer.

    The global sequence has ``S = 2 * cp * chunk`` rows, so both layouts shard it
    (contiguous: ``L = 2 * chunk`` rows per rank; load-balanced: two chunks per rank).

    Attributes:
        cp: CP group size. r: compress ratio. layout: ``contiguous`` / ``load_balanced``.
        packed: one packed stream of documents (``cu_seqlens``) instead of a padded batch of 2.
        chunk: rows per chunk (see above).
        window: the layer's window W.
        dtype: ``float32`` or ``bfloat16``.
        kernel: the CP attention kernel (``smallop`` / ``efficient``).
        query_chunk: queries per chunk on the CP path.
        positions: padded input only: pass ``position_ids`` (else the default positions).
        backward: ``grad`` (``torch.autograd.grad(..., inputs=params)``) or ``backward``
            (``loss.backward()`` and ``.grad``).
        cu: explicit packed boundaries (else random documents, see :func:`make_cu`).
        seed: weights and inputs.
        topk: the indexer's top-k (r = 4).
        rows: the global sequence length when not ``2 * cp * chunk`` (0: that default).
        regather: ``DeepSeekV4CPConfig(regather_compressed_kv=True)``.
    """

    cp: int
    r: int
    layout: str = "contiguous"
    packed: bool = False
    chunk: int = 0
    window: int = 16
    dtype: str = "float32"
    kernel: str = "smallop"
    query_chunk: int = 1024
    positions: bool = True
    backward: str = "grad"
    cu: tuple[int, ...] | None = None
    seed: int = 0
    topk: int = 3
    rows: int = 0
    regather: bool = False

    @property
    def total(self) -> int:
        return self.rows or 2 * self.cp * self.chunk

    @property
    def local(self) -> int:
        return self.total // self.cp

    @property
    def name(self) -> str:
        parts = [
            f"cp{self.cp}",
            f"r{self.r}",
            "lb" if self.layout == "load_balanced" else "contig",
            "packed" if self.packed else "padded",
            f"S{self.total}",
        ]
        if self.window != 16:
            parts.append(f"W{self.window}")
        if self.dtype != "float32":
            parts.append(self.dtype)
        if self.kernel != "smallop":
            parts.append(self.kernel)
        if self.backward != "grad":
            parts.append("loss.backward")
        if self.topk != 3:
            parts.append(f"k{self.topk}")
        if self.regather:
            parts.append("regather")
        return "-".join(parts)


def default_chunk(cp: int, r: int, packed: bool) -> int:
    """Rows per chunk giving L < W - 1 (padded r = 0, 4), L not a multiple of r, and for
    r = 128 about 300 rows (two slots; with cp >= 3, L < 128 so most ranks own none)."""
    if r == 128:
        return -(-300 // (2 * cp))
    if r == 4:
        return 11 if packed else 7  # L = 22 (> W - 1) or 14 (< W - 1); never a multiple of 4
    return 9 if packed else 5


def parity_case(cp: int, r: int, layout: str = "contiguous", packed: bool = False, **kw) -> Case:
    chunk = kw.pop("chunk", default_chunk(cp, r, packed))
    if layout == "load_balanced":
        kw.setdefault("query_chunk", 5)  # chunked indexer scoring and attention
        kw.setdefault("positions", False)  # the default positions on the CP path
    return Case(cp, r, layout, packed, chunk, **kw)


def layer_config(r: int, window: int = 16, topk: int = 3) -> DeepSeekV4AttentionConfig:
    return DeepSeekV4AttentionConfig(
        hidden_size=32,
        n_heads=2,
        head_dim=16,
        rope_head_dim=8,
        q_lora_rank=16,
        o_groups=2,
        o_lora_rank=8,
        window_size=window,
        compress_ratio=r,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=topk,
    )


def build_layer(case: Case) -> DeepSeekV4Attention:
    torch.manual_seed(1000 + case.seed)
    layer = DeepSeekV4Attention(layer_config(case.r, case.window, case.topk))
    return layer.to(getattr(torch, case.dtype))


def make_cu(total: int, r: int, local: int, seed: int) -> list[int]:
    """Random documents: an empty one, some shorter than r, some longer than a rank's rows
    (so they span ranks), and for r = 128 some longer than r (so they own slots)."""
    rng = np.random.default_rng(seed)
    short_max = max(r, 4) - 1
    long_min = max(local, r) + 1
    lengths = [int(rng.integers(1, short_max + 1)), 0]
    while sum(lengths) < total:
        lengths.append(int(rng.integers(long_min, long_min + max(r, 8))))
        lengths.append(int(rng.integers(1, short_max + 1)))
    cu = np.cumsum([0, *lengths])
    cu = [int(c) for c in cu if c < total]
    return [*cu, total]


def case_cu(case: Case) -> list[int] | None:
    if not case.packed:
        return None
    if case.cu is not None:
        return list(case.cu)
    return make_cu(case.total, case.r, case.local, 7 + case.seed)


def make_inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(x, cu_seqlens, cotangent)``: padded x ``[2, S, hidden]``, packed ``[S, hidden]``."""
    gen = torch.Generator().manual_seed(2000 + case.seed)
    hidden = layer_config(case.r).hidden_size
    shape = (case.total, hidden) if case.packed else (2, case.total, hidden)
    dtype = getattr(torch, case.dtype)
    x = torch.randn(shape, generator=gen).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    cu = case_cu(case)
    return x, (None if cu is None else torch.tensor(cu)), g


# ------------------------------------------------------------------------------ rank helpers


@contextlib.contextmanager
def capture_selection() -> Iterator[list[torch.Tensor]]:
    """Record the indexer top-k the torch runner computes on this rank (``[B, L, k]``)."""
    import hp_cp_torch.model.runner as adapter

    original = adapter.select_topk_chunked
    seen: list[torch.Tensor] = []

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = original(*args, **kwargs)
        seen.append(out.detach().clone())
        return out

    adapter.select_topk_chunked = spy
    try:
        yield seen
    finally:
        adapter.select_topk_chunked = original


def _sum_over_group(t: torch.Tensor | None, like: torch.Tensor, pg: Any) -> torch.Tensor:
    """All-reduce a parameter gradient (``None`` counts as zeros, so every rank joins)."""
    t = torch.zeros_like(like, dtype=torch.float32) if t is None else t.detach().float().clone()
    dist.all_reduce(t, group=pg)
    return t


def _or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad.detach()


def _loss(out: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return (out.float() * g.float()).sum()


def run_reference_layer_cp(
    case: Case,
    mesh: Any = None,
    *,
    plugins: Any = None,
    config: DeepSeekV4CPConfig | None = None,
    cu_override: Any = None,
) -> dict:
    """Forward and backward of the reference layer under CP on this rank's rows.

    Returns, on group rank 0, the unsharded output, input gradient, summed parameter
    gradients and indexer picks; on every rank the traffic counters after forward and
    after backward. ``config`` replaces the case's options; ``cu_override`` is the
    ``cu_seqlens`` this rank passes instead of the case's (a bad input on one rank).
    """
    layer = build_layer(case)
    x, cu, g = make_inputs(case)
    if cu_override is not None:
        cu = torch.as_tensor(cu_override)
    if config is None:
        config = DeepSeekV4CPConfig(
            layout=case.layout,
            attention_kernel=case.kernel,
            query_chunk=case.query_chunk,
            single_rank_bypass=False,  # cp = 1 runs the CP path, not the module's own forward
            regather_compressed_kv=case.regather,
        )
    handle = enable_cp(layer, mesh, config, plugins=plugins)
    group = handle.group
    try:
        dim = 0 if case.packed else 1
        xl = handle.shard(x, dim).requires_grad_(True)
        kwargs: dict[str, Any] = {"cu_seqlens": cu}
        if not case.packed and case.positions:
            kwargs["position_ids"] = handle.shard(torch.arange(case.total), 0)
        with capture_selection() as picks:
            out = layer(xl, **kwargs)
        stats_fwd = handle.stats()
        names = [n for n, _ in layer.named_parameters()]
        params = [p for _, p in layer.named_parameters()]
        loss = _loss(out, handle.shard(g, dim))
        if case.backward == "grad":
            grads = torch.autograd.grad(loss, [xl, *params], allow_unused=True)
        else:
            layer.zero_grad(set_to_none=True)
            loss.backward()
            grads = [xl.grad, *(p.grad for p in params)]
        stats_bwd = handle.stats()
        trace = list(group.log.recent) if hasattr(group, "log") else None
        forward_installed = "forward" in layer.__dict__
        full = handle.unshard(out.detach(), dim)
        gx = handle.unshard(grads[0].detach(), dim)
        pg = getattr(group, "pg", None)
        pgrads = {n: _sum_over_group(gr, p, pg) for n, gr, p in zip(names, grads[1:], params)}
        sel = handle.unshard(picks[0], 1) if picks else None
    finally:
        disable_cp(handle)
    res = {
        "restored": "forward" not in layer.__dict__,
        "stats_fwd": stats_fwd,
        "stats_bwd": stats_bwd,
        "cp_rank": group.rank,
        "cp_size": group.size,
        "forward_installed": forward_installed,
        "trace": trace,
        "n_picks": len(picks),
    }
    if group.rank == 0:
        res.update(out=full, gx=gx, pgrads=pgrads, sel=sel)
    return res


# ------------------------------------------------------------------------------ single device


@functools.cache
def single_device(case: Case) -> dict:
    """The reference layer on one device: output, gradients and indexer picks / scores."""
    layer = build_layer(case)
    x, cu, g = make_inputs(case)
    x.requires_grad_(True)
    out = layer(x, cu_seqlens=cu)
    names = [n for n, _ in layer.named_parameters()]
    params = [p for _, p in layer.named_parameters()]
    grads = torch.autograd.grad(_loss(out, g), [x, *params], allow_unused=True)
    res = {
        "out": out.detach(),
        "gx": grads[0],
        "pgrads": dict(zip(names, grads[1:])),
    }
    if case.r == 4:
        res["sel"], res["scores"], res["slot_offset"] = reference_selection(layer, x.detach(), cu)
    return res


def reference_selection(layer: DeepSeekV4Attention, x: torch.Tensor, cu: torch.Tensor | None):
    """Single-device indexer picks and scores, per sequence (padded) or document (packed).

    Returns ``(picks, scores, slot_offset)``: per batch row, a list over rows of the picked
    slot ids (document-local, ``-1`` dropped) and the row's scores over its sequence's slots;
    ``slot_offset[row]`` maps a global slot id of the CP path to the document-local id.
    """
    if cu is None:
        segments = [(0, x.shape[1])]
        xb = x
    else:
        bounds = [int(c) for c in cu]
        segments = [(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        xb = x[None]
    batch = xb.shape[0]
    picks: list[list[list[int]]] = [[] for _ in range(batch)]
    scores: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    offset: list[int] = []
    slots_before = 0
    ind = layer.indexer
    with torch.no_grad():
        for a, b in segments:
            if a == b:
                continue
            seg = xb[:, a:b]
            pos = torch.arange(b - a)[None].expand(batch, -1)
            _, _, qr = layer.project(seg, pos)
            ids = layer._indexer_slots(seg, qr, pos)[0]
            sc = ind.scores(ind.queries(qr, pos), ind.weights(seg), ind.compressor(seg))
            for bi in range(batch):
                for t in range(b - a):
                    picks[bi].append([int(j) for j in ids[bi, t] if j >= 0])
                    scores[bi].append(sc[bi, t].float())
            offset.extend([slots_before] * (b - a))
            slots_before += (b - a) // layer.compress_ratio
    return picks, scores, offset


# ------------------------------------------------------------------------------ comparisons


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs difference over max abs reference (0 when both are zero)."""
    got, want = got.detach().double(), want.detach().double()
    scale = want.abs().max().item() if want.numel() else 0.0
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    if scale == 0.0:
        return diff
    return diff / scale


def cosine(got: torch.Tensor, want: torch.Tensor) -> float:
    a, b = got.detach().double().flatten(), want.detach().double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))


def compare_selection(cp_sel: torch.Tensor, ref: dict) -> tuple[int, int]:
    """Assert the CP indexer picks equal the single-device ones, tie-aware.

    Where the id lists differ, the picked sets must have the same scores (ties at the k-th
    place, broken differently only by rounding). Returns ``(rows compared, rows that differed
    only by a tie)``.
    """
    picks, scores, offset = ref["sel"], ref["scores"], ref["slot_offset"]
    ties = rows = 0
    for b in range(len(picks)):
        for t, want in enumerate(picks[b]):
            got = [int(j) - offset[t] for j in cp_sel[b, t] if j >= 0]
            rows += 1
            if got == want:
                continue
            sc = scores[b][t]
            assert len(got) == len(want), (b, t, got, want)
            tol = 1e-5 * max(float(sc.abs().max()), 1e-30)
            s_got = sorted((float(sc[j]) for j in got), reverse=True)
            s_want = sorted((float(sc[j]) for j in want), reverse=True)
            assert all(abs(p - q) <= tol for p, q in zip(s_got, s_want)), (
                f"row ({b}, {t}): CP picked {got} (scores {s_got}), single device {want} "
                f"(scores {s_want}); not a tie"
            )
            ties += 1
    return rows, ties


def check_parity(case: Case, got: dict) -> None:
    """Compare one rank-0 result of :func:`run_reference_layer_cp` with the single device."""
    want = single_device(case)
    if case.dtype == "float32":
        err = rel_err(got["out"], want["out"])
        assert err <= 1e-5, f"output relative error {err:.3g} > 1e-5"
        err = rel_err(got["gx"], want["gx"])
        assert err <= 1e-4, f"input gradient relative error {err:.3g} > 1e-4"
        for name, ref in want["pgrads"].items():
            cp_grad = got["pgrads"][name]
            if ref is None:  # no gradient reaches it (e.g. the indexer in eval mode)
                assert not cp_grad.abs().any(), f"{name}: CP gradient where single device has none"
                continue
            err = rel_err(cp_grad, ref)
            assert err <= 1e-4, f"gradient of {name}: relative error {err:.3g} > 1e-4"
        if case.r == 4 and case.cp > 1:
            assert got["sel"] is not None, "the CP path computed no indexer selection"
            rows, ties = compare_selection(got["sel"], want)
            assert rows == case.total * (1 if case.packed else 2)
    else:
        c = cosine(got["out"], want["out"])
        assert c >= 0.999, f"{case.dtype} output cosine similarity {c:.5f} < 0.999"
        c = cosine(got["gx"], want["gx"])
        assert c >= 0.999, f"{case.dtype} input gradient cosine similarity {c:.5f} < 0.999"


def check_comm_counts(case: Case, results: list[dict]) -> None:
    """One halo exchange and, when r > 0, one slot exchange per forward (point to point on
    torch), and their backward twins."""
    for res in results:
        fwd = res["stats_fwd"]["collectives"]
        bwd = res["stats_bwd"]["collectives"]
        if res["cp_size"] == 1:  # the CP path runs its exchanges on a group of one
            assert res["stats_bwd"]["bytes_sent"] == res["stats_bwd"]["bytes_recv"] == 0
        assert fwd == {"halo_exchange": 1, **({"slot_exchange": 1} if case.r else {})}, fwd
        want = {"halo_exchange": 1, "halo_exchange_bwd": 1}
        if case.r:
            want.update(slot_exchange=1, slot_exchange_bwd=1)
        if case.r and case.regather:  # the slots received again at the start of backward
            want.update(slot_exchange_regather=1)
        assert bwd == want, bwd
        assert res["stats_fwd"]["compressed_slot_exchange"] == "p2p"


# ------------------------------------------------------------------------------ the job


def job(rank: int, world: int, suite: str) -> dict[str, tuple[str, Any]]:
    """Run every case of ``SUITES[suite][world]`` on this rank; never raise."""
    return joint_job(rank, world, (suite,), JOB_TIMEOUT.get(world, 300))[suite]


def joint_job(
    rank: int, world: int, suites: tuple[str, ...], timeout: float
) -> dict[str, dict[str, tuple[str, Any]]]:
    """Run every case of each suite in ``suites`` (in order) on this rank; never raise.
    Returns ``{suite: {case: ("ok", value) | ("error", traceback)}}``; after the first
    failing case the later ones (of every suite) are not run, since peers may be stuck in
    its collectives."""
    faulthandler.dump_traceback_later(timeout - 10, exit=True)
    torch.set_num_threads(1)
    out: dict[str, dict[str, tuple[str, Any]]] = {}
    failed = None
    for suite in suites:
        mine = out[suite] = {}
        for name, (fn, args) in suite_cases(suite, world).items():
            if failed is not None:
                mine[name] = ("error", f"rank {rank}: not run, case {failed} failed before it")
                continue
            try:
                mine[name] = ("ok", fn(*args))
            except Exception:  # noqa: BLE001 - reported by the test that reads this case
                mine[name] = ("error", f"rank {rank}:\n{traceback.format_exc()}")
                failed = f"{suite}/{name}"
    faulthandler.cancel_dump_traceback_later()
    return out


JOINT_SUITES: dict[str, tuple[str, tuple[int, ...] | None]] = {
    "parity": ("test_torch_parity.py", (1, 2, 3, 4, 8)),
    "api": ("test_torch_api.py", (1, 2, 4)),
    "adapter": ("test_torch_adapter.py", (2, 3)),
    "indexer_loss": ("test_indexer_loss.py", (2, 3, 4)),
    "triton_cases:triton_suite": ("test_triton.py", (2,)),
    "foreign_cases:foreign_suite": ("test_foreign_modules.py", (2, 3, 4, 8)),
    "model_example_cases:example_suite": ("test_model_example.py", (1, 2, 3, 4)),
    "dsa_example_cases:dsa_example_suite": ("test_dsa_example.py", (1, 2, 3, 4)),
    "fuzz_cases:fuzz_suite:0": ("test_fuzz.py", None),  # the world sizes that have cases
    "sink_cases:sink_suite": ("test_sink.py", (2,)),
}
"""Suites that share one spawned job per world size (a job costs 7-14 s to start) when their
test modules are collected together: the first test of any of them at a world size its
module uses runs all of them. The reliability suites keep their own jobs (fresh processes
are what they compare, and their fault cases break process groups), as do the
module-scoped jobs of other files."""

_RESULTS: dict[tuple[str, int], Any] = {}
_COLLECTED: set[str] = set()


def collected(modules: set[str]) -> None:
    """Record the test modules (file names) this pytest session runs (``conftest.py``), so
    :func:`result` starts one job for all the :data:`JOINT_SUITES` they use."""
    _COLLECTED.clear()
    _COLLECTED.update(modules)


def _job_of(suite: str, world: int) -> tuple[tuple[str, ...], float]:
    """The suites run in ``suite``'s job on ``world`` ranks and that job's timeout."""

    def joins(s: str) -> bool:
        module, worlds = JOINT_SUITES.get(s, ("", ()))
        return (
            module in _COLLECTED
            and (worlds is None or world in worlds)
            and (s, world) not in _RESULTS
            and bool(suite_cases(s, world))
        )

    if not joins(suite):
        return (suite,), JOB_TIMEOUT.get(world, 300)
    joint = tuple(s for s in JOINT_SUITES if joins(s))
    return joint, JOB_TIMEOUT.get(world, 300) * len(joint)


def result(suite: str, world: int, name: str, pg_timeout: float | None = None) -> list[Any]:
    """Per rank, what case ``name`` returned (the suite's job runs once, on first use, with
    the other :data:`JOINT_SUITES` of this world size). ``pg_timeout`` (seconds) is the
    collective timeout of a job that runs this suite alone."""
    from dist_utils import run_ranks

    key = (suite, world)
    if key not in _RESULTS:
        suites, timeout = _job_of(suite, world)
        try:
            alone = pg_timeout if len(suites) == 1 else None
            ranks = run_ranks(world, joint_job, suites, timeout, timeout=timeout, pg_timeout=alone)
            for s in suites:
                _RESULTS[(s, world)] = [r[s] for r in ranks]
        except BaseException as exc:  # noqa: BLE001 - every test of the job reports it
            for s in suites:
                _RESULTS[(s, world)] = exc
    got = _RESULTS[key]
    if isinstance(got, BaseException):
        raise AssertionError(f"the {suite} job on {world} ranks failed: {got}") from got
    errors = [value for status, value in (r[name] for r in got) if status != "ok"]
    if errors:  # the rank that failed first, then the ranks that saw it go
        secondary = ("not run, case", "Connection closed by peer", "Connection reset")
        errors.sort(key=lambda e: any(s in e for s in secondary))
        raise AssertionError("\n".join(errors[:2]))
    return [r[name][1] for r in got]


def suite_cases(suite: str, world: int) -> dict[str, tuple[Callable, tuple]]:
    """``SUITES[suite](world)``, or for ``"module:function[:arg]"`` a suite defined in another
    test module (imported in each rank): ``function(world[, arg])``."""
    if ":" in suite:
        module, name, *arg = suite.split(":")
        return getattr(importlib.import_module(module), name)(world, *arg)
    return SUITES[suite](world)


# ============================================================================== parity suite

R_VALUES = (0, 4, 128)
LAYOUTS = ("contiguous", "load_balanced")


def parity_cases(world: int) -> list[Case]:
    """The parity grid of one world size (cp = world)."""
    cp = world
    if cp == 1:
        return [
            parity_case(1, 4),
            parity_case(1, 128, "load_balanced", packed=True),
            parity_case(1, 0, packed=True),
        ]
    if cp == 8:  # 8 processes on 2 cores: a short list of tiny cases
        return [
            parity_case(8, 4, "load_balanced", packed=True, chunk=4),
            parity_case(8, 4, chunk=3),
            parity_case(8, 128, packed=True),
            parity_case(8, 128, "load_balanced"),
            parity_case(8, 0, "load_balanced", chunk=2),
            *regather_cases(8),
        ]
    grid = [
        parity_case(cp, r, layout, packed)
        for r in R_VALUES
        for layout in LAYOUTS
        for packed in (False, True)
    ]
    extra = [
        parity_case(cp, 4, "load_balanced", True, dtype="bfloat16"),
        parity_case(cp, 128, "contiguous", False, dtype="bfloat16"),
        parity_case(cp, 4, "load_balanced", True, kernel="efficient", seed=1),
    ]
    if cp == 4:  # the real window (128) with L < W - 1: the halo spans several ranks
        extra.append(parity_case(4, 128, "contiguous", True, window=128, chunk=40, seed=2))
    if cp == 2:  # a longer CSA sequence: more slots than top-k on every rank
        extra.append(parity_case(2, 4, "contiguous", False, chunk=20, seed=3))
    return grid + extra + regather_cases(cp)


def regather_cases(cp: int) -> list[Case]:
    """``regather_compressed_kv=True`` cases, each with its twin without the option (the same
    seed): CP with the option equals one device, and equals CP without it bit for bit
    (``test_regather.py``). The default (banded) kernel; cp 2 and 8 only."""
    if cp == 2:
        cases = [
            parity_case(2, 4, "load_balanced", True, kernel="banded", seed=4),
            parity_case(2, 128, kernel="banded", seed=4),
        ]
    elif cp == 8:
        cases = [parity_case(8, 4, "load_balanced", True, chunk=4, kernel="banded", seed=4)]
    else:
        return []
    return [c for case in cases for c in (case, dataclasses.replace(case, regather=True))]


def _parity_suite(world: int) -> dict[str, tuple[Callable, tuple]]:
    return {c.name: (run_reference_layer_cp, (c,)) for c in parity_cases(world)}


# ============================================================================== api suite


def empty_rank_cases(world: int) -> list[Case]:
    """Ranks that receive no halo, own no slot or whose queries see no slot."""
    if world == 2:
        # rank 0: documents shorter than r only (owns no slot, sees none); rank 1 starts a
        # document at its first row (empty window halo and x halo).
        return [
            Case(2, 4, packed=True, chunk=6, cu=(0, 3, 6, 9, 12, 24), backward="backward"),
            Case(2, 128, packed=True, chunk=80, cu=(0, 100, 160, 320), backward="backward"),
        ]
    if world == 4:
        return [
            # S < 128: no slot at all, every rank gathers zero rows
            Case(4, 128, chunk=15, backward="backward"),
            # L = 40 < 128: ranks 0 and 2 own no slot, rank 0 sees none
            Case(4, 128, chunk=40, backward="backward"),
            Case(4, 128, "load_balanced", chunk=40, backward="backward", positions=False),
            # L = 2: rank 0's queries see no CSA slot (the indexer picks nothing there)
            Case(4, 4, chunk=1, backward="backward"),
        ]
    return []


class OverrideAttention:
    """A third-party plugin: only ``hp_cp_run_attention``, for the reference layer only."""

    def __init__(self) -> None:
        self.calls = 0
        self.factor = 1.0

    @hookimpl(tryfirst=True)
    def hp_cp_run_attention(self, module, query, ori_ext, x, qr, call):
        if not isinstance(module, DeepSeekV4Attention):
            return None
        from hp_cp_torch.adapter import ReferenceLayerAdapter
        from hp_cp_torch.model.runner import runner_of

        self.calls += 1
        out = runner_of(ReferenceLayerAdapter(module)).run_attention(query, ori_ext, x, qr, call)
        return out * self.factor


@contextlib.contextmanager
def count_adapter_calls() -> Iterator[dict[str, int]]:
    """Count the torch runner's stage calls on this rank (the reference layers' runners)."""
    from hp_cp_torch.model.runner import LayerRunner

    counts: dict[str, int] = {}
    names = ("extract_ori_kv", "compress_main", "compress_indexer", "run_attention")
    originals = {n: getattr(LayerRunner, n) for n in names}

    def counting(name: str, fn: Callable) -> Callable:
        def wrapper(self, *args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(self, *args, **kwargs)

        return wrapper

    for n, fn in originals.items():
        setattr(LayerRunner, n, counting(n, fn))
    try:
        yield counts
    finally:
        for n, fn in originals.items():
            setattr(LayerRunner, n, fn)


def plugin_override_case(case: Case, how: str) -> dict:
    """Run ``case`` with :class:`OverrideAttention` registered ahead of the torch backend."""
    from hp_cp_core.plugins import PluginHost, get_plugin_host

    plugin = OverrideAttention()
    if how == "global":
        host = get_plugin_host()
        host.add(plugin, "override")
        plugins = None
    else:
        host = PluginHost()
        host.add(plugin, "override")
        plugins = host
    try:
        impls = {
            hook: [i.plugin_name for i in getattr(host.pm.hook, hook).get_hookimpls()]
            for hook in (
                "hp_cp_backend",
                "hp_cp_layer_spec",
                "hp_cp_extract_ori_kv",
                "hp_cp_compress_main",
                "hp_cp_compress_indexer",
                "hp_cp_run_attention",
            )
        }
        with count_adapter_calls() as counts:
            res = run_reference_layer_cp(case, plugins=plugins)
        calls_parity = plugin.calls
        # the override's return value is what the layer outputs: double it and compare
        layer = build_layer(case)
        x, cu, _ = make_inputs(case)
        handle = enable_cp(layer, None, DeepSeekV4CPConfig(layout=case.layout), plugins=plugins)
        try:
            dim = 0 if case.packed else 1
            xl = handle.shard(x, dim)
            with torch.no_grad():
                plugin.factor = 1.0
                once = layer(xl, cu_seqlens=cu)
                plugin.factor = 2.0
                twice = layer(xl, cu_seqlens=cu)
        finally:
            disable_cp(handle)
        # a module the override does not know stays with the torch backend
        calls_before = plugin.calls
        generic = run_adapter_case(AdapterCase(case.cp, 4, chunk=7), plugins=plugins)
    finally:
        host.remove("override")
    res.update(
        impls=impls,
        adapter_counts=counts,
        calls_parity=calls_parity,
        doubled_err=float((twice - 2 * once).abs().max() / once.abs().max()),
        calls_generic=plugin.calls - calls_before,
        generic=generic,
    )
    return res


def direct_path_case(case: Case) -> dict:
    """Run ``case`` through the process's plugin host (the torch backend and whatever other
    backends are installed) and list the hooks pluggy ran: the stages go straight to the
    runner (Note [A direct runtime path] in hp_cp_core.plugins)."""
    from hp_cp_core.plugins import get_plugin_host

    called: list[str] = []
    host = get_plugin_host()
    undo = host.pm.add_hookcall_monitoring(lambda name, *_: called.append(name), lambda *_: None)
    try:
        with count_adapter_calls() as counts:
            res = run_reference_layer_cp(case)
    finally:
        undo()
    plugins = sorted(name for name, _ in host.pm.list_name_plugin())
    res.update(hooks_called=sorted(set(called)), adapter_counts=counts, plugins=plugins)
    return res


def bad_rows_case(cp: int) -> dict:
    """Every rank passes a different number of local rows; then inconsistent cu_seqlens."""
    rank = dist.get_rank()
    layer = build_layer(Case(cp, 4))
    handle = enable_cp(layer, None)
    errors = {}
    try:
        hidden = layer.config.hidden_size
        try:
            layer(torch.randn(2, 8 + rank, hidden))
        except HpCpError as exc:
            errors["rows"] = (type(exc).__name__, str(exc))
        total = 8 * cp
        cu = torch.tensor([0, 5 if rank == 0 else 6, total])
        try:
            layer(torch.randn(8, hidden), cu_seqlens=cu)
        except HpCpError as exc:
            errors["cu_seqlens"] = (type(exc).__name__, str(exc))
        try:  # consistent across ranks but not the global boundaries
            layer(torch.randn(8, hidden), cu_seqlens=torch.tensor([0, 3, 8]))
        except HpCpError as exc:
            errors["not_global"] = (type(exc).__name__, str(exc))
        # the group still works afterwards
        x, cu_ok, _ = make_inputs(Case(cp, 4, chunk=7))
        ok = layer(handle.shard(x, 1)).shape
    finally:
        disable_cp(handle)
    return {"errors": errors, "after": tuple(ok)}


def stats_bytes_case(case: Case) -> dict:
    """Bytes of one forward against the plan: rows moved times the row size."""
    from hp_cp_core.plan import build_rank_plan

    layer = build_layer(case)
    x, cu, _ = make_inputs(case)
    handle = enable_cp(layer, None, DeepSeekV4CPConfig(layout=case.layout))
    try:
        dim = 0 if case.packed else 1
        with torch.no_grad():
            layer(handle.shard(x, dim), cu_seqlens=cu)
        stats = handle.stats()
        spec = handle.layers[0][1]
    finally:
        disable_cp(handle)
    plan = build_rank_plan(
        rank=handle.cp_rank,
        cp_size=handle.cp_size,
        spec=spec,
        layout_kind=case.layout,
        total_rows=case.total,
        cu_seqlens=None if cu is None else cu.numpy(),
    )
    batch = 1 if case.packed else 2
    cfg = layer.config
    kv_row = batch * cfg.head_dim * 4
    x_row = batch * cfg.hidden_size * 4
    sent = plan.window.send_total * kv_row + (plan.x.send_total * x_row if plan.x else 0)
    recv = plan.window.n_halo * kv_row + (plan.x.n_halo * x_row if plan.x else 0)
    if case.r:  # point to point: only the slots the peer's queries see
        slot_row = batch * (cfg.head_dim + (cfg.index_head_dim if case.r == 4 else 0)) * 4
        sent += plan.slot_exchange.send_total * slot_row
        recv += plan.slot_exchange.n_halo * slot_row
    return {"stats": stats, "want_sent": sent, "want_recv": recv}


def disable_restores_case(cp: int) -> dict:
    """``disable_cp`` puts back exactly the forward that was there, class or instance."""
    case = parity_case(cp, 4)
    layer = build_layer(case)
    x, _, _ = make_inputs(case)
    with torch.no_grad():
        plain = layer(x)
    out: dict[str, Any] = {}
    handle = enable_cp(layer, None)
    out["patched"] = "forward" in layer.__dict__
    with torch.no_grad():
        local = layer(handle.shard(x, 1))
        out["cp_err"] = rel_err(handle.unshard(local, 1), plain)
    disable_cp(handle)
    disable_cp(handle)  # a second call does nothing
    out["restored_class_forward"] = "forward" not in layer.__dict__
    out["bound_to_class"] = layer.forward.__func__ is DeepSeekV4Attention.forward
    with torch.no_grad():
        out["plain_again"] = bool(torch.equal(layer(x), plain))
    # an instance-level forward (someone else's wrapper) comes back as the same object
    original = layer.forward

    def wrapped(*args, **kwargs):
        return original(*args, **kwargs)

    layer.forward = wrapped
    handle = enable_cp(layer, None)
    out["replaced_instance"] = layer.__dict__["forward"] is not wrapped
    try:
        enable_cp(layer, None)
    except HpCpError as exc:
        out["double_enable"] = str(exc)
    disable_cp(handle)
    out["restored_instance"] = layer.__dict__.get("forward") is wrapped
    # enabling again after disable works
    handle = enable_cp(layer, None)
    with torch.no_grad():
        out["reenabled_err"] = rel_err(handle.unshard(layer(handle.shard(x, 1)), 1), plain)
    disable_cp(handle)
    return out


def group_of_one_case(mesh_kind: str) -> dict:
    """A CP group of size 1 leaves the module on its original path."""
    rank = dist.get_rank()
    if mesh_kind == "world":
        mesh = None
    elif mesh_kind == "mesh_dim":
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "cp"))["cp"]
    else:  # one ProcessGroup per rank (every rank joins every new_group call)
        groups = [dist.new_group([k]) for k in range(dist.get_world_size())]
        mesh = groups[rank]
    case = parity_case(1, 4)
    layer = build_layer(case)
    x, _, _ = make_inputs(case)
    with torch.no_grad():
        plain = layer(x)
    handle = enable_cp(layer, mesh)
    try:
        untouched = "forward" not in layer.__dict__
        with torch.no_grad():
            got = layer(handle.shard(x, 1))
        stats = handle.stats()
    finally:
        disable_cp(handle)
    return {
        "cp_size": handle.cp_size,
        "untouched": untouched,
        "identical": bool(torch.equal(got, plain)),
        "stats": stats,
    }


def mesh_case(kind: str) -> dict:
    """Parity through a 1-D DeviceMesh, a named dim of a 2-D mesh or a ProcessGroup."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if kind == "mesh_1d":
        mesh, cp = init_device_mesh("cpu", (world,)), world
    elif kind == "mesh_2d_cp":
        mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "cp"))
        mesh, cp = mesh2["cp"], world // 2
    elif kind == "process_group":
        mesh, cp = dist.new_group(list(range(world))), world
    else:
        raise ValueError(kind)
    case = parity_case(cp, 4, "load_balanced", packed=True, seed=5)
    res = run_reference_layer_cp(case, mesh)
    res["case"] = case
    return res


def mesh_2d_error_case() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "cp"))
    layer = build_layer(Case(world, 4))
    try:
        enable_cp(layer, mesh)
    except HpCpError as exc:
        return {"error": str(exc), "untouched": "forward" not in layer.__dict__}
    return {"error": None}


def not_a_mesh_case() -> dict:
    layer = build_layer(Case(2, 0))
    try:
        enable_cp(layer, "cp")
    except HpCpError as exc:
        return {"error": str(exc)}
    return {"error": None}


def _api_suite(world: int) -> dict[str, tuple[Callable, tuple]]:
    cases: dict[str, tuple[Callable, tuple]] = {}
    for c in empty_rank_cases(world):
        cases[f"empty:{c.name}"] = (run_reference_layer_cp, (c,))
    if world == 1:
        cases["group_of_one:world"] = (group_of_one_case, ("world",))
    if world == 2:
        cases["override:global"] = (
            plugin_override_case,
            (parity_case(2, 4, "load_balanced", packed=True), "global"),
        )
        cases["override:host"] = (plugin_override_case, (parity_case(2, 128), "host"))
        cases["direct"] = (direct_path_case, (parity_case(2, 4, "load_balanced", packed=True),))
        cases["bad_rows"] = (bad_rows_case, (2,))
        cases["disable"] = (disable_restores_case, (2,))
        cases["not_a_mesh"] = (not_a_mesh_case, ())
        for c in (
            parity_case(2, 4, packed=True),
            parity_case(2, 128, "load_balanced"),
            parity_case(2, 0, "load_balanced", packed=True),
        ):
            cases[f"bytes:{c.name}"] = (stats_bytes_case, (c,))
    if world == 4:
        for kind in ("mesh_1d", "mesh_2d_cp", "process_group"):
            cases[f"mesh:{kind}"] = (mesh_case, (kind,))
        cases["mesh_2d_error"] = (mesh_2d_error_case, ())
        cases["group_of_one:mesh_dim"] = (group_of_one_case, ("mesh_dim",))
        cases["group_of_one:process_group"] = (group_of_one_case, ("process_group",))
        cases["bad_rows"] = (bad_rows_case, (4,))
    return cases


# ============================================================================== adapter suite


@dataclass(frozen=True)
class AdapterCase:
    """One run of :class:`SeqMajorCSA` patched with ``patch_torch_deepseek_v4_csa_forward``."""

    cp: int
    r: int
    layout: str = "contiguous"
    chunk: int = 7
    window: int = 16
    explicit: bool = True  # pass compressor / attention_fn / sizes, else read from the module
    seed: int = 0

    @property
    def total(self) -> int:
        return 2 * self.cp * self.chunk

    @property
    def name(self) -> str:
        how = "explicit" if self.explicit else "attrs"
        lay = "lb" if self.layout == "load_balanced" else "contig"
        return f"cp{self.cp}-r{self.r}-{lay}-S{self.total}-{how}"


class SeqMajorCSA(nn.Module):
    """A DeepSeek-V4-style attention core that looks nothing like the reference layer.

    ``forward(query, key, x, qr)`` takes sequence-major padded tensors (``query [S, B, N, D]``,
    ``key [S, B, 1, D]``, ``x [S, B, hidden]``, ``qr [S, B, q]``) and calls
    :func:`seq_major_attention` once over the whole sequence. Its compressors are the
    reference :class:`Compressor` behind transposes.
    """

    HIDDEN, HEADS, DIM, Q, IDX_HEADS, IDX_DIM, TOPK = 32, 2, 16, 16, 2, 16, 3

    def __init__(self, compress_ratio: int, window_size: int, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(3000 + seed)
        self.compress_ratio = compress_ratio
        self.window_size = window_size
        rope = RotaryEmbedding(8, rope_frequencies(8, 160000.0))
        self.cmp = (
            Compressor(self.HIDDEN, self.DIM, compress_ratio, rope, 1e-6)
            if (compress_ratio)
            else None
        )
        self.idx_cmp = None
        if compress_ratio == 4:
            self.idx_cmp = Compressor(self.HIDDEN, self.IDX_DIM, 4, rope, 1e-6)
            self.wq_idx = nn.Linear(self.Q, self.IDX_HEADS * self.IDX_DIM, bias=False)
            self.w_idx = nn.Linear(self.HIDDEN, self.IDX_HEADS, bias=False)
        self.sink = nn.Parameter(torch.randn(self.HEADS))
        self.attention_calls: list[tuple[int, int, int]] = []

    def compressor(self, x: torch.Tensor, rope_pos_offset: int = 0) -> torch.Tensor:
        return self.cmp(x.transpose(0, 1), rope_pos_offset).transpose(0, 1)

    def indexer_compressor(self, x: torch.Tensor, rope_pos_offset: int = 0) -> torch.Tensor:
        return self.idx_cmp(x.transpose(0, 1), rope_pos_offset).transpose(0, 1)

    def attention_fn(self, **kwargs: Any) -> torch.Tensor:
        return seq_major_attention(self, **kwargs)

    def forward(self, query, key, x, qr):
        r = self.compress_ratio
        return self.attention_fn(
            query=query,
            ori_kv=key,
            x=x,
            qr=qr,
            pos_offset=0,
            cmp_kv_global=self.compressor(x, 0) if r else None,
            ori_halo_len=0,
            cmp_idx_global=self.indexer_compressor(x, 0) if r == 4 else None,
        )


def seq_major_attention(
    module: SeqMajorCSA,
    *,
    query: torch.Tensor,
    ori_kv: torch.Tensor,
    x: torch.Tensor,
    qr: torch.Tensor,
    pos_offset: int,
    cmp_kv_global: torch.Tensor | None,
    ori_halo_len: int,
    cmp_idx_global: torch.Tensor | None,
) -> torch.Tensor:
    """Window + compressed attention of the rows ``pos_offset ..`` (sequence-major).

    ``ori_kv`` holds the global rows ``pos_offset - ori_halo_len ..``; query ``t`` attends to
    rows ``max(0, t-W+1) .. t`` and to compressed slots ``j`` with ``(j+1)*r <= t+1`` (all of
    them for r = 128, the indexer's top-k for r = 4).
    """
    module.attention_calls.append((pos_offset, ori_halo_len, query.shape[0]))
    if ori_kv.dim() == 4:
        ori_kv = ori_kv.squeeze(2)
    n, batch = query.shape[:2]
    W, r = module.window_size, module.compress_ratio
    t = pos_offset + torch.arange(n)
    first = pos_offset - ori_halo_len  # global row of ori_kv[0]
    keys = t[:, None] - W + 1 + torch.arange(W)
    valid = keys >= 0
    if bool((keys[valid] < first).any()):
        raise AssertionError(f"window halo too short: first row {first}, need {keys[valid].min()}")
    cols = [torch.where(valid, keys - first, -1).expand(batch, n, W)]
    pool = ori_kv
    if r:
        n_kv = ori_kv.shape[0]
        slots = torch.arange(cmp_kv_global.shape[0])
        visible = (t + 1) // r
        if r == 4:
            q_idx = module.wq_idx(qr).unflatten(-1, (module.IDX_HEADS, module.IDX_DIM))
            w = module.w_idx(x)
            logits = torch.einsum("nbhd,jbd->nbhj", q_idx.float(), cmp_idx_global.float()).relu()
            scores = torch.einsum("nbhj,nbh->bnj", logits, w.float())
            scores = scores.masked_fill(slots >= visible[:, None], float("-inf"))
            values, ids = deterministic_topk(scores, min(module.TOPK, slots.numel()))
            cols.append(torch.where(torch.isneginf(values), -1, ids + n_kv))
        else:
            hca = torch.where(slots < visible[:, None], slots + n_kv, -1)
            cols.append(hca.expand(batch, n, -1))
        pool = torch.cat([ori_kv, cmp_kv_global])
    out = sparse_attention_smallop(
        query.transpose(0, 1),
        pool.transpose(0, 1),
        torch.cat(cols, dim=-1),
        module.sink,
        module.DIM**-0.5,
    )
    return out.transpose(0, 1)


def adapter_inputs(case: AdapterCase) -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(4000 + case.seed)
    s, b, m = case.total, 2, SeqMajorCSA
    shapes = [(s, b, m.HEADS, m.DIM), (s, b, 1, m.DIM), (s, b, m.HIDDEN), (s, b, m.Q)]
    inputs = [torch.randn(sh, generator=gen) for sh in shapes]
    return inputs, torch.randn(s, b, m.HEADS, m.DIM, generator=gen)


def run_adapter_case(case: AdapterCase, *, plugins: Any = None) -> dict:
    """The generic module under CP: output, input and parameter gradients, attention calls."""
    from hp_cp_torch import patch_torch_deepseek_v4_csa_forward

    module = SeqMajorCSA(case.r, case.window, case.seed)
    inputs, g = adapter_inputs(case)
    config = DeepSeekV4CPConfig(layout=case.layout)
    if plugins is not None:  # go through enable_cp with an explicit host
        from hp_cp_torch.adapter import ADAPTER_ATTR, TorchDeepSeekV4CSAAdapter

        setattr(
            module,
            ADAPTER_ATTR,
            TorchDeepSeekV4CSAAdapter(
                module,
                compressor=module.compressor if case.r else None,
                indexer_compressor=module.indexer_compressor if case.r == 4 else None,
                attention_fn=module.attention_fn,
                compress_ratio=case.r,
                window_size=case.window,
            ),
        )
        handle = enable_cp(module, None, config, backend="torch", plugins=plugins)
    elif case.explicit:
        handle = patch_torch_deepseek_v4_csa_forward(
            module,
            cp_mesh=None,
            config=config,
            compressor=module.compressor if case.r else None,
            indexer_compressor=module.indexer_compressor if case.r == 4 else None,
            attention_fn=functools.partial(seq_major_attention, module),
            compress_ratio=case.r,
            window_size=case.window,
        )
    else:
        handle = patch_torch_deepseek_v4_csa_forward(module, cp_mesh=None, config=config)
    try:
        local = [handle.shard(t, 0).requires_grad_(True) for t in inputs]
        out = module(*local)
        stats = handle.stats()
        params = list(module.parameters())
        grads = torch.autograd.grad(
            _loss(out, handle.shard(g, 0)), [*local, *params], allow_unused=True
        )
        full = handle.unshard(out.detach(), 0)
        gin = [handle.unshard(_or_zeros(gr, t), 0) for gr, t in zip(grads, local)]
        pg = handle.group.pg
        pgrads = [_sum_over_group(gr, p, pg) for gr, p in zip(grads[len(local) :], params)]
    finally:
        disable_cp(handle)
    res = {
        "stats": stats,
        "calls": list(module.attention_calls),
        "restored": "forward" not in module.__dict__,
        "cp_rank": handle.cp_rank,
    }
    if handle.cp_rank == 0:
        res.update(out=full, gin=gin, pgrads=pgrads)
    return res


@functools.cache
def adapter_single_device(case: AdapterCase) -> dict:
    module = SeqMajorCSA(case.r, case.window, case.seed)
    inputs, g = adapter_inputs(case)
    inputs = [t.requires_grad_(True) for t in inputs]
    out = module(*inputs)
    params = list(module.parameters())
    grads = torch.autograd.grad(_loss(out, g), [*inputs, *params], allow_unused=True)
    return {"out": out.detach(), "gin": grads[: len(inputs)], "pgrads": grads[len(inputs) :]}


def check_adapter_parity(case: AdapterCase, got: dict) -> None:
    want = adapter_single_device(case)
    err = rel_err(got["out"], want["out"])
    assert err <= 1e-5, f"output relative error {err:.3g} > 1e-5"
    for name, a, b in zip(("query", "key", "x", "qr"), got["gin"], want["gin"]):
        if b is None:
            assert not a.abs().any(), f"{name}: CP gradient where single device has none"
            continue
        err = rel_err(a, b)
        assert err <= 1e-4, f"gradient of {name}: relative error {err:.3g} > 1e-4"
    for i, (a, b) in enumerate(zip(got["pgrads"], want["pgrads"])):
        if b is None:
            assert not a.abs().any(), f"parameter {i}: CP gradient where single device has none"
            continue
        err = rel_err(a, b)
        assert err <= 1e-4, f"gradient of parameter {i}: relative error {err:.3g} > 1e-4"


def adapter_cases(world: int) -> list[AdapterCase]:
    cp = world
    out = []
    for r in R_VALUES:
        chunk = -(-300 // (2 * cp)) if r == 128 else 7
        for layout in LAYOUTS:
            out.append(AdapterCase(cp, r, layout, chunk, explicit=layout == "contiguous"))
    return out


def _adapter_suite(world: int) -> dict[str, tuple[Callable, tuple]]:
    return {c.name: (run_adapter_case, (c,)) for c in adapter_cases(world)}


SUITES: dict[str, Callable[[int], dict[str, tuple[Callable, tuple]]]] = {
    "parity": _parity_suite,
    "api": _api_suite,
    "adapter": _adapter_suite,
    "indexer_loss": lambda world: __import__("indexer_loss_cases").loss_suite(world),
}

__all__ = [
    "AdapterCase",
    "Case",
    "SeqMajorCSA",
    "check_adapter_parity",
    "check_comm_counts",
    "check_parity",
    "result",
]

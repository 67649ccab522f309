"""The contract suite's cases and the driver a backend registers to run them (no pytest here).

A backend joins the suite by publishing a *driver* under the entry-point group
``hp_cp.contract``, named like its ``hp_cp`` plugin::

    [project.entry-points."hp_cp.contract"]
    jax = "hp_cp_jax.contract:JaxDriver"

The suite loads the entry point, calls it with no argument and calls ``run(cases)`` once.
Loading and constructing the driver must import no framework (the suite checks it). What a
driver does per case, on each of ``case.cp`` ranks of its world (threads, processes...):

1. build its own layer for ``case.r`` / ``case.window`` (weights from ``case.seed``), the
   global input of ``case.rows`` rows (from ``case.seed``; packed with ``case.cu_seqlens``
   when it is not ``None``, else a padded batch);
2. ``enable_cp(layer, mesh, case.config())``, run the layer on ``handle.shard``-ed rows with
   ``cu_seqlens=case.cu_for_rank(rank)``, read ``handle.stats()`` (``stats_forward``), then,
   for a differentiable backend, backward of a fixed random cotangent and ``handle.stats()``
   again (``stats``); ``disable_cp`` and check the original forward is back (``restored``);
3. report one :class:`RankReport` dict per rank (see there), with ``compare`` pairs of the CP
   result and the same layer's single-device result.

A case with ``case.bad_rank`` set gives that rank invalid ``cu_seqlens``: every rank must
raise ``HpCpError`` (report ``error`` and ``error_types``) and none may hang.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict

import numpy as np

from hp_cp_core.config import CPConfig

DRIVER_ENTRY_POINT_GROUP = "hp_cp.contract"
RATIOS = (0, 4, 128)


@dataclass(frozen=True)
class ContractCase:
    """One run of a backend's layer under CP, compared with one device.

    Attributes:
        family: ``parity`` (cp x r x {contiguous padded, load-balanced packed}),
            ``owns_nothing`` (L < r: some ranks own no compressed slot, rank 0 also receives
            no halo; their compressor returns 0 rows) or ``bad_input``.
        cp: ranks. r: compress ratio. layout: ``contiguous`` / ``load_balanced``.
        rows: global rows of the sequence (a multiple of ``2 * cp``).
        cu_seqlens: packed document boundaries (global rows), ``None`` for a padded batch.
        window: the layer's sliding window W.
        seed: weights and inputs.
        bad_rank: the rank given invalid ``cu_seqlens`` (``bad_input`` only).
    """

    family: str
    cp: int
    r: int
    layout: str
    rows: int
    cu_seqlens: tuple[int, ...] | None
    window: int = 16
    seed: int = 0
    bad_rank: int | None = None

    @property
    def name(self) -> str:
        lay = "lb" if self.layout == "load_balanced" else "contig"
        kind = "packed" if self.packed else "padded"
        return f"{self.family}-cp{self.cp}-r{self.r}-{lay}-{kind}-S{self.rows}-W{self.window}"

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def local_rows(self) -> int:
        return self.rows // self.cp

    def config(self, **options: Any) -> CPConfig:
        """The CP options of this case (the full CP path also at cp = 1)."""
        fields = {f.name for f in dataclasses.fields(CPConfig)}
        if "single_rank_bypass" in fields:
            options.setdefault("single_rank_bypass", False)
        return CPConfig(layout=self.layout, **options)

    def cu_for_rank(self, rank: int) -> np.ndarray | None:
        """The ``cu_seqlens`` rank ``rank`` passes (invalid on ``bad_rank``)."""
        if rank == self.bad_rank:
            return np.array([0, self.rows - 1], dtype=np.int64)  # does not end at `rows`
        return None if self.cu_seqlens is None else np.array(self.cu_seqlens, dtype=np.int64)


class RankReport(TypedDict, total=False):
    """What a driver reports for one rank of one case.

    Keys:
        cp_rank: the rank (``handle.cp_rank``).
        stats_forward: ``handle.stats()`` right after the forward.
        stats: ``handle.stats()`` after the backward (a differentiable backend), else after
            the forward.
        restored: ``disable_cp`` gave back the original forward.
        compare: name -> ``(CP result, single-device result)`` numpy arrays: ``"out"`` (the
            unsharded output) and, for a differentiable backend, gradients (``"grad x"``, one
            per parameter summed over ranks...). Needed on at least one rank.
        rel_err: name -> relative error, for a driver that compares out of process
            (:func:`hp_cp_core.testing.rel_err`).
        trace: the collectives this rank entered, in order (a ThreadWorld's ``trace``).
        error: ``"Type: message"`` of what the rank raised (``bad_input`` cases).
        error_types: the names in the raised exception's MRO (``"HpCpError"`` expected).
    """

    cp_rank: int
    stats_forward: dict[str, Any]
    stats: dict[str, Any]
    restored: bool
    compare: dict[str, tuple[Any, Any]]
    rel_err: dict[str, float]
    trace: list[str]
    error: str
    error_types: list[str]


class ContractDriver(Protocol):
    """What the ``hp_cp.contract`` entry point of a backend gives (see the module doc).

    Attributes:
        name: the backend's ``hp_cp`` entry-point name.
        framework: its framework's top-level module (``"jax"``), ``None`` for none; the suite
            checks discovery and the driver never import it.
        max_cp: the largest CP group it can run here.
        rtol: the largest relative error (:func:`~hp_cp_core.testing.rel_err`) accepted
            between CP and one device: float rounding only (the guide, "Exactly equal").
        differentiable: the backend runs backward (then gradients are compared and each
            rank must run every backward collective).
    """

    name: str
    framework: str | None
    max_cp: int
    rtol: float
    differentiable: bool

    def run(self, cases: Sequence[ContractCase]) -> Mapping[str, Sequence[RankReport] | str]:
        """Every case by name: its per-rank reports (rank order), or why it failed."""


def contract_cases(max_cp: int) -> list[ContractCase]:
    """The suite's cases for a backend that runs CP groups of up to ``max_cp`` ranks."""
    cases = []
    for cp in range(1, max_cp + 1):
        for r in RATIOS:
            for layout, packed in (("contiguous", False), ("load_balanced", True)):
                rows = _rows(cp, r)
                cases.append(
                    ContractCase("parity", cp, r, layout, rows, _docs(rows, r) if packed else None)
                )
    for cp in range(2, max_cp + 1):
        # issue-12 shape: L = 96 < r = 128, rank 0 owns no slot and receives no halo
        cases.append(ContractCase("owns_nothing", cp, 128, "contiguous", 96 * cp, None, 64))
        # L = 2 < r = 4: every other rank owns no slot (and some ranks' indexer sees none)
        cases.append(ContractCase("owns_nothing", cp, 4, "load_balanced", 2 * cp, None, 16))
    if max_cp >= 2:
        cp = min(max_cp, 3)
        cases.append(
            ContractCase("bad_input", cp, 4, "contiguous", _rows(cp, 4), None, bad_rank=cp - 1)
        )
    return cases


def _rows(cp: int, r: int) -> int:
    """r = 128: about 260 rows (L < r from cp = 3 on); else 10 rows a rank (L < W - 1)."""
    chunk = -(-260 // (2 * cp)) if r == 128 else 5
    return 2 * cp * chunk


def _docs(rows: int, r: int) -> tuple[int, ...]:
    """A document shorter than r, an empty one, one spanning ranks and two short ones."""
    short = max(r, 4) - 1
    return (0, short, short, min(short + rows // 2, rows - 2), rows - 2, rows)

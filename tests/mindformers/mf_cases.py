"""The CP parity cases of the mindformers backend (pure Python: the pytest side and the msrun
worker both import it).

Every cp > 1 job covers r in {0, 4, 128} x {contiguous, load_balanced} x {padded (b = 2),
packed (b = 1, global grid: documents shorter than r, documents spanning ranks)}, plus an r = 4
training case with the indexer KL loss and, for cp = 4, the AllReduce form of the all-gather
(forced on the world group) and two CP groups of 2 on communication sub-groups.

Sizes (window W = 8) make the awkward cases happen: for cp = 4 and r in {0, 4}, L = 6 < W - 1
(the window halo comes from two ranks back) and load-balanced runs of 3 rows (shorter than
r = 4); for cp = 4 and r = 128, L = 64 < r (rank 0 owns no slot and sees none); lengths are not
multiples of r (slots straddle ranks).
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass

OUT_TOL = 1e-5
GRAD_TOL = 1e-4


@dataclass(frozen=True)
class Case:
    """One CP parity check.

    Attributes:
        cp: the CP group size (the job's world size unless ``subgroup``).
        r: compress ratio. layout: ``contiguous`` / ``load_balanced``.
        packed: ``b = 1`` plus a global ``actual_seq_len`` (else a padded batch of 2).
        seq: global rows. ends: the global ``actual_seq_len`` (document ends, padded).
        train: training mode with the indexer KL loss (r = 4).
        mesh: ``"name"`` (a group name) or ``"object"`` (a HyperParallel-style mesh).
        emulate: force the AllReduce form of the all-gather.
        subgroup: run two CP groups of ``cp`` ranks on communication sub-groups.
        part: with ``subgroup``, only sub-group ``part`` (world ranks ``part * cp ..``) runs
            the case (``-1``: every sub-group), so two sub-groups share a job's cases.
        real: the real mindformers 2.1.0 cell (else the project's copy of it).
    """

    cp: int
    r: int
    layout: str
    packed: bool
    seq: int
    ends: tuple[int, ...] = ()
    train: bool = False
    mesh: str = "name"
    emulate: bool = False
    subgroup: bool = False
    part: int = -1
    real: bool = False

    @property
    def name(self) -> str:
        kind = "packed" if self.packed else "padded"
        extra = "".join(
            [
                "-train" if self.train else "",
                "-meshobj" if self.mesh == "object" else "",
                "-allreduce" if self.emulate else "",
                "-subgroup" if self.subgroup else "",
            ]
        )
        real = "real-" if self.real else ""
        return f"{real}cp{self.cp}-r{self.r}-{self.layout}-{kind}-S{self.seq}{extra}"


def _sizes(world: int, r: int) -> tuple[int, tuple[int, ...]]:
    if r == 128:
        return (320, (100, 300, 320, 320)) if world == 2 else (256, (5, 60, 256, 256))
    return (40, (3, 5, 17, 30, 40, 40)) if world == 2 else (24, (2, 9, 11, 24, 24))


def parity_cases(world: int) -> list[Case]:
    """The cases one msrun job of ``world`` ranks runs, in order."""
    cases = []
    for r in (0, 4, 128):
        seq, ends = _sizes(world, r)
        for layout in ("contiguous", "load_balanced"):
            for packed in (False, True):
                mesh = "object" if (r == 4 and layout == "contiguous") else "name"
                cases.append(Case(world, r, layout, packed, seq, ends if packed else (), mesh=mesh))
    seq, ends = _sizes(world, 4)
    cases.append(Case(world, 4, "load_balanced", True, seq, ends, train=True))
    if world == 4:
        cases.append(Case(world, 4, "load_balanced", False, 24, emulate=True))
        # last: two CP groups of 2 ranks on communication sub-groups (AllGather exists only on
        # the world group on CPU, so these use the AllReduce form by themselves)
        cases.append(Case(2, 4, "load_balanced", True, 40, _sizes(2, 4)[1], subgroup=True))
    return cases


def _real_sizes(cp: int, r: int) -> tuple[int, tuple[int, ...]]:
    """Local rows L with L % r != 0 (r = 4, 128), L < W - 1 (cp = 4, r <= 4), L < r (cp = 4,
    r = 128); documents shorter than r and documents spanning ranks."""
    if r == 128:
        return (320, (100, 300, 320, 320)) if cp == 2 else (256, (5, 60, 256, 256))
    return (44, (3, 5, 17, 30, 44, 44)) if cp == 2 else (24, (2, 9, 11, 24, 24))


def real_cases() -> list[Case]:
    """The REAL cell's msrun job of 4 ranks, training mode (the indexer KL loss for r = 4):
    cp = 4 on the world group, then cp = 2 on two communication sub-groups that split the cases
    between them (both at work at once). r in {0, 4, 128} x {contiguous, load_balanced} x
    {padded (b = 2), packed (b = 1 + actual_seq_len)} at each cp."""
    cases = []
    for cp in (4, 2):
        k = 0
        for r in (0, 4, 128):
            seq, ends = _real_sizes(cp, r)
            for layout in ("contiguous", "load_balanced"):
                for packed in (False, True):
                    sub = cp == 2
                    cases.append(
                        Case(
                            cp,
                            r,
                            layout,
                            packed,
                            seq,
                            ends if packed else (),
                            train=True,
                            subgroup=sub,
                            part=k % 2 if sub else -1,
                            real=True,
                        )
                    )
                    k += 1
    return cases


def msrun_executable() -> str | None:
    """msrun from ``$HP_CP_MSRUN_BIN`` (the nox session's bin dir), this interpreter's bin
    dir, or ``PATH``."""
    for d in (os.environ.get("HP_CP_MSRUN_BIN"), os.path.dirname(sys.executable)):
        if d and os.path.exists(os.path.join(d, "msrun")):
            return os.path.join(d, "msrun")
    return shutil.which("msrun")

"""The whole-model CP cases (pure Python: the pytest side and the msrun worker both import it).

One msrun job of 4 ranks: cp = 4 on the world group, then cp = 2 on two sub-groups (world ranks
0-1 and 2-3) running different cases at the same time. Three inputs, each run once on one
device (the reference) and under CP in several layouts:

* ``padded``: a batch of 2 sequences of 136 rows (no ``actual_seq_len``);
* ``packed``: one stream of 136 rows, 3 documents (``actual_seq_len`` = their ends): 130
  rows (the HCA layer's one slot, rows 0-127 on the global grid, seen by rows 128-129), then
  two shorter than r = 4 (CSA slots and windows cross ranks and documents);
* ``odd``: one packed stream of 133 rows (documents of 131 and 2 rows), a multiple of
  neither cp nor 2 * cp: padded at the end as the core pads it (``handle.padding``: the
  padding is its own trailing document, its rows out of the loss).

136 > 128, so the HCA layer has a slot; at cp = 4 a rank holds 34 rows (fewer than r = 128, not
a multiple of r = 4; load-balanced runs of 17 rows).
"""

from __future__ import annotations

from dataclasses import dataclass

LOSS_TOL = 1e-5
LOGITS_TOL = 1e-5
GRAD_TOL = 1e-4
GRAD_SCALE_TOL = 1e-6
"""A parameter whose gradient is ~0 on one device (a saturated hyper-connection gate: 1e-11)
compares by its error over the model's largest gradient instead (fp32 noise)."""

INPUTS = {
    "padded": {"seq": 136, "batch": 2, "ends": None},
    "packed": {"seq": 136, "batch": 1, "ends": (130, 133, 136)},
    "odd": {"seq": 133, "batch": 1, "ends": (131, 133)},
}


@dataclass(frozen=True)
class ModelCase:
    """One whole-model CP check: ``cp`` ranks (``part``: which sub-group of the world runs it,
    ``-1``: the world group), a ``layout`` and one of the ``INPUTS``."""

    cp: int
    layout: str
    data: str
    part: int = -1

    @property
    def name(self) -> str:
        where = "world" if self.part < 0 else f"part{self.part}"
        return f"cp{self.cp}-{self.layout}-{self.data}-{where}"

    def ranks(self) -> list[int]:
        first = 0 if self.part < 0 else self.part * self.cp
        return list(range(first, first + self.cp))


def indexer_param(name: str) -> bool:
    """The CSA layer's indexer parameters: their only gradient is the indexer KL loss's."""
    return ".indexer." in name


REFERENCE_OF_RANK = {0: "padded", 1: "packed", 2: "odd", 3: "padded"}
"""Which input each world rank runs on one device (one each, so no rank waits long for
another): the cases compare on the rank of their group that holds their reference."""


def checking_rank(case: ModelCase) -> int:
    """The world rank of ``case``'s group that holds its one-device reference."""
    return next(r for r in case.ranks() if REFERENCE_OF_RANK[r] == case.data)


def model_cases() -> list[ModelCase]:
    """cp = 4 then cp = 2: each cp covers both layouts, padded and packed input, and a length
    that needs padding (``odd`` is packed too); the two cp = 2 sub-groups run at once."""
    grid = [("contiguous", "padded"), ("load_balanced", "packed"), ("load_balanced", "odd")]
    cases = [ModelCase(4, layout, data) for layout, data in grid]
    cases += [ModelCase(2, "load_balanced", "padded", part=0)]
    cases += [ModelCase(2, "contiguous", "odd", part=1)]
    return cases

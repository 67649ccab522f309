"""Random end-to-end parity cases: the one generator behind ``test_fuzz.py`` (fixed seed, in
the torch session) and ``nox -s fuzz`` (random seed, many cases).

Environment: ``HP_CP_FUZZ_SEED`` (default :data:`FIXED_SEED`), ``HP_CP_FUZZ_CASES`` (default
:data:`DEFAULT_CASES`), ``HP_CP_FUZZ_WORLDS`` (comma-separated cp sizes, default ``2,4``).
The ranks of a job regenerate the same list from the same environment (spawned processes
inherit it), so only the suite name travels: ``"fuzz_cases:fuzz_suite:<batch>"``.

Each case draws cp, the ratio, layout, padded batch or packed documents, S, W, top-k, the
document lengths, the kernel, the query chunk, explicit or default positions and the way
gradients are taken; ratio, layout and packing are stratified over the case index so that a
short list still has every combination once. Every draw is valid by construction: S is a
multiple of cp (contiguous) or 2 cp (load-balanced), ``cu_seqlens`` rise from 0 to S (empty
documents included), and sizes stay small enough for 8 ranks on 2 cores.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

from cases import LAYOUTS, R_VALUES, Case, run_reference_layer_cp

FIXED_SEED = 20240607
DEFAULT_CASES = 20
DEFAULT_WORLDS = (2, 4)
BATCH = 24
"""Cases per spawned job (a long run is split into several jobs, each within its timeout)."""

WINDOWS = (1, 2, 3, 5, 8, 16, 31, 128)
TOPKS = (1, 2, 3, 5, 9)
MAX_ROWS = {0: 160, 4: 160, 128: 640}


def settings() -> tuple[int, int, tuple[int, ...]]:
    """``(seed, number of cases, cp sizes)`` from the environment."""
    seed = int(os.environ.get("HP_CP_FUZZ_SEED", FIXED_SEED))
    n = int(os.environ.get("HP_CP_FUZZ_CASES", DEFAULT_CASES))
    worlds = os.environ.get("HP_CP_FUZZ_WORLDS")
    cps = tuple(int(w) for w in worlds.split(",")) if worlds else DEFAULT_WORLDS
    return seed, n, cps


def random_cu(rng: random.Random, total: int) -> tuple[int, ...]:
    """Random document boundaries over ``total`` rows: 1 to 6 cuts drawn uniformly, so
    documents shorter than r, spanning ranks and empty (a repeated cut) all occur."""
    cuts = sorted(rng.randint(0, total) for _ in range(rng.randint(0, 6)))
    if rng.random() < 0.3:  # an empty document somewhere
        cuts.append(rng.choice(cuts) if cuts else 0)
        cuts.sort()
    return (0, *cuts, total)


def random_case(rng: random.Random, index: int, cps: tuple[int, ...]) -> Case:
    """Case number ``index`` (ratio, layout and packing stratified by the index)."""
    r = R_VALUES[index % 3]
    layout = LAYOUTS[(index // 3) % 2]
    packed = (index // 6) % 2 == 1
    cp = rng.choice(cps)
    unit = 2 * cp if layout == "load_balanced" else cp
    total = unit * rng.randint(1, max(1, MAX_ROWS[r] // unit))
    return Case(
        cp=cp,
        r=r,
        layout=layout,
        packed=packed,
        window=rng.choice(WINDOWS),
        kernel=rng.choice(("smallop", "efficient")),
        query_chunk=rng.choice((3, 7, 64, 1024)),
        positions=rng.random() < 0.5,
        backward=rng.choice(("grad", "backward")),
        cu=random_cu(rng, total) if packed else None,
        seed=rng.randrange(1 << 20),
        topk=rng.choice(TOPKS) if r == 4 else 3,
        rows=total,
    )


def fuzz_cases(seed: int | None = None, n: int | None = None, cps: tuple[int, ...] = ()) -> list:
    """``[(id, case)]`` for the seed, count and cp sizes (default: from :func:`settings`)."""
    env_seed, env_n, env_cps = settings()
    seed = env_seed if seed is None else seed
    n = env_n if n is None else n
    rng = random.Random(seed)
    cases = [random_case(rng, i, cps or env_cps) for i in range(n)]
    return [(f"fuzz{i:03d}-{c.name}", c) for i, c in enumerate(cases)]


def batches(world: int) -> list[list[tuple[str, Case]]]:
    """The cases of one cp size, in jobs of at most :data:`BATCH`."""
    mine = [(name, c) for name, c in fuzz_cases() if c.cp == world]
    return [mine[i : i + BATCH] for i in range(0, len(mine), BATCH)]


def fuzz_suite(world: int, batch: str) -> dict[str, tuple[Callable, tuple]]:
    """The job ``"fuzz_cases:fuzz_suite:<batch>"`` on ``world`` ranks."""
    jobs = batches(world)
    chosen = jobs[int(batch)] if int(batch) < len(jobs) else []
    return {name: (run_reference_layer_cp, (case,)) for name, case in chosen}


def reproduce_hint(name: str) -> str:
    seed, n, cps = settings()
    worlds = ",".join(map(str, cps))
    return (
        f"reproduce: HP_CP_FUZZ_SEED={seed} HP_CP_FUZZ_CASES={n} HP_CP_FUZZ_WORLDS={worlds} "
        f"nox -s fuzz -- -k {name.split('-')[0]}"
    )

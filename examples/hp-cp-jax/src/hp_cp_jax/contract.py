"""The JAX example's contract driver (entry point ``hp_cp.contract: jax``).

Every case runs on a :class:`hp_cp_core.testing.ThreadWorld` of ``case.cp`` ranks: forward
with ``jax.vjp``, backward of a fixed cotangent, and the same on one device; reports outputs,
input and parameter gradients (summed over ranks), stats and each rank's collective trace.
Importing this module imports no JAX (the suite loads it at collection).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hp_cp_core.testing.cases import ContractCase


class JaxDriver:
    name = "jax"
    framework = "jax"
    max_cp = 4
    rtol = 2e-5  # float32: the same math, summed in another order (see the backend guide)
    differentiable = True

    def run(self, cases: Sequence[ContractCase]) -> dict[str, Any]:
        return {case.name: run_case(case) for case in cases}


def run_case(case: ContractCase) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from hp_cp_core import HpCpError, disable_cp, enable_cp
    from hp_cp_core.testing import ThreadWorld
    from hp_cp_jax.layer import SparseAttention

    def make() -> SparseAttention:
        return SparseAttention(r=case.r, window=case.window)

    params = make().init(case.seed)
    rng = np.random.default_rng(case.seed)
    x = rng.standard_normal((case.rows, 8)).astype(np.float32)
    cot = rng.standard_normal((case.rows, 8)).astype(np.float32)
    world = ThreadWorld(case.cp, timeout=60)

    def rank_fn(rank: int) -> dict:
        layer = make()
        handle = enable_cp(layer, world.mesh(rank), case.config())
        report: dict[str, Any] = {"cp_rank": rank}
        cu = case.cu_for_rank(rank)
        try:
            local = jnp.asarray(handle.shard(x, 0))
            out, vjp = jax.vjp(lambda p, xl: layer.apply(p, xl, cu), params, local)
            report["stats_forward"] = handle.stats()
            dparams, dx = vjp(jnp.asarray(handle.shard(cot, 0)))
            report["stats"] = handle.stats()
            report["out"] = np.asarray(handle.unshard(out, 0))
            report["grad x"] = np.asarray(handle.unshard(dx, 0))
            report["dparams"] = {k: np.asarray(v) for k, v in dparams.items()}
        except HpCpError as exc:
            report["error"] = f"{type(exc).__name__}: {exc}"
            report["error_types"] = [c.__name__ for c in type(exc).__mro__]
        finally:
            disable_cp(handle)
        report["restored"] = layer.cp_forward is None
        report["trace"] = world.trace(rank)
        return report

    reports = world.run(rank_fn)
    if case.bad_rank is not None:
        return reports
    want, vjp = jax.vjp(lambda p, xx: make().apply(p, xx, case.cu_seqlens), params, x)
    want_dparams, want_dx = vjp(jnp.asarray(cot))
    compare = {
        "out": (reports[0]["out"], np.asarray(want)),
        "grad x": (reports[0]["grad x"], np.asarray(want_dx)),
    }
    for name, ref in want_dparams.items():
        total = sum(rep["dparams"][name] for rep in reports)
        compare[f"grad {name}"] = (total, np.asarray(ref))
    for rep in reports:
        for key in ("out", "grad x", "dparams"):
            rep.pop(key)
    reports[0]["compare"] = compare
    return reports

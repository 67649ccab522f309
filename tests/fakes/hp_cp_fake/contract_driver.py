"""The fake backend's contract driver (entry point ``hp_cp.contract: fake``).

Ranks are threads of the kit's :class:`~hp_cp_core.testing.ThreadWorld`; the fake is numpy,
forward only, so it reports outputs, stats and each rank's collective trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hp_cp_core.testing.cases import ContractCase


class FakeDriver:
    name = "fake"
    framework = None
    max_cp = 4
    rtol = 1e-12  # float64 numpy, the same sums in the same order up to summation length
    differentiable = False

    def plugin(self) -> tuple[str, Any, type]:
        """The backend under test: its name, plugin module and layer class."""
        from hp_cp_fake import fake_backend as fb

        return "fake", fb, fb.ToyAttention

    def run(self, cases: Sequence[ContractCase]) -> dict[str, Any]:
        return {case.name: self._run_case(case) for case in cases}

    def _run_case(self, case: ContractCase) -> list[dict] | str:
        from hp_cp_core import HpCpError, disable_cp, enable_cp
        from hp_cp_core.plugins import PluginHost
        from hp_cp_core.testing import ThreadWorld
        from hp_cp_fake import fake_backend as fb

        name, plugin, layer_cls = self.plugin()
        host = PluginHost(autoload=False)
        host.add(plugin, name)
        x = np.random.default_rng(case.seed).normal(size=(case.rows, 6))
        world = ThreadWorld(case.cp, timeout=30)

        def layer() -> fb.ToyAttention:
            return layer_cls(compress_ratio=case.r, window_size=case.window, index_topk=3)

        def rank_fn(rank: int) -> dict:
            lay = layer()
            handle = enable_cp(lay, world.mesh(rank), case.config(), plugins=host)
            report: dict[str, Any] = {"cp_rank": rank}
            try:
                local = lay(handle.shard(x, 0), cu_seqlens=case.cu_for_rank(rank))
                report["stats_forward"] = report["stats"] = handle.stats()
                report["out"] = handle.unshard(local, 0)
            except HpCpError as exc:
                report["error"] = f"{type(exc).__name__}: {exc}"
                report["error_types"] = [c.__name__ for c in type(exc).__mro__]
            finally:
                disable_cp(handle)
            report["restored"] = lay.cp_forward is None
            report["trace"] = world.trace(rank)
            return report

        reports = world.run(rank_fn)
        if case.bad_rank is None:
            want = fb.single_device(layer(), x, case.cu_for_rank(0))
            for rep in reports:
                rep["compare"] = {"out": (rep.pop("out"), want)}
        return reports

"""The public import paths of the core's types stay put when a type moves between modules:
``LayerSpec`` lives in ``hp_cp_core.spec`` (so ``plan`` and ``config`` need not import each
other) and is still the same class from ``hp_cp_core`` and ``hp_cp_core.config``."""

from __future__ import annotations

import hp_cp_core
from hp_cp_core import config, plan, spec


def test_layer_spec_from_every_public_path() -> None:
    assert hp_cp_core.LayerSpec is config.LayerSpec is spec.LayerSpec
    assert config.GRIDS is spec.GRIDS
    assert {"LayerSpec", "DeepSeekV4CPConfig", "DeepSeekV4CPContext"} <= set(config.__all__)


def test_plan_and_context_from_every_public_path() -> None:
    assert hp_cp_core.RankPlan is plan.RankPlan
    assert hp_cp_core.build_rank_plan is plan.build_rank_plan
    assert hp_cp_core.DeepSeekV4CPContext is config.DeepSeekV4CPContext
    assert hp_cp_core.DeepSeekV4CPConfig is config.DeepSeekV4CPConfig

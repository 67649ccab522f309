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


def test_family_neutral_names_and_their_0_2_aliases_are_the_same_objects() -> None:
    """0.3.0: the config, context and forward serve the whole family (V4, V4.1, V3.2, GLM-5)
    under neutral names; the 0.2 ``DeepSeekV4*`` names stay importable as plain aliases."""
    from hp_cp_core import batch, forward

    assert hp_cp_core.CPConfig is config.CPConfig is config.DeepSeekV4CPConfig
    assert hp_cp_core.CPContext is config.CPContext is config.DeepSeekV4CPContext
    assert hp_cp_core.CPForward is forward.CPForward is forward.DeepSeekV4CPForward
    assert hp_cp_core.DeepSeekV4CPForward is hp_cp_core.CPForward
    assert (hp_cp_core.CPConfig.__name__, hp_cp_core.CPContext.__name__) == (
        "CPConfig",
        "CPContext",
    )
    assert hp_cp_core.CPBatch is batch.CPBatch and hp_cp_core.plan_batch is batch.plan_batch
    assert {"CPConfig", "CPContext"} <= set(config.__all__)
    assert {"CPConfig", "CPContext", "CPForward", "CPBatch", "plan_batch"} <= set(
        hp_cp_core.__all__
    )

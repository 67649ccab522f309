"""Model adapters by entry point (``hp_cp.torch_models``) and attention kernels by registry
(``hp_cp.torch_kernels``, ``register_kernel``), in one process: discovery imports no model
package, a broken entry point hides no other, two claims on one class are an error naming
both, the shipped integrations come through the same entry points, a custom kernel runs."""

from __future__ import annotations

import importlib.metadata as md
import sys

import pytest
import torch
from torch import nn

from hp_cp_core import DeepSeekV4CPConfig, HpCpError
from hp_cp_torch.adapter import ADAPTER_ATTR, adapter_for, pin_adapter
from hp_cp_torch.attention import run_sparse_attention
from hp_cp_torch.kernels import registry
from hp_cp_torch.kernels.smallop import sparse_attention_smallop
from hp_cp_torch.model.registry import ENTRY_POINT_GROUP, ModelRegistry, adapter_class_for


def ep(name: str, value: str) -> md.EntryPoint:
    return md.EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)


class Attention(nn.Module):
    """A third party's attention class (this module's, ``test_model_registry.Attention``)."""


class Derived(Attention):
    pass


class Other(nn.Module):
    pass


class GoodAdapter:
    claims = (f"{__name__}.Attention",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module


class OtherAdapter(GoodAdapter):
    pass


def test_the_shipped_integrations_register_through_entry_points() -> None:
    names = {e.name: e.value for e in md.entry_points(group=ENTRY_POINT_GROUP)}
    want = {
        "hp_cp_torch.reference.DeepSeekV4Attention": "hp_cp_torch.adapter:ReferenceLayerAdapter",
        "transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4Attention": (
            "hp_cp_torch.integrations.transformers:DeepseekV4AttentionAdapter"
        ),
        "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaAttention": (
            "hp_cp_torch.integrations.transformers_dsa:DSAAttentionAdapter"
        ),
        "nemo_automodel.components.models.deepseek_v41.attention.DeepseekV41Attention": (
            "hp_cp_torch.integrations.nemo_automodel_v41:NemoDeepseekV41AttentionAdapter"
        ),
        "megatron.core.transformer.experimental_attention_variant.absorbed_mla."
        "AbsorbedMLASelfAttention": (
            "hp_cp_torch.integrations.megatron:MegatronDSAAttentionAdapter"
        ),
    }
    assert {k: names.get(k) for k in want} == want
    assert len([v for v in names.values() if v.startswith("hp_cp_torch.")]) == 10


def test_the_reference_layer_gets_its_adapter_from_the_registry() -> None:
    from cases import layer_config

    from hp_cp_torch.reference import DeepSeekV4Attention

    layer = DeepSeekV4Attention(layer_config(4))
    assert type(adapter_for(layer)).__name__ == "ReferenceLayerAdapter"
    assert adapter_for(layer) is not adapter_for(layer)  # not installed: built on demand
    unpin = pin_adapter(layer)
    assert adapter_for(layer) is adapter_for(layer) is layer.__dict__[ADAPTER_ATTR]
    unpin()
    assert ADAPTER_ATTR not in layer.__dict__
    assert adapter_for(nn.Linear(2, 2)) is None


def test_matching_walks_the_mro_and_imports_nothing() -> None:
    reg = ModelRegistry.from_entry_points(
        [
            ep(f"{__name__}:Attention", f"{__name__}:GoodAdapter"),
            ep("not_installed_models.layers:Attn", "not_installed_models_cp:Adapter"),
        ]
    )
    assert adapter_class_for(Derived(), reg) is GoodAdapter  # a subclass of a claimed class
    assert adapter_class_for(Other(), reg) is None
    assert "not_installed_models" not in sys.modules
    assert "not_installed_models_cp" not in sys.modules
    assert reg.problems == []


def test_a_broken_entry_point_hides_no_other() -> None:
    reg = ModelRegistry.from_entry_points(
        [
            ep("broken_by_name", "no_such_package_for_hp_cp:Adapter"),
            ep(f"{__name__}.Other", "no_such_package_for_hp_cp:Adapter"),
            ep("by_claims", f"{__name__}:GoodAdapter"),
        ]
    )
    assert adapter_class_for(Attention(), reg) is GoodAdapter
    assert len(reg.problems) == 1
    assert "'broken_by_name'" in reg.problems[0] and "ModuleNotFoundError" in reg.problems[0]
    with pytest.raises(HpCpError) as err:  # only for the modules it claims
        adapter_class_for(Other(), reg)
    msg = str(err.value)
    assert f"{__name__}.Other" in msg and "no_such_package_for_hp_cp:Adapter" in msg
    assert "failed to load" in msg


def test_two_adapters_claiming_one_class_name_both() -> None:
    reg = ModelRegistry.from_entry_points(
        [
            ep(f"{__name__}.Attention", f"{__name__}:GoodAdapter"),
            ep(f"{__name__}:Attention", f"{__name__}:OtherAdapter"),
            ep("same_again", f"{__name__}:GoodAdapter"),  # the same adapter twice is one
        ]
    )
    with pytest.raises(HpCpError) as err:
        adapter_class_for(Derived(), reg)
    msg = str(err.value)
    assert f"two model adapters claim {__name__}.Attention" in msg
    assert f"{__name__}:GoodAdapter" in msg and f"{__name__}:OtherAdapter" in msg
    assert adapter_class_for(Other(), reg) is None


def test_an_adapter_registered_in_process_shadows_the_entry_points() -> None:
    from hp_cp_torch import ModelAdapter, register_model_adapter, unregister_model_adapter

    class InProcess(ModelAdapter, abstract=True):  # registry matching only: no hook
        pass

    reg = ModelRegistry.from_entry_points([ep(f"{__name__}:Attention", f"{__name__}:GoodAdapter")])
    try:
        register_model_adapter(Attention, InProcess)
        assert adapter_class_for(Derived(), reg) is InProcess  # shadows, and subclasses match
        assert adapter_class_for(Other(), reg) is None
        unregister_model_adapter(f"{__name__}:Attention")  # a qualified name is the class
        assert adapter_class_for(Derived(), reg) is GoodAdapter  # the entry point again
        register_model_adapter(f"{__name__}.Other", InProcess)
        assert adapter_class_for(Other(), reg) is InProcess
    finally:
        unregister_model_adapter(Attention)
        unregister_model_adapter(Other)
    assert adapter_class_for(Other(), reg) is None
    unregister_model_adapter(Other)  # nothing registered: nothing to do


def test_register_model_adapter_refuses_what_it_cannot_use() -> None:
    from hp_cp_torch import register_model_adapter

    with pytest.raises(HpCpError, match="must be a subclass of hp_cp_torch.ModelAdapter"):
        register_model_adapter(Attention, GoodAdapter)
    with pytest.raises(HpCpError, match="must be a class or its qualified name"):
        register_model_adapter("Attention", GoodAdapter)  # not qualified
    assert adapter_class_for(Attention(), ModelRegistry()) is None


def test_a_torch_model_no_adapter_claims_points_at_the_adapter_guide() -> None:
    from hp_cp_core import BackendNotFoundError, enable_cp

    with pytest.raises(BackendNotFoundError) as err:
        enable_cp(Other(), None)  # refused before any mesh or process group is touched
    msg = str(err.value)
    assert f"`{__name__}.Other` (framework: torch)" in msg
    assert "none claims this module or its sub-modules" in msg
    assert "writing-a-model-adapter.md" in msg


# ------------------------------------------------------------------------------ kernels


def _plan_inputs() -> tuple:
    from hp_cp_core.plan import build_rank_plan
    from hp_cp_core.spec import LayerSpec

    spec = LayerSpec(compress_ratio=128, window_size=8)
    plan = build_rank_plan(rank=0, cp_size=1, spec=spec, layout_kind="contiguous", total_rows=300)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, plan.n_local, 2, 16, generator=gen)
    ori = torch.randn(2, plan.n_local, 16, generator=gen)
    cmp_kv = torch.randn(2, 2, 16, generator=gen)
    return q, ori, cmp_kv, plan, torch.randn(2, generator=gen)


def test_a_registered_kernel_runs_with_one_calling_convention() -> None:
    q, ori, cmp_kv, plan, sink = _plan_inputs()
    seen = []

    def gather_kernel(request: registry.AttentionRequest) -> torch.Tensor:
        seen.append(request)
        pool = request.pool()
        chunks = [
            sparse_attention_smallop(request.q[:, lo:hi], pool, idx, request.sink, request.scale)
            for lo, hi, idx in request.column_chunks()
        ]
        return torch.cat(chunks, dim=1)

    registry.register_kernel("test_gather", gather_kernel)
    try:
        assert "test_gather" in registry.kernel_names()
        args = (q, ori, cmp_kv, plan, None, sink, 0.25)
        got = run_sparse_attention(*args, kernel="test_gather", query_chunk=64)
        want = run_sparse_attention(*args, kernel="smallop", query_chunk=64)
        assert len(seen) == 1 and seen[0].query_chunk == 64 and seen[0].plan is plan
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        banded = run_sparse_attention(*args, kernel="banded", query_chunk=64)
        torch.testing.assert_close(got, banded, rtol=1e-5, atol=1e-6)
    finally:
        registry.unregister_kernel("test_gather")
    assert "test_gather" not in registry.kernel_names()


def test_an_unknown_kernel_lists_the_registered_ones() -> None:
    DeepSeekV4CPConfig(attention_kernel="not_a_kernel")  # the core no longer knows the names
    with pytest.raises(HpCpError) as err:
        registry.kernel_named("not_a_kernel")
    msg = str(err.value)
    assert "attention_kernel='not_a_kernel' is not a registered torch kernel" in msg
    for name in ("banded", "smallop", "efficient", "triton", "model_ops", "example_dense"):
        assert repr(name) in msg
    assert "register_kernel" in msg and "hp_cp.torch_kernels" in msg
    with pytest.raises(HpCpError, match="non-empty string"):
        registry.register_kernel("", lambda r: r)
    with pytest.raises(HpCpError, match="must be callable"):
        registry.register_kernel("x", 3)


def test_model_ops_is_its_own_kernel() -> None:
    assert registry.uses_model_op_order("model_ops")
    assert not any(registry.uses_model_op_order(k) for k in ("smallop", "banded", "efficient"))
    q, ori, cmp_kv, plan, sink = _plan_inputs()
    args = (q, ori, cmp_kv, plan, None, sink, 0.25)
    torch.testing.assert_close(
        run_sparse_attention(*args, kernel="model_ops"),
        run_sparse_attention(*args, kernel="smallop"),
        rtol=0,
        atol=0,
    )


def test_the_megatron_kernel_runs_only_on_megatrons_layers() -> None:
    """``attention_kernel="megatron"`` asks for the adapter's own attention (the Megatron
    adapter's: megatron-core's sparse attention, ``tests/megatron``); a layer without one
    reaches the kernel itself, which refuses, naming the fix."""
    assert registry.uses_model_op_order("megatron")
    assert registry.kernel_precision("megatron") == "model"
    q, ori, cmp_kv, plan, sink = _plan_inputs()
    with pytest.raises(HpCpError, match="only on the layers of hp_cp_torch.integrations.megatron"):
        run_sparse_attention(q, ori, cmp_kv, plan, None, sink, 0.25, kernel="megatron")

"""The precision the attention computes in (hp_cp_torch.kernels.precision): every kernel's is
stated, ``attention_precision="model"`` runs the model's own op sequence in its dtype (a tiny HF
DeepSeek V4 in bf16 at cp 1 through the CP path rounds as transformers' eager attention
does), and an integration without that path refuses it at ``enable_cp``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hp_cp_core import DeepSeekV4CPConfig, HpCpError
from hp_cp_core.config import PRECISIONS


def test_every_kernel_states_its_precision() -> None:
    from hp_cp_torch.kernels.precision import KERNEL_PRECISION
    from hp_cp_torch.kernels.registry import SHIPPED

    # every shipped kernel but the model's own op order, in the model's dtype ("model_ops",
    # and "megatron": megatron-core's own sparse attention)
    assert set(KERNEL_PRECISION) == set(SHIPPED) - {"model_ops", "megatron"}
    assert set(KERNEL_PRECISION.values()) == {"fp32"}
    assert PRECISIONS == ("fp32", "model")


def test_each_kernel_carries_its_precision() -> None:
    from hp_cp_torch.kernels.precision import KERNEL_PRECISION
    from hp_cp_torch.kernels.registry import (
        SHIPPED,
        kernel_precision,
        register_kernel,
        unregister_kernel,
    )

    for name in SHIPPED:
        want = "model" if name in ("model_ops", "megatron") else KERNEL_PRECISION[name]
        assert kernel_precision(name) == want, name

    class Bf16Kernel:
        precision = "model"

        def __call__(self, request):
            raise AssertionError("not called")

    register_kernel("test_bf16_kernel", Bf16Kernel())
    register_kernel("test_silent_kernel", lambda request: None)
    try:
        assert kernel_precision("test_bf16_kernel") == "model"
        assert kernel_precision("test_silent_kernel") is None  # it does not say
    finally:
        unregister_kernel("test_bf16_kernel")
        unregister_kernel("test_silent_kernel")


def test_an_unknown_precision_is_refused() -> None:
    with pytest.raises(HpCpError, match="attention_precision='bf16' is not a precision"):
        DeepSeekV4CPConfig(attention_precision="bf16")


MODEL_PRECISION = """
import json, torch, torch.distributed as dist
from hp_cp_core import DeepSeekV4CPConfig, HpCpError, disable_cp, enable_cp
from hp_cp_torch.cli.parity import build_tiny_model, make_inputs
from hp_cp_torch.reference import DeepSeekV4Attention, DeepSeekV4AttentionConfig
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = build_tiny_model(0)
ids = make_inputs(model.config.vocab_size, 1, 264, 0)
pos = torch.arange(264)[None]
with torch.no_grad():
    exact = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    model.to(torch.bfloat16)
    own = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
    errs = {}
    for precision in ("fp32", "model"):
        config = DeepSeekV4CPConfig(attention_precision=precision, single_rank_bypass=False)
        handle = enable_cp(model, dist.group.WORLD, config)
        batch = handle.batch(ids)
        out = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                    use_cache=False).logits.float()
        disable_cp(handle)
        errs[precision] = {"vs_own": float((out - own).abs().max()),
                           "vs_fp32": float((out - exact).abs().max())}
errs["own_vs_fp32"] = float((own - exact).abs().max())
layer = DeepSeekV4Attention(DeepSeekV4AttentionConfig(compress_ratio=4))
try:
    enable_cp(layer, dist.group.WORLD, DeepSeekV4CPConfig(attention_precision="model"))
    errs["refused"] = "no error"
except HpCpError as e:
    errs["refused"] = str(e)
print(json.dumps(errs))
"""


def test_model_precision_rounds_as_the_model() -> None:
    """bf16 tiny V4, cp 1 through the CP path: with ``attention_precision="model"`` the logits
    are nearer transformers' own bf16 forward than the fp32 kernel's are (which are nearer the
    fp32 model instead); the reference layer has no model op sequence: HpCpError."""
    out = subprocess.run(
        [sys.executable, "-c", MODEL_PRECISION], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    errs = json.loads(out.stdout.strip().splitlines()[-1])
    assert errs["model"]["vs_own"] < errs["fp32"]["vs_own"], errs
    assert errs["model"]["vs_own"] < 0.5 * errs["own_vs_fp32"], errs
    assert "no copy of the model's own attention ops" in errs["refused"], errs
    assert "DeepSeekV4Attention" in errs["refused"], errs


def test_the_bench_casts_as_from_pretrained_does() -> None:
    """``cast_like_from_pretrained``: DeepSeek V4's ``_keep_in_fp32_modules_strict`` (sinks,
    hyper-connections, norms) stay fp32, the projections go bf16, as HF loads the model."""
    pytest.importorskip("transformers.models.deepseek_v4", exc_type=ImportError)
    import torch

    from hp_cp_torch.bench.precision import build_model, cast_like_from_pretrained

    model = cast_like_from_pretrained(build_model("v4", 0, 64, tiny=True), torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    attn = "model.layers.0.self_attn"
    assert dtypes[f"{attn}.sinks"] == torch.float32
    assert dtypes[f"{attn}.q_a_norm.weight"] == torch.float32
    assert dtypes[f"{attn}.q_b_proj.weight"] == torch.bfloat16
    assert any(".attn_hc." in n and d == torch.float32 for n, d in dtypes.items())


def test_pick_difference_counts_only_choosing_queries() -> None:
    """Queries that see at most k candidates keep them all: not counted. Of the others, the
    fraction of the reference's picks the run did not pick."""
    import torch

    from hp_cp_torch.bench.precision import pick_difference

    seq, k = 6, 2  # DSA: query t sees t + 1 tokens; queries 2 .. 5 choose
    want = torch.tensor([[0, -1], [0, 1], [2, 1], [3, 0], [4, 2], [5, 1]])
    got = want.clone()
    got[0, 1] = 0  # not choosing: ignored
    got[3] = torch.tensor([0, 3])  # the same set, another order
    got[5, 1] = 4  # one of 8 choosing picks differs
    assert pick_difference("v32", {0: got}, {0: want}, seq, None, k) == 1 / 8

"""``hp-cp bench --real-widths`` (:mod:`hp_cp_torch.bench.real_widths`) without its launches:
the models keep every published attention width, build in bf16 with HF's fp32 modules, one
step runs and is profiled at tiny widths, and the sweep's keys, fit and skips are right."""

from __future__ import annotations

import json

import pytest
import torch

from hp_cp_torch.bench import real_widths

ATTENTION_WIDTHS = {
    "deepseek_v4": (
        "hidden_size num_attention_heads head_dim qk_rope_head_dim q_lora_rank o_lora_rank "
        "o_groups index_n_heads index_head_dim index_topk sliding_window hc_mult"
    ),
    "deepseek_v32": (
        "hidden_size num_attention_heads kv_lora_rank qk_rope_head_dim qk_nope_head_dim "
        "v_head_dim q_lora_rank index_n_heads index_head_dim index_topk"
    ),
    "glm_moe_dsa": (
        "hidden_size num_attention_heads kv_lora_rank qk_rope_head_dim qk_nope_head_dim "
        "v_head_dim q_lora_rank index_n_heads index_head_dim index_topk"
    ),
}

TINY = {
    "deepseek_v4": dict(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=64,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=4,
        sliding_window=16,
        moe_intermediate_size=16,
    ),
    "deepseek_v32": dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=8,
        moe_intermediate_size=16,
    ),
}
TINY["glm_moe_dsa"] = TINY["deepseek_v32"]


@pytest.mark.parametrize("name", list(real_widths.REAL_MODELS))
def test_models_keep_every_published_attention_width(name: str) -> None:
    import transformers

    config_cls = getattr(transformers, real_widths._CLASSES[name][0])
    default = config_cls()
    ours = config_cls(**{**real_widths.REDUCED, **real_widths.REAL_MODELS[name]})
    for key in ATTENTION_WIDTHS[name].split():
        assert getattr(ours, key) == getattr(default, key), key
    assert ours.num_hidden_layers == 2


@pytest.mark.parametrize("name", list(real_widths.REAL_MODELS))
def test_one_profiled_bf16_step_at_tiny_widths(name: str) -> None:
    model = real_widths.build_real_model(name, **TINY[name])
    dtypes = {p.dtype for n, p in model.named_parameters() if ".self_attn." in n}
    assert torch.bfloat16 in dtypes
    if name == "deepseek_v4":  # HF keeps hyper-connections and sinks in fp32
        assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "hc" in n)
        assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "sinks" in n)
    res = real_widths.real_point(0, 1, name, 64, False, True, TINY[name], oom_first=False)
    assert res["loss_finite"] and res["peak"] is not None
    assert res["live_peak"] > 0 and res["matmul_flops"] > 0
    assert res["attn_useful_flops"] > 0 and res["top_ops"]


def _fake_ranks(world: int, fn, name: str, seq: int, regather: bool, profile: bool, **_):
    """Peaks of 1000 bytes per local row plus 10**6 (regather: 900 per row), all ranks."""
    per_row = 900 if regather else 1000
    peak = per_row * seq // world + 10**6
    rank = {
        "peak": peak,
        "rss_before": 10**6,
        "seconds": 1.0,
        "warm_seconds": 1.0,
        "build_seconds": 1.0,
        "loss": 7.0,
        "loss_finite": True,
    }
    return [dict(rank) for _ in range(world)]


def test_sweep_keys_fit_and_skips(tmp_path, monkeypatch) -> None:
    from hp_cp_torch.cli import launch

    monkeypatch.setattr(launch, "run_ranks", _fake_ranks)
    out = tmp_path / "bench-real.json"
    res = real_widths.real_measures(
        ("deepseek_v4",),
        (4096, 8192, 16384),
        (4, 8),
        (False, True),
        single=False,
        profile=False,
        max_total_bytes=8 * (1000 * 16384 // 8 + 2 * 10**6) - 1,  # cp 8 at 16384 is over
        out=str(out),
        log=lambda *_: None,
    )
    assert res["real_deepseek_v4_peak_bytes_cp4_s4096"] == 1000 * 1024 + 10**6
    assert res["real_deepseek_v4_peak_bytes_cp8_s8192_regather"] == 900 * 1024 + 10**6
    assert res["real_deepseek_v4_bytes_per_local_row"] == pytest.approx(1000)
    assert res["real_deepseek_v4_bytes_per_local_row_regather"] == pytest.approx(900)
    assert "deepseek_v4_cp8_s16384" in res["real_skipped"]
    assert "real_deepseek_v4_peak_bytes_cp8_s16384" not in res
    assert "real_deepseek_v4_peak_bytes_cp4_s16384" in res
    written = json.loads(out.read_text())
    assert written["real_deepseek_v4_peak_bytes_cp4_s4096"] == 1000 * 1024 + 10**6


def test_a_profiled_point_that_dies_is_measured_again_without_the_profiler(monkeypatch) -> None:
    from hp_cp_torch.cli import launch

    calls = []

    def ranks(world, fn, name, seq, regather, profile, **kw):
        calls.append(profile)
        if profile:
            raise RuntimeError("rank 0 died without a result (exit -9)")
        return _fake_ranks(world, fn, name, seq, regather, profile, **kw)

    monkeypatch.setattr(launch, "run_ranks", ranks)
    res = real_widths.real_measures(
        ("glm_moe_dsa",),
        (4096,),
        (4,),
        (False, True),
        single=False,
        profile=True,
        log=lambda *_: None,
    )
    assert calls == [True, False, False]  # the next point is not profiled again
    assert res["real_glm_moe_dsa_peak_bytes_cp4_s4096"] == 1000 * 1024 + 10**6
    assert "exit -9" in res["real_glm_moe_dsa_profile_failed_cp4_s4096"]
    assert "real_failed" not in res

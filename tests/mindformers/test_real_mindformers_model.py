"""The REAL mindformers 2.1.0 ``PyNativeDeepseekV4ForCausalLM`` trains on one CPU process with the
CPU stand-ins of ``mf_cpu_standins`` and ``mf_model_standins`` (``mf_model_check.py``, run in a
fresh interpreter: it stubs ``hyper_parallel`` and installs the stand-ins), and ``enable_cp``
on the whole model finds its CSA cells and RoPEs their parents at global positions. The model
under CP against one device: ``test_real_mindformers_model_msrun.py``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import pytest
from mf_require import mindspore_or_skip, required_or_skip

mindspore_or_skip()

pytestmark = [pytest.mark.real_mindformers]

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def report() -> dict:
    if importlib.util.find_spec("mindformers") is None:
        required_or_skip(
            "mindformers is not installed (`pip install --no-deps mindformers==2.1.0`)"
        )
    scratch = tempfile.mkdtemp(prefix="hp_cp_mf_model_")  # mindformers logs to ./output/log
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "mf_model_check.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, GLOG_v="3"),
        cwd=scratch,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rep = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in rep:
        required_or_skip(rep["skip"])
    assert "import_error" not in rep, rep["import_error"]
    return rep


def test_a_training_step_runs_and_reaches_every_parameter(report: dict) -> None:
    assert 0 < report["loss"] < 50, report["loss"]
    assert report["nonfinite_grads"] == [], report["nonfinite_grads"]
    assert report["zero_grads"] == [], report["zero_grads"]  # MoE, MTP, HC, HCA included
    assert report["mtp_params"] > 0 and report["moe_params"] > 0 and report["hc_params"] > 0
    assert report["logits_shape"] == [136, 128] and report["logits_finite"]


def test_enable_cp_finds_the_csa_cells_and_wraps_their_parents_rope(report: dict) -> None:
    ratios = [r for _, r in report["layers"]]
    assert ratios == [0, 4, 128, 0], report["layers"]  # 3 decoder layers + the MTP layer
    assert report["rotary_under_cp"] == ["GlobalPositionRotary"] * 4
    assert report["wrapped_rows"] == [0, 1, 2, 3, 4]  # one rank: the global rows are 0..L-1
    assert report["rotary_after_disable"] == [
        "RotaryEmbedding",
        "YarnRotaryEmbedding",
        "YarnRotaryEmbedding",
        "RotaryEmbedding",
    ]

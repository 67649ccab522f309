"""The adapter on the REAL mindformers 2.1.0 ``CompressedSparseAttention`` on a group of one, and
the project's copy of the cell (``tests/mindformers/mf_reference.py``) against the real cell (see
``mf_real_check.py``, run in a fresh interpreter because it stubs ``hyper_parallel`` and
installs CPU stand-ins for kernels MindSpore 2.10 CPU lacks). Missing mindformers fails these
tests when ``HP_CP_REQUIRE_BACKEND`` names mindformers."""

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

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def report() -> dict:
    if importlib.util.find_spec("mindformers") is None:
        required_or_skip(
            "mindformers is not installed (`pip install --no-deps mindformers==2.1.0`)"
        )
    env = dict(os.environ, GLOG_v="3")
    scratch = tempfile.mkdtemp(prefix="hp_cp_mf_real_")  # mindformers logs to ./output/log
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "mf_real_check.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=scratch,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rep = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in rep:
        required_or_skip(rep["skip"])
    assert "import_error" not in rep, rep["import_error"]
    return rep


@pytest.mark.parametrize("r", ["0", "4", "128"])
def test_adapter_maps_a_real_instance(report: dict, r: str) -> None:
    m = report["mapping"][r]
    assert m["type"].startswith("mindformers.pynative.") and m["is_adapter"]
    assert m["compressor"] and m["attn_sink"]
    assert m["window_size"] == [8, 8] and m["compress_ratio"] == [int(r), int(r)]
    assert m["has_indexer"] == m["indexer_compressor"] == (r == "4")
    # no force_unfused on the real class: apply_dsa_kernel_fusion=False maps to True
    assert not m["has_force_unfused_attr"] and not m["apply_dsa_kernel_fusion"]
    assert m["force_unfused"] is True
    assert m["spec"] == [int(r), 8, r == "4", "global"]
    assert m["attn_fn"].startswith("mindformers.")  # the real primitive, not the reference's


def test_cp_stages_reproduce_the_real_cell(report: dict) -> None:
    assert set(report["parity"]) == {
        "r0-S20-packed",
        "r4-S22-padded",
        "r4-S24-packed",
        "r128-S300-padded",
        "r128-S400-packed",
    }
    for name, res in report["parity"].items():
        assert res["out"] <= 1e-5, (name, res)
        assert res["grad"] <= 1e-4, (name, res)


def test_the_copy_equals_the_real_cell(report: dict) -> None:
    """Same weights, training mode with the indexer KL loss: the copy's output, logged loss and
    every gradient equal the real cell's (so the copy is no second source of truth)."""
    got = report["copy_vs_real"]
    assert set(got) == {"r0-S20-padded", "r4-S22-padded", "r4-S24-packed", "r128-S300-packed"}
    for name, res in got.items():
        assert res["names_equal"], (name, "parameter names differ")
        assert res["out"] <= 1e-6 and res["grad"] <= 1e-6, (name, res)
        if name.startswith("r4"):
            assert res["loss_real"] > 0 and res["loss"] <= 1e-6, (name, res)


def test_what_mindformers_own_csa_cp_refuses(report: dict) -> None:
    """MindFormers' own ``CompressedSparseAttentionContextParallel`` (the side-by-side anchor of
    ``nox -s bench_mindformers``) refuses packed input and local rows that are not a multiple
    of r, and has no load-balanced layout; hp_cp runs all of these (the msrun tests)."""
    got = report["anchor_refuses"]
    assert got["packed"].startswith("ValueError") and "actual_seq_len" in got["packed"], got
    for name in ("local_rows_not_multiple_of_r", "local_rows_not_multiple_of_r128"):
        assert got[name].startswith("ValueError") and "divisible by compress_ratio" in got[name]
    assert "contiguous only" in got["load_balanced"]

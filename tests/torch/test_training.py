"""Training under CP with the recipe of ``examples/train_deepseek_v4_cp.py``: FSDP2 and DDP over
the flattened (dp, cp) mesh match one process on the global batch step by step (losses and
final weights), so does HF's activation checkpointing; torch.distributed.checkpoint resumes
on the same mesh with bitwise-identical next-step losses and on a different cp size; the
reference layer gives the same output and gradients inside torch's non-reentrant checkpoint
and under torch.compile. One 4-rank gloo job (``training_cases.py``).
"""

from __future__ import annotations

import os

import pytest

if "transformers" in os.environ.get("HP_CP_REQUIRE_BACKEND", ""):
    import transformers.models.deepseek_v4  # noqa: F401 - must be importable: fail, not skip
else:
    pytest.importorskip("transformers.models.deepseek_v4", exc_type=ImportError)

import training_cases as tc  # noqa: E402 - after the skip
from cases import rel_err  # noqa: E402
from dist_utils import run_ranks  # noqa: E402

pytestmark = pytest.mark.slow

LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-5


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> dict:
    ckpt = tmp_path_factory.mktemp("ckpt")
    return run_ranks(4, tc.training_suite, str(ckpt), timeout=600, pg_timeout=300)[0]


def _close(got: list[float], want: list[float], rtol: float) -> None:
    assert len(got) == len(want) == tc.STEPS or len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= rtol * abs(b), (step, a, b)


@pytest.mark.parametrize("run", ["fsdp", "ddp", "fsdp_hf_checkpointing"])
def test_matches_one_process_on_the_global_batch(suite: dict, run: str) -> None:
    want, got = suite["single"], suite[run]
    _close(got["losses"], want["losses"], LOSS_RTOL)
    moved = 0
    for name, ref in want["params"].items():
        assert rel_err(got["params"][name], ref) <= PARAM_RTOL, name
        moved += not (got["params"][name] == tc.full_params_init()[name]).all()
    assert moved > 0  # it trains


def test_resume_on_the_same_mesh_is_bitwise_identical(suite: dict) -> None:
    straight, resumed = suite["straight"], suite["resumed"]
    assert resumed["losses"] == straight["losses"][tc.SAVE_AT :]
    for name, ref in straight["params"].items():
        assert (resumed["params"][name] == ref).all(), name


def test_resume_on_a_different_cp_size(suite: dict) -> None:
    _close(suite["resumed_cp4"]["losses"], suite["straight"]["losses"][tc.SAVE_AT :], LOSS_RTOL)


@pytest.mark.parametrize("mode", ["checkpoint", "compile"])
def test_activation_checkpointing_and_compile_keep_parity(suite: dict, mode: str) -> None:
    want, got = suite["layer"]["plain"], suite["layer"][mode]
    if mode == "compile":
        assert got["graphs"] >= 1
    assert got["out"].shape == (2, tc.SEQ, 32)
    assert rel_err(got["out"], want["out"]) <= 1e-6
    assert rel_err(got["gx"], want["gx"]) <= 1e-6
    assert rel_err(got["indexer_loss"], want["indexer_loss"]) <= 1e-6
    for name, ref in want["pgrads"].items():
        assert rel_err(got["pgrads"][name], ref) <= 1e-6, name

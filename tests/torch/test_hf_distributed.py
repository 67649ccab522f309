"""CP next to Hugging Face's own parallelism: ``from_pretrained(...,
distributed_config=DistributedConfig(...))`` (TP / EP on the experts, FSDP2 by HF) plus
``cp_layout_from_hf_model`` match one process on the global batch: the first step's
gradients and the losses of 3 AdamW steps (on new batches), for every layout; a
torch.distributed.checkpoint saved on one layout resumes on another; CP on ``tp`` is refused
on every rank. One 4-rank gloo job (``hf_distributed_cases.py``).
"""

from __future__ import annotations

import os
import re

import pytest

if "transformers" in os.environ.get("HP_CP_REQUIRE_BACKEND", ""):
    import accelerate  # noqa: F401 - from_pretrained(distributed_config=...) needs it
    import transformers.models.deepseek_v4  # noqa: F401 - must be importable: fail, not skip
else:
    pytest.importorskip("accelerate", exc_type=ImportError)
    pytest.importorskip("transformers.models.deepseek_v4", exc_type=ImportError)

import hf_distributed_cases as hc  # noqa: E402 - after the skip
from dist_utils import run_ranks  # noqa: E402

pytestmark = pytest.mark.slow

LOSS_TOL = 1e-6  # relative
GRAD_TOL = 1e-4  # per parameter: max abs difference over its scale, floored at
GRAD_FLOOR = 1e-3  # this fraction of the model's largest gradient (some are only rounding noise)


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    model_dir = tmp_path_factory.mktemp("model")
    ckpt = tmp_path_factory.mktemp("ckpt")
    return run_ranks(
        4, hc.hf_distributed_suite, str(model_dir), str(ckpt), timeout=600, pg_timeout=300
    )


def _close_losses(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= LOSS_TOL * abs(b), (step, a, b)


@pytest.mark.parametrize("name", list(hc.LAYOUTS))
def test_training_matches_one_process(suite: list[dict], name: str) -> None:
    want, got = suite[0]["single"], suite[0][name]
    assert got["cp_size"] == 2
    _close_losses(got["losses"], want["losses"])
    for rank in range(4):  # every rank reports the same global loss
        assert suite[rank][name]["losses"] == got["losses"], rank
    assert set(got["grads"]) == set(want["grads"]) and len(want["grads"]) > 50
    assert not any(".indexer." in n for n in got["grads"])  # frozen
    largest = max(g.abs().max().item() for g in want["grads"].values())
    for n, ref in want["grads"].items():
        scale = max(ref.abs().max().item(), GRAD_FLOOR * largest)
        err = (got["grads"][n].double() - ref.double()).abs().max().item() / scale
        assert err <= GRAD_TOL, (n, err)


def test_trains(suite: list[dict]) -> None:
    single = suite[0]["single"]
    assert max(g.abs().max().item() for g in single["grads"].values()) > 0
    assert len(set(single["losses"])) == hc.STEPS  # different batches, moving weights


def test_checkpoint_saved_on_one_layout_resumes_on_another(suite: list[dict]) -> None:
    want, got = suite[0]["single"], suite[0]["resumed"]
    assert hc.SAVE_FROM != hc.RESUME_ON
    _close_losses(got["losses"], want["losses"][hc.SAVE_AT :])


def test_cp_on_tp_is_refused_on_every_rank(suite: list[dict]) -> None:
    for rank in range(4):
        msg = suite[rank]["refused"]["tp"]
        assert "axis='tp'" in msg and "axis='fsdp'" in msg and "same batch" in msg, (rank, msg)


def test_a_tp_plan_sharding_the_attention_is_refused_on_every_rank(suite: list[dict]) -> None:
    for rank in range(4):
        msg = suite[rank]["refused"]["tp_attention"]
        assert "self_attn.q_b_proj" in msg and "replicated" in msg, (rank, msg)


class _Manager:  # transformers 5.23's mesh manager, as cp_layout_from_hf_model reads it
    def get_mesh(self, dims: str) -> str:
        return f"mesh[{dims}]"


def _model(manager: object = None, **sizes: int) -> object:
    from types import SimpleNamespace

    from transformers import DistributedConfig

    config = SimpleNamespace(distributed_config=DistributedConfig(**sizes) if sizes else None)
    return SimpleNamespace(config=config, _mesh_manager=manager)


@pytest.mark.parametrize(
    ("model", "axis", "want"),
    [
        (_model(), "fsdp", "not loaded with a DistributedConfig"),
        (_model(_Manager(), tp_size=2, fsdp_size=2), "tp", "same batch"),
        (_model(_Manager(), ep_size=2, fsdp_size=2), "ep", "axis='fsdp' or axis='dp_replicate'"),
        (_model(_Manager(), fsdp_size=4), "cp", "not an axis of HF's device mesh"),
        (_model(object(), fsdp_size=4), "fsdp", "transformers 5.23"),  # HF changed its layout
    ],
)
def test_bad_layouts_raise_a_clear_error(model: object, axis: str, want: str) -> None:
    from hp_cp_core import HpCpError
    from hp_cp_torch.integrations.transformers import cp_layout_from_hf_model

    with pytest.raises(HpCpError, match=re.escape(want)):
        cp_layout_from_hf_model(model, axis=axis)


def test_the_layout_reads_hf_s_meshes_and_divide_factor() -> None:
    from hp_cp_torch.integrations.transformers import cp_layout_from_hf_model

    model = _model(_Manager(), ep_size=2, dp_replicate_size=2, fsdp_size=2)
    layout = cp_layout_from_hf_model(model, axis="dp_replicate")
    assert (layout.cp_mesh, layout.dp_mesh) == ("mesh[dp_replicate]", "mesh[fsdp]")
    assert layout.grad_divide_factor == 4


def test_the_recipe_parses_hf_parallel() -> None:
    from training_cases import recipe

    parse = recipe().parse_hf_parallel
    assert parse("tp2,ep2,fsdp2") == {"tp_size": 2, "ep_size": 2, "fsdp_size": 2}
    assert parse("ep2, dp_replicate2,fsdp2") == {
        "ep_size": 2,
        "dp_replicate_size": 2,
        "fsdp_size": 2,
    }
    with pytest.raises(SystemExit, match="'cp2' is not tpN, epN, fsdpN or dp_replicateN"):
        parse("tp2,cp2")

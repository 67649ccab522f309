"""Run in a fresh interpreter by ``test_real_mindformers_model.py``: the REAL mindformers 2.1.0
``PyNativeDeepseekV4ForCausalLM`` (tiny, ``mf_real_model``; sliding-window, CSA and HCA
layers, MoE, hyper-connections, one MTP layer) trains on one CPU process with the CPU
stand-ins (``mf_cpu_standins`` + ``mf_model_standins``). Prints one JSON line.

Checks: a training step (the model's own loss, the indexer KL loss, the MTP loss) gives a
finite loss and a finite gradient for every trainable parameter; ``enable_cp`` on the model
finds its four CSA cells and puts their parents' RoPE at global positions (restored by
``disable_cp``). The model under CP against one device: ``mf_model_msrun_worker.py``.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mf_real_env as env  # noqa: E402  (stubs, CPU stand-ins, the real classes)

REPORT: dict = {}

if env.SKIP_REASON or env.IMPORT_ERROR:
    REPORT["skip" if env.SKIP_REASON else "import_error"] = env.SKIP_REASON or env.IMPORT_ERROR
    print(json.dumps(REPORT))
    sys.exit(0)

import mf_real_model as mdl  # noqa: E402
import numpy as np  # noqa: E402

from hp_cp_core import DeepSeekV4CPConfig, disable_cp, enable_cp  # noqa: E402
from hp_cp_mindformers.rope import GlobalPositionRotary  # noqa: E402

SEQ = 136  # > 128: the HCA layer has one slot


class OneRankMesh:
    """A HyperParallel-style mesh of one rank (no communication)."""

    ndim = 1

    def size(self) -> int:
        return 1

    def get_local_rank(self) -> int:
        return 0

    def get_group(self) -> str:
        raise AssertionError("a mesh of one rank needs no communication group")


def parents_rotary(model) -> list[str]:
    return [
        type(cell.rotary_pos_emb).__name__
        for _, cell in model.cells_and_names()
        if hasattr(cell, "core_attention") and hasattr(cell, "rotary_pos_emb")
    ]


def main() -> None:
    model = mdl.tiny_model(mtp=1, seed=3)
    ids, labels = mdl.sample(SEQ, seed=4)
    mask = np.ones(ids.shape, np.float32)
    loss0, grads0 = mdl.loss_and_grads(model, ids, labels, mask, total_tokens=ids.size)
    logits0 = mdl.logits(model, ids, labels)
    REPORT["logits_shape"] = list(logits0.shape)
    REPORT["logits_finite"] = bool(np.isfinite(logits0).all())
    REPORT["loss"] = loss0
    REPORT["n_params"] = len(grads0)
    REPORT["nonfinite_grads"] = [k for k, g in grads0.items() if not np.isfinite(g).all()]
    REPORT["zero_grads"] = [k for k, g in grads0.items() if not np.abs(g).max() > 0]
    REPORT["mtp_params"] = sum(1 for k in grads0 if k.startswith("mtp."))
    REPORT["moe_params"] = sum(1 for k in grads0 if ".mlp.experts." in k or ".router." in k)
    REPORT["hc_params"] = sum(1 for k in grads0 if "_hc." in k or "hc_head" in k)

    handle = enable_cp(model, OneRankMesh(), DeepSeekV4CPConfig(single_rank_bypass=False))
    REPORT["layers"] = [[type(m).__name__, spec.compress_ratio] for m, spec in handle.layers]
    REPORT["rotary_under_cp"] = parents_rotary(model)
    wrapped = [
        cell.rotary_pos_emb
        for _, cell in model.cells_and_names()
        if isinstance(getattr(cell, "rotary_pos_emb", None), GlobalPositionRotary)
    ]
    REPORT["wrapped_rows"] = wrapped[0].global_rows(5).tolist() if wrapped else None
    disable_cp(handle)
    REPORT["rotary_after_disable"] = parents_rotary(model)
    print(json.dumps(REPORT))


if __name__ == "__main__":
    main()

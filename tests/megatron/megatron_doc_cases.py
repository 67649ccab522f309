"""docs/megatron.md's training-loop block (``<!-- tested: megatron-forward-step -->``), run as
the page says: its ``handle`` and ``forward_step`` on Megatron's CP group (cp 2), one step of
Megatron's ``forward_backward_func`` fed ``(tokens, cu)`` of the full packed sequence; every
gradient against the same model on one process (``megatron_cases.reference``)."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import megatron_cases as mc  # noqa: E402
from megatron_model import build_gpt_model, init_parallel  # noqa: E402
from megatron_shims import forward_backward_func_on_cpu, megatron_cpu_shims  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _doc_blocks() -> SimpleNamespace:
    return SimpleNamespace(**runpy.run_path(str(ROOT / "tests" / "doc_blocks.py")))


def doc_block_suite(rank: int, world: int) -> dict[str, Any]:
    """The block's step at cp ``world``: the largest gradient error relative to each
    parameter's one-process gradient (floored at 1e-2 of the largest)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from hp_cp_core import disable_cp

    torch.set_num_threads(1)
    with megatron_cpu_shims():
        init_parallel(1)
        ref = mc.reference("dense", "packed")
        init_parallel(world)
        config = mc.config_for("dense", world)
        dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        config.finalize_model_grads_func = mc.finalize_on_cpu(dp_cp, False)
        model = build_gpt_model(config, vocab_size=mc.VOCAB)
        model.train()
        ns = _doc_blocks().run("megatron-forward-step", {"model": model, "config": config})
        tokens = mc.tokens("packed")
        try:
            with forward_backward_func_on_cpu():
                get_forward_backward_func()(
                    forward_step_func=ns["forward_step"],
                    data_iterator=iter([(tokens, mc.CU)]),
                    model=[model],
                    num_microbatches=1,
                    seq_length=tokens.shape[1],
                    micro_batch_size=1,
                    forward_only=False,
                )
        finally:
            disable_cp(ns["handle"])
    largest = max(float(g.abs().max()) for g in ref["grads"].values())
    errors = {}
    for name, p in model.named_parameters():
        want = ref["grads"][name]
        got = torch.zeros_like(want) if p.grad is None else p.grad
        scale = max(float(want.abs().max()), 1e-2 * largest)
        errors[name] = float((got - want).abs().max()) / scale
    return {"grad_rel_err": errors}

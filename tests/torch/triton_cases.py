"""Rank functions and the example plugin of tests/torch/test_triton.py (without a GPU the
kernels run in Triton's interpreter: ``TRITON_INTERPRET=1`` comes from conftest.py, and the
spawned ranks inherit it)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from cases import Case, parity_case, run_reference_layer_cp

from hp_cp_core import DeepSeekV4CPConfig, hookimpl
from hp_cp_torch.attention import run_sparse_attention
from hp_cp_torch.reference import DeepSeekV4Attention


class TritonAttention:
    """The example of docs/overriding-a-stage.md: a plugin that takes only
    ``hp_cp_run_attention``, only for the layers it supports (reference layers without an
    indexer), and runs them on the Triton kernel; every other layer, and every other stage,
    stays with the torch backend."""

    def __init__(self) -> None:
        self.calls = 0

    @hookimpl(tryfirst=True)
    def hp_cp_run_attention(self, module, query, ori_ext, x, qr, call):
        if not isinstance(module, DeepSeekV4Attention) or call.spec.has_indexer:
            return None  # not ours: the next implementation (the torch backend) runs
        self.calls += 1
        cmp_kv = None if call.cmp_kv_global is None else call.cmp_kv_global.transpose(0, 1)
        o = run_sparse_attention(
            query.transpose(0, 1),  # [B, L, H, D]
            ori_ext.transpose(0, 1),  # [B, E, D]
            cmp_kv,  # [B, N, D] or None
            call.plan,
            None,  # no indexer picks: the window, then every visible slot (r = 128, if any)
            module.attn_sink,
            module.softmax_scale,
            kernel="triton",
            query_chunk=call.config.query_chunk,
        )
        return module.output(o, call.extra["state"].positions)


# the reference layer under CP with attention_kernel="triton" (CSA with the indexer, packed;
# a bf16 sliding-window layer): few rows, the interpreter runs a program per query row
CONFIG_CASES = [
    parity_case(2, 4, "load_balanced", True, kernel="triton", seed=1),
    parity_case(2, 0, "contiguous", True, dtype="bfloat16", kernel="triton"),
]
# the plugin takes the layer without an indexer; the CSA layer stays with the backend
PLUGIN_CASES = [parity_case(2, 0, "load_balanced", True), parity_case(2, 4, "contiguous")]


def plugin_case(case: Case) -> dict:
    from hp_cp_core.plugins import PluginHost

    plugin = TritonAttention()
    host = PluginHost()
    host.add(plugin, "triton-attention")
    res = run_reference_layer_cp(case, plugins=host)
    res["plugin_calls"] = plugin.calls
    return res


def hf_case(world: int) -> dict:
    """The tiny HF model (sliding, CSA, HCA layers) at cp = 2 with the Triton kernel."""
    from hf_cases import CASES

    from hp_cp_torch.cli.parity import (
        build_tiny_model,
        cp_parity,
        make_inputs,
        reference_run,
    )

    overrides, _ = CASES["short"]
    seq_len = 32  # 2 HCA slots of 16 rows, 8 CSA slots; fewer rows for the interpreter
    model = build_tiny_model(0, **overrides)
    ids = make_inputs(model.config.vocab_size, 1, seq_len, 0)
    ref = reference_run(model, ids)
    config = DeepSeekV4CPConfig(layout="load_balanced", attention_kernel="triton")
    return cp_parity(model, ids, ref, dist.group.WORLD, "load_balanced", config=config)


def triton_suite(world: int) -> dict[str, tuple[Any, tuple]]:
    suite: dict[str, tuple[Any, tuple]] = {
        c.name: (run_reference_layer_cp, (c,)) for c in CONFIG_CASES
    }
    suite.update({f"plugin-{c.name}": (plugin_case, (c,)) for c in PLUGIN_CASES})
    suite["hf"] = (hf_case, (world,))
    return suite

"""Rank functions of tests/torch/test_transformers.py (spawned processes need module-level
functions). One job of 4 gloo ranks runs every case: cp 2 and 3 on sub-groups, cp 4 on the
world, so the process-group start-up is paid once."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hp_cp_core import DeepSeekV4CPConfig, HpCpError, disable_cp, enable_cp
from hp_cp_torch.bench.precision import precision_runs, summarise
from hp_cp_torch.cli.parity import (
    CSA,
    HCA,
    SLIDING,
    build_tiny_model,
    cp_parity,
    make_inputs,
    reference_run,
)
from hp_cp_torch.integrations.transformers import (
    cp_causal_lm_loss,
    cp_sum_gradients,
)

LAYOUTS = ("contiguous", "load_balanced")

# name -> (config overrides, sequence length). S is a multiple of 2*cp for cp in 2, 3, 4.
CASES: dict[str, tuple[dict[str, Any], int]] = {
    # top-k 16 >= the 12 CSA slots: the indexer keeps every visible slot. HCA at rate 16
    # gives 3 HCA slots; 6 rows per chunk (cp 4, load-balanced) < W = 16 and < r: the
    # window halo spans several ranks and slots straddle ranks.
    "short": (
        {"index_topk": 16, "compress_rates": {"compressed_sparse_attention": 4, HCA: 16}},
        48,
    ),
    # top-k 4 << 66 CSA slots: the selection runs over slots gathered from every rank;
    # 2 HCA slots of 128 rows straddling ranks, 8 trailing rows in no slot.
    "long": ({}, 264),
}


SELECTIVE: dict[str, Any] = dict(
    num_hidden_layers=4,
    layer_types=[CSA, SLIDING, HCA, CSA],  # CSA first
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    sliding_window=24,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=6,
)
"""An indexer that really selects, with exact ties: top-k 6 of up to 152 visible slots and 4
indexer heads (a slot no head scores above 0 scores exactly 0), CSA first, a window of 24."""
SELECTIVE_CASES = ((3, "contiguous", 611), (2, "load_balanced", 533), (4, "load_balanced", 611))
"""(cp, layout, S): odd cp, S a multiple of nothing (``handle.batch`` pads)."""
GRAD_FLOOR = 1e-3
"""Gradients compare relative to max(their own largest entry, 1e-3 x the largest of any)."""


def selective_cases(rank: int, groups: dict[int, Any]) -> list[dict[str, Any]]:
    """:data:`SELECTIVE_CASES`: a training step through ``handle.batch`` (padding to
    fit) against HF's own loss on one process; every parameter's error by name."""
    model = build_tiny_model(1, **SELECTIVE)
    results = []
    for cp, layout, seq in SELECTIVE_CASES:
        ids = make_inputs(model.config.vocab_size, 1, seq, seq)
        ref = reference_run(model, ids)
        if rank >= cp:
            dist.barrier()
            continue
        handle = enable_cp(model, groups[cp], DeepSeekV4CPConfig(layout=layout))
        try:
            batch = handle.batch(ids)
            out = model(**batch.model_inputs(), use_cache=False)
            loss = cp_causal_lm_loss(out.logits, batch.labels, batch.n_tokens)
            loss.backward()
            cp_sum_gradients(model.parameters(), groups[cp])
            logits = handle.unshard(out.logits.detach(), 1, rows=seq)
            total = loss.detach().clone()
            dist.all_reduce(total, group=groups[cp])
        finally:
            disable_cp(handle)
        largest = max(float(g.abs().max()) for g in ref.grads.values() if g is not None)
        errors = {}
        for name, p in model.named_parameters():
            want = ref.grads[name]
            if want is None:
                errors[name] = 0.0 if p.grad is None else float(p.grad.abs().max())
                continue
            got = torch.zeros_like(want) if p.grad is None else p.grad
            scale = max(float(want.abs().max()), GRAD_FLOOR * largest)
            errors[name] = float((got - want).abs().max()) / scale
        model.zero_grad(set_to_none=True)
        results.append(
            {
                "cp": cp,
                "layout": layout,
                "seq_len": seq,
                "logits_rel_err": float((logits - ref.logits).abs().max() / ref.logits.abs().max()),
                "loss_rel_err": abs(float(total) - float(ref.loss)) / abs(float(ref.loss)),
                "grad_rel_err_by_param": errors,
                "topk_rows_selecting": ref.topk_rows_selecting,
                "topk_boundary_ties": ref.topk_boundary_ties,
            }
        )
        dist.barrier()
    return results


BF16_SEEDS = (0, 1, 2, 3, 4)
BF16_SEQ = 128
BF16_CASES = [(4, "load_balanced", None), (3, "contiguous", None)]
"""bf16 against fp32 (hp_cp_torch.bench.precision at the tests' widths): five fixed seeds,
top-k 8 of up to 32 CSA slots, the window 16; CP and one process each against fp32."""


def bf16_cases(rank: int, groups: dict[int, Any]) -> dict[str, Any] | None:
    """:data:`BF16_CASES`, judged across the seeds (rank 0: the summary, else ``None``)."""
    runs = precision_runs(rank, "v4", list(BF16_SEEDS), BF16_SEQ, groups, BF16_CASES, tiny=True)
    return None if runs is None else summarise("v4", runs, BF16_SEQ)


def _expect_error(fn: Any, match: str) -> str:
    try:
        fn()
    except HpCpError as exc:
        msg = str(exc)
        return "ok" if match in msg else f"wrong message: {msg}"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def error_checks(model: Any, ids: torch.Tensor, ref_logits: torch.Tensor) -> dict[str, str]:
    """Unsupported inputs raise HpCpError on every rank; disable_cp restores the model."""
    seq_len = ids.shape[1]
    handle = enable_cp(model, dist.group.WORLD, DeepSeekV4CPConfig(layout="load_balanced"))
    out: dict[str, str] = {}
    try:
        local = handle.shard(ids, 1)
        pos = handle.shard(torch.arange(seq_len)[None], 1)
        with torch.no_grad():
            out["use_cache"] = _expect_error(
                lambda: model(input_ids=local, position_ids=pos, use_cache=True), "use_cache=False"
            )
            from transformers import DynamicCache

            out["past_key_values"] = _expect_error(
                lambda: model(
                    input_ids=local,
                    position_ids=pos,
                    use_cache=False,
                    past_key_values=DynamicCache(config=model.config),
                ),
                "KV cache",
            )
            mask = torch.ones_like(ids)
            mask[0, :3] = 0  # left padding of the first sequence (rank 0's rows)
            out["padding_mask"] = _expect_error(
                lambda: model(
                    input_ids=local,
                    position_ids=pos,
                    use_cache=False,
                    attention_mask=handle.shard(mask, 1),
                ),
                "padding",
            )
            out["no_position_ids"] = _expect_error(
                lambda: model(input_ids=local, use_cache=False), "position_ids"
            )
            # HF's own loss on labels it would shift within this rank's rows
            out["unshifted_labels"] = _expect_error(
                lambda: model(input_ids=local, position_ids=pos, labels=local, use_cache=False),
                "shift_labels=batch.labels, num_items_in_batch=batch.n_tokens",
            )
            ones = model(
                input_ids=local,
                position_ids=pos,
                use_cache=False,
                attention_mask=torch.ones_like(local),
            ).logits
            err = (handle.unshard(ones, 1) - ref_logits).abs().max() / ref_logits.abs().max()
            out["all_ones_mask_rel_err"] = f"{float(err):.3e}"
        out["layers_enabled"] = str(len(handle.layers))
    finally:
        disable_cp(handle)
    attns = [layer.self_attn for layer in model.model.layers]
    out["restored"] = "ok" if all("forward" not in a.__dict__ for a in attns) else "forward left"
    with torch.no_grad():
        again = model(
            input_ids=ids, position_ids=torch.arange(seq_len)[None], use_cache=False
        ).logits
    out["restored_bitwise"] = "ok" if torch.equal(again, ref_logits) else "differs"
    inner = enable_cp(model.model, dist.group.WORLD)
    out["model_layers_enabled"] = str(len(inner.layers))
    disable_cp(inner)
    return out


def parity_suite(rank: int, world: int) -> dict[str, Any]:
    """Every parity case on cp 2, 3 and 4, both layouts, plus the error paths (world = 4)."""
    assert world == 4
    groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: dist.group.WORLD}
    results: list[dict[str, Any]] = []
    variants: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    for name, (overrides, seq_len) in CASES.items():
        model = build_tiny_model(0, **overrides)
        ids = make_inputs(model.config.vocab_size, 2, seq_len, 0)
        ref = reference_run(model, ids)
        for cp, group in groups.items():
            if rank >= cp:
                continue
            for layout in LAYOUTS:
                res = cp_parity(model, ids, ref, group, layout, hf_loss=(cp == 3))
                res["case"] = name
                results.append(res)
        if name == "long":
            if rank < 2:  # the other attention kernels, several query chunks per rank, and
                # the blocking exchanges (overlap_exchanges=False; the others overlap)
                for kernel, chunk, overlap in (
                    ("efficient", 1024, True),
                    ("model_ops", 40, True),
                    ("banded", 1024, False),
                ):
                    config = DeepSeekV4CPConfig(
                        layout="load_balanced",
                        attention_kernel=kernel,
                        query_chunk=chunk,
                        overlap_exchanges=overlap,
                    )
                    res = cp_parity(model, ids, ref, groups[2], "load_balanced", config=config)
                    res["case"] = f"long {kernel} query_chunk={chunk} overlap={overlap}"
                    variants.append(res)
                # the memory option under HF's activation checkpointing: each layer's
                # forward runs again in backward, its slots received again, bit for bit
                model.gradient_checkpointing_enable({"use_reentrant": False})
                config = DeepSeekV4CPConfig(layout="load_balanced", regather_compressed_kv=True)
                res = cp_parity(model, ids, ref, groups[2], "load_balanced", config=config)
                model.gradient_checkpointing_disable()
                res["case"] = "long regather_compressed_kv gradient_checkpointing"
                variants.append(res)
            errors = error_checks(model, ids, ref.logits)
        dist.barrier()
    selective = selective_cases(rank, groups)
    bf16 = bf16_cases(rank, groups)
    return {
        "bf16": bf16,
        "rank": rank,
        "results": results,
        "variants": variants,
        "errors": errors,
        "selective": selective,
    }

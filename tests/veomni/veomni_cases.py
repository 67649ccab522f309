"""Rank functions of tests/veomni (spawned processes need module-level functions).

VeOmni's tiny DeepSeek V4 (sliding, CSA r=4, HCA r=128; MoE on its single-process path) is
built identically on every rank; each case runs the same model, weights and batch on one
process and under hp_cp in the same rank function and reports the relative errors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hp_cp_core import DeepSeekV4CPConfig, HpCpError, disable_cp, enable_cp
from hp_cp_torch.bench.precision import precision_runs, summarise
from hp_cp_torch.cli.parity import TINY_CONFIG, randomise_attention_weights
from hp_cp_torch.integrations.veomni import (
    cp_causal_lm_loss,
    cp_shift_labels,
    cp_sum_gradients,
    cp_veomni_batch,
)

LAYOUTS = ("contiguous", "load_balanced")
GRAD_FLOOR = 1e-3
"""A gradient is compared relative to max(its own largest entry, 1e-3 x the largest entry of
any gradient), as in tests/torch/test_hf_distributed.py: the hyper-connection scales and
bases (``hc_head.hc_scale``, ``ffn_hc.scale``, ~1e-5 of the largest gradient) sum ~S
cancelling per-token terms, so their fp32 sums in another order move by ~1e-10, up to ~1e-4
of their own size with either attention kernel (rounding, not the kernel)."""


def init_veomni(world: int, cp_size: int = 1) -> None:
    """VeOmni's parallel state over the world (its CP off unless ``cp_size`` > 1)."""
    from veomni.distributed.parallel_state import init_parallel_state

    init_parallel_state(
        dp_size=world // cp_size, dp_shard_size=world // cp_size, cp_size=cp_size, device_type="cpu"
    )


SL, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
SELECTIVE = dict(
    num_hidden_layers=4,
    layer_types=[CSA, SL, HCA, CSA],  # CSA first
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    sliding_window=24,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=5,
)
"""A config whose indexer really selects: top-k 5 of up to 150 visible slots, 4 indexer
heads (a slot no head scores above 0 scores exactly 0: exact ties at the k-th pick are
common), CSA first, a window of 24. hp_cp's own lower-index tie rule in place of VeOmni's
``torch.topk`` row differs from one process by up to 5 (relative) in gradients here."""
SELECTIVE_CASES = (
    # (cp, layout, S, packed)
    (3, "contiguous", 600, False),
    (2, "load_balanced", 533, False),
    (4, "load_balanced", 533, True),
    # a group of one (single_rank_bypass): packed input runs the CP path, not VeOmni's forward
    (1, "contiguous", 600, True),
)


def build_model(seed: int = 0, **overrides: Any) -> Any:
    """VeOmni's ``DeepseekV4ForCausalLM``, fp32 eager, attention weights O(1) (random sinks
    and compressor position biases); ``overrides`` change the tiny config."""
    from veomni.models.transformers.deepseek_v4.configuration_deepseek_v4 import (
        DeepseekV4Config,
    )
    from veomni.models.transformers.deepseek_v4.generated import (
        patched_modeling_deepseek_v4_gpu as modeling,
    )

    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**{**TINY_CONFIG, **overrides})
    cfg._attn_implementation = "eager"
    model = modeling.DeepseekV4ForCausalLM(cfg).float()
    return randomise_attention_weights(model, cfg.n_routed_experts, seed)


def _zero(model: Any) -> None:
    for p in model.parameters():
        p.grad = None


def _rel(
    a: torch.Tensor | None, b: torch.Tensor | None, like: torch.Tensor, floor: float = 0.0
) -> float:
    a = torch.zeros_like(like) if a is None else a
    b = torch.zeros_like(like) if b is None else b
    scale = max(float(b.abs().max()) if b.numel() else 0.0, floor)
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    return diff / scale if scale > 0 else diff


def doc_bounds(seq_len: int) -> list[int]:
    """Packed documents of uneven lengths (none a multiple of 4 or 128) filling ``seq_len``."""
    cuts = [0, 37, 37 + 150]
    cuts = [c for c in cuts if c < seq_len]
    return [*cuts, seq_len]


def reference(model: Any, ids: torch.Tensor, bounds: list[int] | None) -> dict[str, Any]:
    """One process: VeOmni's own forward (packed: ``cu_seq_lens_q`` + per-document positions)."""
    model.train()
    _zero(model)
    seq_len = ids.shape[1]
    shifted = cp_shift_labels(ids)
    kwargs: dict[str, Any] = {}
    if bounds is None:
        pos = torch.arange(seq_len)[None]
    else:
        pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])[None]
        kwargs["cu_seq_lens_q"] = torch.tensor(bounds, dtype=torch.int32)
        for end in bounds[1:-1]:
            shifted[:, end - 1] = -100
    out = model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs)
    n_tok = (shifted != -100).sum()
    loss = cp_causal_lm_loss(out.logits, shifted, n_tok)
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    _zero(model)
    return {"logits": out.logits.detach(), "loss": loss.detach(), "grads": grads, "pos": pos}


def cp_case(
    model: Any,
    ids: torch.Tensor,
    ref: dict[str, Any],
    group: Any,
    layout: str,
    packed: bool,
    packed_as: str = "position_ids",
) -> dict[str, Any]:
    """One training step under hp_cp on ``group``, compared with ``ref``; packed documents
    given as VeOmni's per-document ``position_ids`` or its ``cu_seq_lens_q``."""
    model.train()
    _zero(model)
    seq_len = ids.shape[1]
    config = DeepSeekV4CPConfig(layout=layout)  # the default kernel
    handle = enable_cp(model, group, config)
    try:
        packing: dict[str, Any] = {}
        if packed and packed_as == "position_ids":
            packing["position_ids"] = ref["pos"]
        elif packed:
            packing["cu_seq_lens"] = torch.tensor(doc_bounds(seq_len), dtype=torch.int32)
        batch = cp_veomni_batch(handle, ids, **packing)
        out = model(**batch.model_inputs(), use_cache=False)
        loss = cp_causal_lm_loss(out.logits, batch.labels, batch.n_tokens)
        loss.backward()
        cp_sum_gradients(model.parameters(), group)
        with torch.no_grad():
            logits = handle.unshard(out.logits.detach(), 1)[:, :seq_len]
            total = loss.detach().clone()
            dist.all_reduce(total, group=group)
    finally:
        disable_cp(handle)
    largest = max(float(g.abs().max()) for g in ref["grads"].values() if g is not None)
    errs = {
        n: _rel(p.grad, ref["grads"][n], p, floor=GRAD_FLOOR * largest)
        for n, p in model.named_parameters()
    }
    worst = max(errs, key=errs.get)
    # a parameter without a gradient on one side must have an all-zero one on the other
    # (hp_cp keeps an HCA compressor in the graph on a rank that owns no slot)
    presence = [
        n
        for n, p in model.named_parameters()
        if (p.grad is None) != (ref["grads"][n] is None)
        and bool(((p.grad if p.grad is not None else ref["grads"][n]) != 0).any())
    ]
    _zero(model)
    return {
        "cp": dist.get_world_size(group),
        "layout": layout,
        "packed": packed,
        "packed_as": packed_as if packed else None,
        "seq_len": seq_len,
        "logits_rel_err": _rel(logits, ref["logits"], ref["logits"]),
        "loss_rel_err": abs(float(total) - float(ref["loss"])) / abs(float(ref["loss"])),
        "grad_rel_err_max": errs[worst],
        "grad_rel_err_by_param": errs,
        "grad_worst": worst,
        "grad_presence_mismatch": presence,
        "n_params": len(errs),
    }


def _expect(fn: Any, match: str) -> str:
    try:
        fn()
    except HpCpError as exc:
        return "ok" if match in str(exc) else f"wrong message: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def error_checks(model: Any, ids: torch.Tensor, ref_logits: torch.Tensor) -> dict[str, str]:
    """Bad input raises HpCpError on every rank; disable_cp restores the model bitwise."""
    out: dict[str, str] = {}
    handle = enable_cp(model, dist.group.WORLD)
    try:
        seq_len = ids.shape[1]
        out["packed_bad_positions"] = _expect(
            lambda: cp_veomni_batch(
                handle, ids[:1], position_ids=torch.arange(1, seq_len + 1)[None]
            ),
            "start at 0",
        )
        out["packed_batch_2"] = _expect(
            lambda: cp_veomni_batch(handle, ids, cu_seq_lens=torch.tensor([0, 50, seq_len])),
            "batch size 1",
        )
        out["cu_bad"] = _expect(
            lambda: cp_veomni_batch(handle, ids[:1], cu_seq_lens=torch.tensor([0, 50, 90])),
            "cu_seq_lens",
        )
        batch = cp_veomni_batch(handle, ids[:1])
        local = batch.input_ids.shape[1]
        with torch.no_grad():  # VeOmni's packed kwargs under hp_cp (shard-local, wrong)
            out["veomni_packed_kwargs"] = _expect(
                lambda: model(
                    **batch.model_inputs(),
                    use_cache=False,
                    cu_seq_lens_q=torch.tensor([0, local]),
                ),
                "cu_seq_lens",
            )
    finally:
        disable_cp(handle)
    attns = [layer.self_attn for layer in model.model.layers]
    out["restored"] = "ok" if all("forward" not in a.__dict__ for a in attns) else "forward left"
    with torch.no_grad():
        again = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False)
    out["restored_bitwise"] = "ok" if torch.equal(again.logits, ref_logits) else "differs"
    return out


def veomni_cp_refused(rank: int, world: int) -> dict[str, str]:
    """VeOmni's own CP on (init_parallel_state(cp_size=world)): enable_cp refuses everywhere."""
    model = build_model(0)
    init_veomni(world, cp_size=world)
    return {
        "rank": str(rank),
        "both_on": _expect(lambda: enable_cp(model, dist.group.WORLD), "cp_size"),
    }


def parity_suite(rank: int, world: int, seq_len: int = 263) -> dict[str, Any]:
    """cp 2 and 4 (world = 4), both layouts, padded (B=2) and packed (B=1), S = seq_len."""
    init_veomni(world)
    groups = {2: dist.new_group([0, 1]), 4: dist.group.WORLD}
    model = build_model(0)
    padded_ids = torch.randint(
        0, model.config.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(3)
    )
    packed_ids = padded_ids[:1].clone()
    bounds = doc_bounds(seq_len)
    refs = {False: reference(model, padded_ids, None), True: reference(model, packed_ids, bounds)}
    results = []
    for cp, group in groups.items():
        if rank < cp:
            for layout in LAYOUTS:
                for packed in (False, True):
                    ids = packed_ids if packed else padded_ids
                    results.append(cp_case(model, ids, refs[packed], group, layout, packed))
        dist.barrier()
    errors = error_checks(model, padded_ids, refs[False]["logits"])
    more = {3: dist.new_group([0, 1, 2]), 1: dist.new_group([0])}
    selective = selective_cases(rank, {**groups, **more})
    bf16 = bf16_cases(rank, {**groups, **more})
    return {
        "rank": rank,
        "results": results,
        "errors": errors,
        "selective": selective,
        "bf16": bf16,
    }


BF16_SEEDS = (0, 1, 2, 3, 4)
BF16_SEQ = 128
BF16_CASES = [(4, "load_balanced", None), (3, "contiguous", None)]
"""bf16 against fp32 (hp_cp_torch.bench.precision at the tests' widths, VeOmni's generated
DeepSeek V4): five fixed seeds, top-k 8 of up to 32 CSA slots, the window 16; CP and one
process each against fp32."""


def bf16_cases(rank: int, groups: dict[int, Any]) -> dict[str, Any] | None:
    """:data:`BF16_CASES`, judged across the seeds (rank 0: the summary, else ``None``)."""
    runs = precision_runs(
        rank, "veomni_v4", list(BF16_SEEDS), BF16_SEQ, groups, BF16_CASES, tiny=True
    )
    return None if runs is None else summarise("veomni_v4", runs, BF16_SEQ)


def selective_cases(rank: int, groups: dict[int, Any]) -> list[dict[str, Any]]:
    """:data:`SELECTIVE_CASES` on the :data:`SELECTIVE` model (packed: VeOmni's per-document
    ``position_ids``)."""
    model = build_model(1, **SELECTIVE)
    results = []
    for cp, layout, seq, packed in SELECTIVE_CASES:
        gen = torch.Generator().manual_seed(seq)
        ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=gen)
        ref = reference(model, ids, doc_bounds(seq) if packed else None)
        if rank < cp:
            results.append(cp_case(model, ids, ref, groups[cp], layout, packed))
        dist.barrier()
    return results


def parity_cp8(rank: int, world: int, seq_len: int = 263) -> dict[str, Any]:
    """Every attention layer (sliding, CSA, HCA) at cp 8 inside the whole model: padded
    contiguous and packed load-balanced (VeOmni's ``cu_seq_lens_q``), S = seq_len (33 rows a
    rank)."""
    init_veomni(world)
    model = build_model(0)
    ids = torch.randint(
        0, model.config.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(3)
    )
    bounds = doc_bounds(seq_len)
    refs = {False: reference(model, ids, None), True: reference(model, ids[:1].clone(), bounds)}
    results = [
        cp_case(model, ids, refs[False], dist.group.WORLD, "contiguous", False),
        cp_case(model, ids[:1].clone(), refs[True], dist.group.WORLD, "load_balanced", True, "cu"),
    ]
    return {"rank": rank, "results": results}

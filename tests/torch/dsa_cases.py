"""Rank functions of tests/torch/test_transformers_dsa.py: transformers' DeepSeek V3.2 and
GLM-5 (DSA) whole models under CP against the same model and weights on one process.

One job of 8 gloo ranks runs every case: cp 2, 3 and 4 on sub-groups, cp 8 on the world."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from hp_cp_core import DeepSeekV4CPConfig, HpCpError, disable_cp, enable_cp
from hp_cp_torch.bench.precision import packed_boundaries, precision_runs, summarise
from hp_cp_torch.cli.parity import randomise_attention_weights
from hp_cp_torch.integrations.transformers import cp_shift_labels
from hp_cp_torch.integrations.transformers_dsa import cp_causal_lm_loss, cp_sum_gradients

LAYOUTS = ("contiguous", "load_balanced")
SEQ = 37
"""A prime: a multiple of no cp and no 2 * cp, so every case pads (handle.batch)."""
CU = [0, 11, 12, 30, 37]
"""Packed documents (batch 1): one of a single token, none a multiple of anything."""
TOPK = 4
"""Far fewer than the up to 37 tokens a query sees: the indexer really selects, and with 4
indexer heads the k-th and (k+1)-th best scores often tie exactly (at 0)."""

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=4,
    n_group=1,
    topk_group=1,
    num_experts_per_tok=2,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    v_head_dim=8,
    qk_nope_head_dim=8,
    index_topk=TOPK,
    index_head_dim=16,
    index_n_heads=4,
    first_k_dense_replace=1,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    attention_dropout=0.0,
)

MODELS = ("deepseek_v32", "glm_moe_dsa")
VARIANTS = {2: ("regather+checkpointing",), 3: ("regather", "model_ops"), 4: ("checkpointing",)}
"""Extra load-balanced cases per cp: the gathered latents re-received in backward
(``regather_compressed_kv``), transformers' activation checkpointing (GLM-5's shared layers
recomputed too), both together, transformers' op order (``attention_kernel="model_ops"``)."""


def build_dsa_model(kind: str, seed: int = 0, **overrides: Any) -> Any:
    """A tiny fp32 eager DSA model (identical on every rank for one seed); GLM-5 with one
    ``"full"`` layer whose selection the two ``"shared"`` layers after it reuse."""
    import transformers

    torch.manual_seed(seed)
    if kind == "deepseek_v32":
        cfg = transformers.DeepseekV32Config(**{**TINY, **overrides})
        cls = transformers.DeepseekV32ForCausalLM
    else:
        extra = {"indexer_types": ["full", "shared", "shared"]}
        cfg = transformers.GlmMoeDsaConfig(**{**TINY, **extra, **overrides})
        cls = transformers.GlmMoeDsaForCausalLM
    cfg._attn_implementation = "eager"
    model = cls(cfg).float()
    return randomise_attention_weights(model, cfg.n_routed_experts, seed)


def _ids(vocab: int, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(7))


def _positions(seq: int, cu: list[int] | None) -> torch.Tensor:
    if cu is None:
        return torch.arange(seq)[None]
    return torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])[None]


def _labels(ids: torch.Tensor, cu: list[int] | None) -> torch.Tensor:
    shifted = cp_shift_labels(ids)
    if cu is not None:
        shifted[:, [c - 1 for c in cu[1:]]] = -100
    return shifted


def _zero(model: Any) -> None:
    for p in model.parameters():
        p.grad = None


def _rel(a: Any, b: Any, like: torch.Tensor) -> float:
    a = torch.zeros_like(like) if a is None else a
    b = torch.zeros_like(like) if b is None else b
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    return diff / scale if scale > 0 else diff


def _selection_stats(model: Any, ids: torch.Tensor, pos: torch.Tensor) -> dict[str, int]:
    """Query rows whose visible tokens outnumber top-k, and top-k boundary ties (the k-th and
    (k+1)-th best visible scores equal), from HF's own indexer inputs on one process."""
    captured: list[tuple[Any, ...]] = []
    hooks = []
    for layer in model.model.layers:
        ix = layer.self_attn.indexer
        if ix is not None:
            hooks.append(ix.register_forward_pre_hook(lambda m, a: captured.append((m, *a))))
    try:
        with torch.no_grad():
            model(input_ids=ids, position_ids=pos, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    rows = ties = 0
    for ix, hs, q_resid, (cos, sin), mask, *_ in captured:
        # the indexer's own forward returns only ids: re-run it on scores
        scores = _hf_index_scores(ix, hs, q_resid, cos, sin, mask)
        visible = torch.isfinite(scores) & (scores > torch.finfo(scores.dtype).min / 2)
        n_vis = visible.sum(-1)
        sel = n_vis > ix.index_topk
        rows += int(sel.sum())
        top = scores.masked_fill(~visible, float("-inf")).sort(-1, descending=True).values
        k = ix.index_topk
        ties += int(((top[..., k - 1] == top[..., k]) & sel).sum())
    return {"rows_selecting": rows, "boundary_ties": ties}


def _hf_index_scores(ix: Any, hs: Any, q_resid: Any, cos: Any, sin: Any, mask: Any) -> Any:
    import importlib

    mod = importlib.import_module(type(ix).__module__)
    glm = "glm" in type(ix).__module__
    rope = mod.apply_rotary_pos_emb_interleave if glm else mod.apply_rotary_pos_emb
    b, s, _ = hs.shape
    q = ix.wq_b(q_resid).view(b, s, ix.n_heads, ix.head_dim)
    split = [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim]
    q_rot, q_pass = torch.split(q, split, dim=-1)
    k = ix.k_norm(ix.wk(hs)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, split, dim=-1)
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    scores = torch.relu(
        torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * ix.softmax_scale
    )
    w = ix.weights_proj(hs).float() * ix.n_heads**-0.5
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2) + mask


def reference(model: Any, ids: torch.Tensor, cu: list[int] | None) -> dict[str, Any]:
    """One process: logits, loss (mean CE over the shifted targets), every gradient, and the
    loss after one SGD step (lr 0.05)."""
    model.train()
    _zero(model)
    pos = _positions(ids.shape[1], cu)
    labels = _labels(ids, cu)
    n_tok = (labels != -100).sum()
    t0 = time.perf_counter()
    out = model(input_ids=ids, position_ids=pos, use_cache=False)
    loss = cp_causal_lm_loss(out.logits, labels, n_tok)
    loss.backward()
    seconds = time.perf_counter() - t0
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.05 * p.grad
        out2 = model(input_ids=ids, position_ids=pos, use_cache=False)
        loss2 = cp_causal_lm_loss(out2.logits, labels, n_tok)
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    _zero(model)
    return {
        "logits": out.logits.detach(),
        "loss": float(loss),
        "loss2": float(loss2),
        "grads": grads,
        "seconds": seconds,
        **_selection_stats(model, ids, pos),
    }


def cp_case(
    model: Any,
    ids: torch.Tensor,
    cu: list[int] | None,
    ref: dict[str, Any],
    group: Any,
    layout: str,
    step: bool,
    variant: str = "plain",
) -> dict[str, Any]:
    """Under CP on ``group``: the same forward, loss, backward (and SGD step when ``step``).
    ``variant``: ``"plain"``, or with ``"regather"`` (``regather_compressed_kv=True``) and / or
    ``"checkpointing"`` (transformers' activation checkpointing) in it."""
    model.train()
    _zero(model)
    if "checkpointing" in variant:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    # load-balanced cases attend in query chunks of 5 rows (each recomputed in backward);
    # a group of one runs the CP path too, never the model's own forward
    chunk = 5 if layout == "load_balanced" else DeepSeekV4CPConfig.query_chunk
    config = DeepSeekV4CPConfig(
        layout=layout,
        query_chunk=chunk,
        single_rank_bypass=False,
        regather_compressed_kv="regather" in variant,
        attention_kernel="model_ops" if variant == "model_ops" else "banded",
    )
    handle = enable_cp(model, group, config)
    try:
        batch = handle.batch(ids, cu_seqlens=cu)
        t0 = time.perf_counter()
        out = model(**batch.model_inputs(), use_cache=False)
        loss = cp_causal_lm_loss(out.logits, batch.labels, batch.n_tokens)
        loss.backward()
        seconds = time.perf_counter() - t0
        stats = handle.stats()
        bypassed = handle.bypassed
        sharing = handle.sharing.describe()
        cp_sum_gradients(model.parameters(), group)
        with torch.no_grad():
            logits = handle.unshard(out.logits.detach(), 1, rows=ids.shape[1])
            total = loss.detach().clone()
            dist.all_reduce(total, group=group)
        loss2 = None
        if step:
            saved = {n: p.detach().clone() for n, p in model.named_parameters()}
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p -= 0.05 * p.grad
                out2 = model(**batch.model_inputs(), use_cache=False)
                l2 = cp_causal_lm_loss(out2.logits, batch.labels, batch.n_tokens)
                dist.all_reduce(l2, group=group)
                loss2 = float(l2)
                for n, p in model.named_parameters():
                    p.copy_(saved[n])
    finally:
        disable_cp(handle)
        if "checkpointing" in variant:
            model.gradient_checkpointing_disable()
    grad_err: dict[str, float] = {}
    presence = []
    for n, p in model.named_parameters():
        got, want = p.grad, ref["grads"][n]
        grad_err[n] = _rel(got, want, p)
        if (got is None) != (want is None):
            presence.append(n)
    _zero(model)
    worst = max(grad_err, key=grad_err.get)
    return {
        "cp": dist.get_world_size(group),
        "layout": layout,
        "variant": variant,
        "logits_rel_err": _rel(logits, ref["logits"], ref["logits"]),
        "loss_rel_err": abs(float(total) - ref["loss"]) / abs(ref["loss"]),
        "loss2_rel_err": None if loss2 is None else abs(loss2 - ref["loss2"]) / abs(ref["loss2"]),
        "grad_rel_err": grad_err,
        "grad_rel_err_max": grad_err[worst],
        "grad_rel_err_worst_param": worst,
        "grad_presence_mismatch": presence,
        "params_without_grad": sorted(n for n, g in ref["grads"].items() if g is None),
        "bytes_sent": stats["bytes_sent"],
        "bytes_recv": stats["bytes_recv"],
        "collectives": stats["collectives"],
        "regather_saved_views": stats.get("regather_saved_views", 0),
        "sharing": sharing,
        "time_cp_s": seconds,
        "bypassed": bypassed,
        "time_single_s": ref["seconds"],
    }


def _expect_error(fn: Any, match: str) -> str:
    try:
        fn()
    except HpCpError as exc:
        return "ok" if match in str(exc) else f"wrong message: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def error_checks(model: Any, ids: torch.Tensor, group: Any) -> dict[str, Any]:
    """A KV cache and malformed packed input are refused on every rank; ``disable_cp``
    restores the forwards exactly."""
    forwards = [layer.self_attn.__dict__.get("forward") for layer in model.model.layers]
    handle = enable_cp(model, group, DeepSeekV4CPConfig(layout="load_balanced"))
    out: dict[str, Any] = {}
    try:
        batch = handle.batch(ids)
        with torch.no_grad():
            out["use_cache"] = _expect_error(
                lambda: model(**batch.model_inputs(), use_cache=True),
                "use_cache=False",
            )
        # packed input the batch helper refuses before sharding anything, on every rank
        two = torch.cat([ids[:1], ids[:1]])
        out["packed_batch_2"] = _expect_error(
            lambda: handle.batch(two, cu_seqlens=[0, 5, ids.shape[1]]), "batch size 1"
        )
        out["packed_cu_start"] = _expect_error(
            lambda: handle.batch(ids[:1], cu_seqlens=[3, 5, ids.shape[1]]), "start at 0"
        )
    finally:
        disable_cp(handle)
    after = [layer.self_attn.__dict__.get("forward") for layer in model.model.layers]
    out["restored"] = after == forwards
    return out


BF16_SEEDS = (0, 1, 2, 3, 4)
BF16_SEQ = 64
BF16_CASES = [
    (4, "load_balanced", None),
    (3, "contiguous", None),
    (4, "load_balanced", packed_boundaries(BF16_SEQ)),
]
"""bf16 against fp32 (hp_cp_torch.bench.precision at the tests' widths): five fixed seeds,
top-k 16 of up to 64 tokens, a packed batch; CP and one process each against fp32."""


def bf16_cases(rank: int, groups: dict[int, Any]) -> dict[str, Any]:
    """:data:`BF16_CASES` for both models, judged across the seeds (rank 0's summaries)."""
    out = {}
    for kind, name in (("deepseek_v32", "v32"), ("glm_moe_dsa", "glm5")):
        runs = precision_runs(rank, name, list(BF16_SEEDS), BF16_SEQ, groups, BF16_CASES, True)
        out[kind] = None if runs is None else summarise(name, runs, BF16_SEQ)
    return out


def dsa_suite(rank: int, world: int) -> dict[str, Any]:
    """Every case: both models, cp 1, 2, 3, 4 and 8, both layouts, padded (batch 2) and packed
    (batch 1); the SGD step at cp 4; the error paths at cp 4 (world = 8)."""
    assert world == 8
    groups = {
        1: dist.new_group([0]),
        2: dist.new_group([0, 1]),
        3: dist.new_group([0, 1, 2]),
        4: dist.new_group([0, 1, 2, 3]),
        8: dist.group.WORLD,
    }
    results: list[dict[str, Any]] = []
    errors: dict[str, Any] = {}
    refs: dict[str, Any] = {}
    for kind in MODELS:
        model = build_dsa_model(kind)
        for docs, cu in (("padded", None), ("packed", CU)):
            ids = _ids(model.config.vocab_size, 2 if cu is None else 1, SEQ)
            ref = reference(model, ids, cu)
            refs[f"{kind} {docs}"] = {
                "rows_selecting": ref["rows_selecting"],
                "boundary_ties": ref["boundary_ties"],
            }
            for cp, group in groups.items():
                if rank >= cp:
                    continue
                for layout in LAYOUTS:
                    res = cp_case(model, ids, cu, ref, group, layout, step=cp == 4)
                    res.update(model=kind, docs=docs)
                    results.append(res)
                for variant in VARIANTS.get(cp, ()):
                    res = cp_case(model, ids, cu, ref, group, "load_balanced", False, variant)
                    res.update(model=kind, docs=docs)
                    results.append(res)
            dist.barrier()
        if rank < 4:
            errors[kind] = error_checks(model, _ids(model.config.vocab_size, 1, SEQ), groups[4])
        dist.barrier()
    bf16 = bf16_cases(rank, groups)
    return {
        "rank": rank, "results": results, "errors": errors, "references": refs, "bf16": bf16,
    }  # fmt: skip

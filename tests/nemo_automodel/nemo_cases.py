"""Rank functions of tests/nemo_automodel (spawned processes need module-level functions).

The model is NeMo Automodel's own ``DeepseekV4ForCausalLM`` (tiny: a sliding-window, a CSA
r = 4 and an HCA r = 128 layer, MoE on its single-process expert path, hyper-connections),
fp32 on CPU. Every CP result is compared, in the same job, with the same model and weights
run on one process.
"""

from __future__ import annotations

import copy
import os
from typing import Any

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # NeMo's fp32 RMSNorm is a compiled op

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hp_cp_core import DeepSeekV4CPConfig, HpCpError, disable_cp, enable_cp
from hp_cp_torch.integrations.nemo_automodel import (
    cp_causal_lm_loss,
    cp_nemo_batch,
    cp_sum_gradients,
)

VOCAB = 64
GRAD_FLOOR = 1e-2
"""A gradient is compared relative to max(its own largest entry, 1e-2 x the largest entry of
any gradient): the hyper-connection head's few parameters sum ~S cancelling per-token terms,
so their fp32 sums in another order (per rank) move by ~1e-3 of their own tiny size."""


def build_model(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """NeMo's DeepseekV4ForCausalLM, tiny, fp32, layers [sliding, CSA r=4, HCA r=128]."""
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config
    from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM

    kw: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=16,
        qk_rope_head_dim=8,
        q_lora_rank=16,
        o_lora_rank=8,
        o_groups=2,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        compress_ratios=[0, 4, 128],
        sliding_window=16,
        num_hash_layers=0,
        hc_mult=2,
        hc_sinkhorn_iters=3,
        index_head_dim=8,
        index_n_heads=8,
        index_topk=8,
        num_nextn_predict_layers=0,
        torch_dtype="float32",
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**kw), backend=BackendConfig(attn="sdpa"))
    model.initialize_weights(buffer_device=torch.device("cpu"))
    with torch.no_grad():  # non-zero sinks and compressor position biases
        for name, p in model.named_parameters():
            if name.endswith(("sinks_param.weight", "ape_param.weight")):
                p.normal_(0.0, 0.5)
    return model.float().train()


def make_ids(seq_len: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq_len), generator=g)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        n: (None if p.grad is None else p.grad.detach().clone())
        for n, p in model.named_parameters()
    }


def reference(model: torch.nn.Module, ids: torch.Tensor, cu: list[int] | None = None) -> dict:
    """One process: logits, mean CE over the shifted targets, every gradient. Packed
    (``cu``): each document run alone (what packing must equal), targets within documents."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    docs = [(0, ids.shape[1])] if cu is None else list(zip(cu[:-1], cu[1:]))
    logits, total, count = [], 0.0, 0
    for lo, hi in docs:
        out = model(ids[:, lo:hi]).logits.float()
        logits.append(out)
        total = total + F.cross_entropy(
            out[:, :-1].reshape(-1, VOCAB), ids[:, lo + 1 : hi].reshape(-1), reduction="sum"
        )
        count += (hi - lo - 1) * ids.shape[0]
    loss = total / count
    loss.backward()
    return {"logits": torch.cat(logits, 1).detach(), "loss": loss.detach(), "grads": _grads(model)}


def cp_run(
    model: torch.nn.Module,
    ids: torch.Tensor,
    group: Any,
    layout: str,
    cu: list[int] | None = None,
    packed_as: str = "seq_lens",
) -> dict:
    """The same step under hp_cp: logits (unsharded), loss (summed), gradients (summed)."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    handle = enable_cp(model, group, DeepSeekV4CPConfig(layout=layout))
    packing: dict[str, Any] = {}
    if cu is not None and packed_as == "seq_lens":
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        packing["seq_lens"] = torch.tensor([lens + [-1000, -1000]])  # NeMo pads with -1000
    elif cu is not None:
        packing["packed_seq_ids"] = torch.cat(
            [torch.full((b - a,), k + 1) for k, (a, b) in enumerate(zip(cu[:-1], cu[1:]))]
        )[None]
    batch = cp_nemo_batch(handle, ids, **packing)
    labels, n_tokens = batch.pop("labels"), batch.pop("n_tokens")
    out = model(**batch).logits
    loss = cp_causal_lm_loss(out, labels, n_tokens)
    loss.backward()
    cp_sum_gradients(model.parameters(), group)
    logits = handle.unshard(out.detach().float(), 1, rows=ids.shape[1])
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    stats = handle.stats()
    disable_cp(handle)
    return {
        "logits": logits,
        "loss": total,
        "grads": _grads(model),
        "bytes_recv": stats["bytes_recv"],
    }


def compare(ref: dict, got: dict) -> dict[str, Any]:
    """Worst relative errors (fp32) of logits, loss and every gradient (``per_param``: each
    parameter's error by name); gradient None-ness."""

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))

    grad_err, missing, worst, per_param = 0.0, [], [], {}
    scale = max(float(g.abs().max()) for g in ref["grads"].values() if g is not None)
    for name, g in ref["grads"].items():
        h = got["grads"][name]
        if (g is None) != (h is None):
            if g is not None and float(g.abs().max()) == 0.0:
                continue  # zero on one process, no token on any rank: equal
            missing.append(name)
            continue
        if g is not None and float(g.abs().max()) > 0:
            e = float((h - g).abs().max() / max(float(g.abs().max()), GRAD_FLOOR * scale))
            worst.append((e, name, float(g.abs().max()), scale))
            per_param[name] = e
            grad_err = max(grad_err, e)
    return {
        "logits": rel(got["logits"], ref["logits"]),
        "loss": rel(got["loss"], ref["loss"]),
        "grads": grad_err,
        "n_grads": sum(g is not None for g in ref["grads"].values()),
        "missing": missing,
        "worst": [w[1] for w in sorted(worst)[-2:]],
        "per_param": per_param,
    }


LAYOUTS = ("contiguous", "load_balanced")
SELECTIVE = dict(
    num_hidden_layers=4,
    compress_ratios=[4, 0, 128, 4],  # CSA first, then sliding, HCA, CSA
    sliding_window=24,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=6,
)
"""A config whose indexer really selects: top-k 6 of up to 152 visible slots, 4 indexer
heads (a slot no head scores above 0 scores exactly 0, so exact ties at the k-th pick are
common), a CSA layer first and a window of 24. With hp_cp's own lower-index tie rule in
place of the model's ``torch.topk`` row, these cases differ from one process by up to 1.7
(relative) in gradients."""
SELECTIVE_CASES = (
    # (cp, layout, S, packed documents or None)
    (3, "contiguous", 611, None),
    (2, "load_balanced", 304, None),
    (4, "load_balanced", 533, [0, 100, 237, 533]),
    # a group of one (single_rank_bypass): packed input runs the CP path, not NeMo's forward
    (1, "contiguous", 304, [0, 100, 237, 304]),
)
SEQ = 301  # a multiple of nothing: 2 HCA slots (r = 128), 75 CSA slots (top-k 8)
DOCS = [0, 100, 230, 301]  # packed: documents that start at no multiple of 4 or 128


def _nemo_cp_batch_of(group: Any, ids: torch.Tensor) -> dict:
    """What NeMo's own CP hands the forward (its sharder), to prove both-on is refused."""
    from nemo_automodel.components.models.deepseek_v4.cp import (
        make_dsv4_contiguous_shard_cp_batch_and_ctx,
    )

    class Mesh:  # the two calls NeMo's sharder makes on a DeviceMesh
        def size(self) -> int:
            return dist.get_world_size(group)

        def get_group(self) -> Any:
            return group

        def get_local_rank(self) -> int:
            return dist.get_rank(group)

    _, batch, _ = make_dsv4_contiguous_shard_cp_batch_and_ctx(
        Mesh(), None, {"input_ids": ids.clone(), "labels": ids.clone()}, pad_multiple=128
    )
    return batch


def _error(fn: Any) -> str:
    try:
        fn()
    except HpCpError as exc:
        return str(exc)
    return "no error"


def error_checks(model: torch.nn.Module, ids: torch.Tensor, group: Any) -> dict[str, str]:
    """Unsupported input: one HpCpError on every rank (each rank returns what it raised)."""
    out: dict[str, str] = {}
    model = copy.deepcopy(model)
    handle = enable_cp(model, group)
    try:
        batch = cp_nemo_batch(handle, ids)
        batch.pop("labels"), batch.pop("n_tokens")
        out["nemo_cp_kwarg"] = _error(lambda: model(**batch, _dsv4_cp_group=group))
        mask = torch.ones_like(batch["input_ids"])
        if dist.get_rank(group) == 0:
            mask[:, -1] = 0  # padding on one rank only: every rank must still raise
        out["padding_mask"] = _error(lambda: model(**batch, attention_mask=mask))
        out["seq_lens_sum"] = _error(lambda: cp_nemo_batch(handle, ids, seq_lens=[[5, 7]]))
        out["packed_batch"] = _error(
            lambda: cp_nemo_batch(handle, ids.repeat(2, 1), seq_lens=[[ids.shape[1]]])
        )
        model.model.layers["1"].self_attn.setup_cp_attention(
            type("M", (), {"get_group": lambda s: group})()
        )
        out["nemo_cp_setup"] = _error(lambda: model(**batch))
        del model.model.layers["1"].self_attn._cp_group
        out["after_errors"] = (
            "ok" if model(**batch).logits.shape[1] == batch["input_ids"].shape[1] else "bad"
        )
    finally:
        disable_cp(handle)
    try:  # NeMo's own sharder's batch: refused before any collective, as the guard raises
        nemo_batch = _nemo_cp_batch_of(group, ids)
        handle = enable_cp(model, group)
        nemo_batch.pop("labels", None)
        out["nemo_sharder_batch"] = _error(lambda: model(**nemo_batch))
    finally:
        disable_cp(handle)
    layer = copy.deepcopy(model.model.layers["2"].self_attn)
    layer._cp_group = group
    out["enable_on_nemo_cp"] = _error(lambda: enable_cp(layer, group))
    return out


def restore_check(model: torch.nn.Module, ids: torch.Tensor, group: Any) -> dict[str, Any]:
    """disable_cp restores exactly: same forwards, attributes and hooks as before, same output."""
    model = copy.deepcopy(model).eval()
    before = model(ids).logits.detach()
    attrs = {n: sorted(vars(m)) for n, m in model.named_modules()}
    hooks = {n: len(m._forward_pre_hooks) for n, m in model.named_modules()}
    handle = enable_cp(model, group)
    with torch.no_grad():
        cp_nemo_batch(handle, ids)  # a plan, no forward needed
    disable_cp(handle)
    after = model(ids).logits.detach()
    return {
        "same_output": bool(torch.equal(before, after)),
        "same_attrs": attrs == {n: sorted(vars(m)) for n, m in model.named_modules()},
        "same_hooks": hooks == {n: len(m._forward_pre_hooks) for n, m in model.named_modules()},
    }


def model_suite(rank: int, world: int) -> dict[str, Any]:
    """The whole model, a training step, cp 2 and 4, both layouts, padded (S = 301) and
    packed (NeMo seq_lens, and packed_seq_ids once), plus the error and restore checks."""
    assert world == 4
    groups = {2: dist.new_group([0, 1]), 4: dist.group.WORLD}
    model = build_model(0)
    ids = make_ids(SEQ)
    refs = {"padded": reference(model, ids), "packed": reference(model, ids, DOCS)}
    results = []
    for cp, group in groups.items():
        for layout in LAYOUTS:
            for kind in ("padded", "packed"):
                if rank < cp:
                    got = cp_run(model, ids, group, layout, DOCS if kind == "packed" else None)
                    res = compare(refs[kind], got)
                    res.update(case=kind, cp=cp, layout=layout, bytes_recv=got["bytes_recv"])
                    results.append(res)
    if rank < 2:
        got = cp_run(model, ids, groups[2], "load_balanced", DOCS, packed_as="packed_seq_ids")
        res = compare(refs["packed"], got)
        res.update(case="packed_seq_ids", cp=2, layout="load_balanced")
        results.append(res)
    more = {3: dist.new_group([0, 1, 2]), 1: dist.new_group([0])}
    results.extend(selective_cases(rank, {**groups, **more}))
    errors = error_checks(model, ids, dist.group.WORLD)
    restore = restore_check(model, ids, dist.group.WORLD)
    return {"rank": rank, "results": results, "errors": errors, "restore": restore}


def selective_cases(rank: int, groups: dict[int, Any]) -> list[dict[str, Any]]:
    """:data:`SELECTIVE_CASES` on the :data:`SELECTIVE` model, random sinks and ``ape``."""
    model = build_model(1, **SELECTIVE)
    results = []
    for cp, layout, seq, docs in SELECTIVE_CASES:
        ids = make_ids(seq, seed=seq)
        ref = reference(model, ids, docs)
        if rank < cp:
            res = compare(ref, cp_run(model, ids, groups[cp], layout, docs))
            kind = "selective packed" if docs else "selective"
            res.update(case=kind, cp=cp, layout=layout, seq=seq)
            results.append(res)
    return results


def layer_suite(rank: int, world: int) -> dict[str, Any]:
    """Each attention layer alone (sliding, CSA, HCA) at cp = world, both layouts: output,
    input gradient and every parameter gradient against the layer on one process."""
    model = build_model(0)
    torch.manual_seed(5)
    x = torch.randn(1, SEQ, 32)
    grad_out = torch.randn(1, SEQ, 32)
    pos = torch.arange(SEQ)[None]
    rope = model.model.rotary_emb(x, pos), model.model.rotary_emb_compress(x, pos)
    results = []
    for idx in ("0", "1", "2"):
        layer = model.model.layers[idx].self_attn

        def call(mod, h, p, pe, mask=None):
            return mod(
                hidden_states=h,
                attention_mask=mask,
                position_embeddings=pe[0],
                position_embeddings_compress=pe[1],
                rotary_compress=model.model.rotary_emb_compress,
                position_ids=p,
            )[0]

        ref_layer = copy.deepcopy(layer)
        xr = x.clone().requires_grad_(True)
        from nemo_automodel.components.models.deepseek_v4.layers import (
            build_causal_padding_mask,
        )

        mask = build_causal_padding_mask(None, SEQ, x.dtype, x.device, 1, layer.sliding_window)
        out = call(ref_layer, xr, pos, rope, mask)  # NeMo's layer needs the model's mask
        out.backward(grad_out)
        ref = {"logits": out.detach(), "loss": out.detach().sum(), "grads": _grads(ref_layer)}
        ref["grads"]["input"] = xr.grad
        for layout in LAYOUTS:
            mod = copy.deepcopy(layer)
            handle = enable_cp(mod, dist.group.WORLD, DeepSeekV4CPConfig(layout=layout))
            pad = handle.padding(SEQ)
            xs = handle.shard(x, 1, pad_value=0.0).detach().requires_grad_(True)
            ps = handle.shard(torch.arange(pad.padded_rows)[None], 1)
            pe = model.model.rotary_emb(xs, ps), model.model.rotary_emb_compress(xs, ps)
            o = call(mod, xs, ps, pe)
            o.backward(handle.shard(grad_out, 1, pad_value=0.0))
            cp_sum_gradients(mod.parameters(), dist.group.WORLD)
            got = {
                "logits": handle.unshard(o.detach(), 1, rows=SEQ),
                "loss": handle.unshard(o.detach(), 1, rows=SEQ).sum(),
                "grads": _grads(mod),
            }
            got["grads"]["input"] = handle.unshard(xs.grad, 1, rows=SEQ)
            disable_cp(handle)
            res = compare(ref, got)
            res.update(case=f"layer {idx} r={layer.compress_ratio}", cp=world, layout=layout)
            results.append(res)
    return {"rank": rank, "results": results}

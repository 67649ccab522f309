"""Rank functions of NeMo Automodel's DeepSeek V4.1 tests (module-level for spawned ranks).

The model is NeMo Automodel 0.7.0's own ``DeepseekV41ForCausalLM``, tiny and fp32 on CPU,
with every CSA2 layer kind of its schedule: a sliding-window layer, ratio 2 Full / Reuse /
Reindex, ratio 1 Full (the two-level indexer's candidate source) / Reindex (selecting among
the candidates) / Reuse, an Engram layer (3-gram hashes), MoE and mHC. Top-k 4 of up to 150
(ratio 2) or 301 (ratio 1) visible slots; 3 candidate blocks of 4 slots. Every CP result is
compared, in the same job, with NeMo's own forward of the same model and weights on one
process.

NeMo's model quantizes its caches as the release does (fp8 window KV, nvfp4 compressed KV,
mxfp4 indexer queries and keys): a value within rounding of a boundary of those formats
moves by a whole quantization step when an fp32 sum upstream rounds differently, and so
can a top-k or router pick downstream of it. hp_cp's attention kernels sum the same terms
in another order than NeMo's dense SDPA (about 1 ulp of a layer's output); everything else
CP computes is bitwise one process's at cp 1 (``choice_inputs``). The token ids of seed 2
with the weights of seed 0 move no pick (the suites' 1e-5 bar holds on them); how often
other seeds flip, and what a flip costs, is ``python -m hp_cp_torch.bench.flips``
(docs/semantics.md, "Discrete choices").
"""

from __future__ import annotations

import copy
import os
from typing import Any

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

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
LAYOUTS = ("contiguous", "load_balanced")
SEQ = 301  # a multiple of nothing (ratio 2: 150 slots, ratio 1: 301)
DOCS = [0, 101, 230, 301]  # packed: odd document starts (NeMo aligns them; hp_cp need not)
ROLES = {0: "window", 1: "full", 2: "reuse", 3: "reindex", 4: "full", 5: "reindex", 6: "reuse"}


def tokenizer() -> Any:
    """A 64-token word-level fast tokenizer (Engram hashes need NeMo's token map of one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def text_config(**overrides: Any) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=7,
        num_attention_heads=4, head_dim=16, qk_rope_head_dim=8, q_lora_rank=16, o_lora_rank=8,
        o_groups=2, n_routed_experts=4, num_experts_per_tok=2, sliding_window=16,
        compress_ratios=[0, 2, 2, 2, 1, 1, 1], kv_source_layer_ids=[1, 4],
        index_source_layer_ids=[1, 3, 4, 5], index_n_heads=4, index_head_dim=16, index_topk=4,
        candidate_source_layer_id=4, candidate_topk_blocks=3, candidate_block_size=4,
        hc_mult=2, hc_sinkhorn_iters=3, engram_layer_ids=[1], engram_num_embeddings=[500],
        engram_max_ngram_size=3, engram_vocab_size=50, engram_n_heads=2, engram_head_dim=8,
        engram_pad_token_id=2, engram_compressed_vocab_size=VOCAB, num_nextn_predict_layers=0,
        dtype="float32", rms_norm_eps=1e-6,
    )  # fmt: skip
    kw.update(overrides)
    return kw


def build_model(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """NeMo's DeepseekV41ForCausalLM, tiny, fp32, its Engram table whole on every rank."""
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from nemo_automodel.components.models.qwen3_8_flash_next.engram import (
        Qwen3_8_FlashNextEngramTableConfig,
    )

    config = DeepseekV41Config(
        text_config=text_config(**overrides), vision_config={"num_hidden_layers": 0},
        dtype="float32",
    )  # fmt: skip
    backend = BackendConfig(
        attn="sdpa", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch"
    )
    torch.manual_seed(seed)
    model = DeepseekV41ForCausalLM(config, backend=backend, tokenizer=tokenizer())
    for layer in model.model.layers.values():
        if layer.engram is not None:  # NeMo's single-rank reference table (no row owners)
            layer.engram.embed = Qwen3_8_FlashNextEngramTableConfig(
                num_embeddings=layer.engram.num_embeddings,
                embedding_dim=layer.engram.embed.embedding_dim,
                initializer_range=layer.engram.initializer_range,
            ).build(process_group=None, dtype=torch.float32)
    torch.manual_seed(seed)
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    with torch.no_grad():  # non-zero sinks, a non-trivial Engram gate
        for name, p in model.named_parameters():
            if name.endswith("sinks_param.weight"):
                p.normal_(0.0, 0.5)
            if ".engram.embed" in name:
                p.normal_(0.0, 1.0)
    return model.float().train()


def make_ids(seq_len: int, seed: int = 2, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq_len), generator=g)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        n: (None if p.grad is None else p.grad.detach().clone())
        for n, p in model.named_parameters()
    }


def reference(model: torch.nn.Module, ids: torch.Tensor, cu: list[int] | None = None) -> dict:
    """One process, NeMo's own forward: logits, mean CE over the shifted targets (within
    documents when packed, with NeMo's own ``seq_lens`` packing), every gradient."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    targets = F.pad(ids[:, 1:], (0, 1), value=-100)
    if cu is None:
        logits = model(ids).logits.float()
    else:
        lens = torch.tensor([[b - a for a, b in zip(cu[:-1], cu[1:])]])
        logits = model(ids, seq_lens=lens).logits.float()
        targets[:, torch.tensor(cu[1:]) - 1] = -100
    loss = (
        F.cross_entropy(
            logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100, reduction="sum"
        )
        / (targets != -100).sum()
    )
    loss.backward()
    return {"logits": logits.detach(), "loss": loss.detach(), "grads": _grads(model)}


def cp_run(
    model: torch.nn.Module,
    ids: torch.Tensor,
    group: Any,
    layout: str,
    cu: list[int] | None = None,
    packed_as: str = "seq_lens",
    enable: Any = enable_cp,
) -> dict:
    """The same step under hp_cp (``enable``: the integration's ``enable_cp`` or the core's):
    logits (unsharded), loss (summed), gradients (summed)."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    handle = enable(model, group, DeepSeekV4CPConfig(layout=layout))
    packing: dict[str, Any] = {}
    if cu is not None and packed_as == "seq_lens":
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        packing["seq_lens"] = torch.tensor([lens + [-1000]])
    elif cu is not None:
        packing["packed_seq_ids"] = torch.cat(
            [torch.full((b - a,), k + 1) for k, (a, b) in enumerate(zip(cu[:-1], cu[1:]))]
        )[None]
    batch = cp_nemo_batch(handle, ids, **packing)
    labels, n_tokens = batch.pop("labels"), batch.pop("n_tokens")
    before = handle.stats()["bytes_recv"]
    calls0 = handle.group.calls.get("slot_exchange", 0)
    out = model(**batch).logits
    loss = cp_causal_lm_loss(out, labels, n_tokens)
    loss.backward()
    cp_sum_gradients(model.parameters(), group)
    logits = handle.unshard(out.detach().float(), 1, rows=ids.shape[1])
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    stats = handle.stats()
    sharing = handle.sharing.describe()
    disable_cp(handle)
    return {
        "sharing": sharing,
        "logits": logits,
        "loss": total,
        "grads": _grads(model),
        "bytes_recv": stats["bytes_recv"] - before,
        "slot_exchanges": handle.group.calls.get("slot_exchange", 0) - calls0,
    }


def compare(ref: dict, got: dict) -> dict[str, Any]:
    """Worst relative errors (fp32) of logits, loss and every gradient, by name."""

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))

    grad_err, missing, per_param = 0.0, [], {}
    scale = max(float(g.abs().max()) for g in ref["grads"].values() if g is not None)
    for name, g in ref["grads"].items():
        h = got["grads"][name]
        if (g is None) != (h is None):
            if g is not None and float(g.abs().max()) == 0.0:
                continue
            missing.append(name)
            continue
        if g is not None and float(g.abs().max()) > 0:
            e = float((h - g).abs().max() / max(float(g.abs().max()), GRAD_FLOOR * scale))
            per_param[name] = e
            grad_err = max(grad_err, e)
    worst = sorted(per_param.items(), key=lambda kv: -kv[1])[:3]
    return {
        "logits": rel(got["logits"], ref["logits"]),
        "loss": rel(got["loss"], ref["loss"]),
        "grads": grad_err,
        "per_param": per_param,
        "n_grads": sum(g is not None for g in ref["grads"].values()),
        "missing": missing,
        "worst": worst,
    }


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
        out["nemo_cp_kwarg"] = _error(lambda: model(**batch, cp_group=group))
        mask = torch.ones_like(batch["input_ids"])
        if dist.get_rank(group) == 0:
            mask[:, 3] = 0  # a hidden token on one rank only: every rank must still raise
        out["padding_mask"] = _error(lambda: model(**batch, attention_mask=mask))
        out["seq_lens_sum"] = _error(lambda: cp_nemo_batch(handle, ids, seq_lens=[[5, 7]]))
        out["packed_batch"] = _error(
            lambda: cp_nemo_batch(handle, ids.repeat(2, 1), seq_lens=[[ids.shape[1]]])
        )
        attn = model.model.layers["2"].attn
        attn.setup_cp_attention(type("M", (), {"get_group": lambda s: group})())
        out["nemo_cp_setup"] = _error(lambda: model(**batch))
        attn.cp_group = None
        out["after_errors"] = (
            "ok" if model(**batch).logits.shape[1] == batch["input_ids"].shape[1] else "bad"
        )
    finally:
        disable_cp(handle)
    layer_model = copy.deepcopy(model)
    layer_model.model.layers["4"].attn.cp_group = group
    out["enable_on_nemo_cp"] = _error(lambda: enable_cp(layer_model, group))
    return out


def restore_check(model: torch.nn.Module, ids: torch.Tensor, group: Any) -> dict[str, Any]:
    """disable_cp restores exactly: same forwards, attributes and hooks, same output."""
    model = copy.deepcopy(model).eval()
    before = model(ids).logits.detach()
    attrs = {n: sorted(vars(m)) for n, m in model.named_modules()}
    hooks = {n: len(m._forward_pre_hooks) for n, m in model.named_modules()}
    handle = enable_cp(model, group)
    with torch.no_grad():
        batch = cp_nemo_batch(handle, ids)
        batch.pop("labels"), batch.pop("n_tokens")
        model(**batch)
    disable_cp(handle)
    after = model(ids).logits.detach()
    return {
        "same_output": bool(torch.equal(before, after)),
        "same_attrs": attrs == {n: sorted(vars(m)) for n, m in model.named_modules()},
        "same_hooks": hooks == {n: len(m._forward_pre_hooks) for n, m in model.named_modules()},
    }


def run_cases(rank: int, groups: dict[int, Any], kinds: tuple[str, ...]) -> list[dict]:
    model = build_model(0)
    ids = make_ids(SEQ)
    refs = {"padded": reference(model, ids)}
    if "packed" in kinds:
        refs["packed"] = reference(model, ids, DOCS)
    results = []
    for cp, group in groups.items():
        for layout in LAYOUTS:
            for kind in kinds:
                if group is None:
                    continue
                got = cp_run(model, ids, group, layout, DOCS if kind == "packed" else None)
                res = compare(refs[kind], got)
                res.update(case=kind, cp=cp, layout=layout, bytes_recv=got["bytes_recv"])
                res["slot_exchanges"] = got["slot_exchanges"]
                res["sharing"] = got["sharing"]
                results.append(res)
    return results


def model_suite(rank: int, world: int) -> dict:
    """The whole model, a training step, at cp 2 and 3 (sub-groups) and cp 4 (the world) of a
    4-rank job, both layouts, padded (S = 301) and packed (NeMo seq_lens, once
    packed_seq_ids), plus the error and restore checks."""
    assert world == 4
    groups = {cp: dist.new_group(list(range(cp))) for cp in (2, 3)}
    groups[4] = dist.group.WORLD
    groups = {cp: (g if rank < cp else None) for cp, g in groups.items()}
    results = run_cases(rank, groups, ("padded", "packed"))
    model, ids = build_model(0), make_ids(SEQ)
    if rank < 2:
        got = cp_run(model, ids, groups[2], "load_balanced", DOCS, packed_as="packed_seq_ids")
        res = compare(reference(model, ids, DOCS), got)
        res.update(case="packed_seq_ids", cp=2, layout="load_balanced")
        results.append(res)
    if rank < 3:  # activation checkpointing: each layer's forward runs again in backward
        wrapped = checkpointed(build_model(0))
        got = cp_run(wrapped, ids, groups[3], "load_balanced", DOCS)
        res = compare(reference(wrapped, ids, DOCS), got)
        res.update(case="checkpointed", cp=3, layout="load_balanced")
        res["checkpointed_slot_exchanges"] = got["slot_exchanges"]
        results.append(res)
    errors = error_checks(model, ids, dist.group.WORLD)
    restore = restore_check(model, ids, dist.group.WORLD)
    return {"rank": rank, "results": results, "errors": errors, "restore": restore}


def checkpointed(model: torch.nn.Module) -> torch.nn.Module:
    """Every decoder layer under torch's ``checkpoint_wrapper`` (non-reentrant), as NeMo's
    activation checkpointing wraps them: a Reuse / Reindex layer recomputed in backward runs
    before the Full layer it reads from is."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for key in list(model.model.layers.keys()):
        model.model.layers[key] = checkpoint_wrapper(model.model.layers[key])
    return model


def cp1_suite(rank: int, world: int) -> dict:
    """A CP group of one (NeMo's own forward unless the batch needs the CP path: padding,
    packing), both layouts, padded and packed; and the inputs of every discrete choice
    through the CP path (:func:`choice_inputs`)."""
    assert world == 1
    results = run_cases(rank, {1: dist.group.WORLD}, ("padded", "packed"))
    choices = choice_inputs(build_model(0), make_ids(SEQ), dist.group.WORLD, "contiguous")
    return {"rank": rank, "results": results, "choices": choices}


def cp8_suite(rank: int, world: int) -> dict:
    """The whole model at cp 8 (the world of an 8-rank job), both layouts, padded and packed."""
    assert world == 8
    return {"rank": rank, "results": run_cases(rank, {8: dist.group.WORLD}, ("padded", "packed"))}


CHOICE_SITES = ("attn.kv_norm", "attn.compressor", "attn.indexer.wq_b", "attn.indexer.k_norm")
"""The modules whose outputs, roped (elementwise, the same angles), are the inputs of NeMo's
quantizers: fp8 window KV, nvfp4 compressed KV, mxfp4 index queries and keys."""


def _choice_hooks(model: torch.nn.Module, rec: dict, forced: dict | None) -> list[Any]:
    """Record every quantizer input (pre-RoPE), router input and router pick, and each
    attention layer's output; with ``forced`` (the reference's records), replace each
    attention layer's output rows with the reference's rows (found by ``position_ids``)."""
    handles, rows = [], {}
    for name, mod in model.named_modules():
        key = name.replace("model.layers.", "L")
        if name.endswith(CHOICE_SITES):

            def site(mod: Any, args: Any, out: Any, key: str = key) -> None:
                rec.setdefault(key, []).append((args[0].detach(), out.detach(), rows["ids"]))

            handles.append(mod.register_forward_hook(site))
        elif name.endswith("ffn.gate"):

            def gate(mod: Any, args: Any, out: Any, key: str = key) -> None:
                picks = out[1].detach().sort(dim=-1).values
                rec.setdefault(key, []).append((args[0].detach(), picks, rows["ids"]))

            handles.append(mod.register_forward_hook(gate))
        elif type(mod).__name__ == "DeepseekV41Attention":

            def pre(mod: Any, args: Any, kwargs: dict) -> None:
                rows["ids"] = kwargs["position_ids"].reshape(-1)

            def attn(mod: Any, args: Any, kwargs: dict, out: Any, key: str = key) -> Any:
                got = out.hidden_states.detach()
                rec[key] = got
                if forced is None:
                    return None
                ids = rows["ids"]
                keep = ids < forced[key].shape[1]
                want = got.clone()
                want[:, keep] = forced[key][:, ids[keep]]
                rec[key + ".diff"] = float((want - got).abs().max())
                return type(out)(want, out.state)

            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(mod.register_forward_hook(attn, with_kwargs=True))
    return handles


def _rows_of(ref_in: torch.Tensor, rows_in: torch.Tensor) -> torch.Tensor | None:
    """Where the rows ``rows_in`` ([B, n, ...]) sit in ``ref_in`` ([B, S, ...]): the
    reference row equal to each, or ``None`` if one has no equal."""
    a = ref_in.reshape(ref_in.shape[0], ref_in.shape[1], -1)[0]
    b = rows_in.reshape(rows_in.shape[0], rows_in.shape[1], -1)[0]
    hit = (b.unsqueeze(1) == a.unsqueeze(0)).all(-1)  # [n, S]
    if not bool(hit.any(-1).all()):
        return None
    return hit.float().argmax(-1)


def _rows_differing(
    key: str, ref_in: Any, ref_out: Any, x: Any, y: Any, rows: Any, total: int
) -> int:
    """How many of the rows one CP call of a site computed differ bitwise from one
    process's: router tokens by input and picks, quantizer inputs by value (slots found by
    their input rows; a slot whose input rows match none of one process's differs)."""
    if key.endswith("ffn.gate"):  # tokens: the layer's local rows
        sel = rows < total
        same = (ref_in[rows[sel]] == x[sel]).all(-1) & (ref_out[rows[sel]] == y[sel]).all(-1)
        return int((~same).sum())
    if key.endswith(("compressor", "k_norm")):  # slots, found by their input rows
        where = _rows_of(ref_in, x) if x.shape[1] else None
        if where is None:
            return int(y.shape[1])
        if key.endswith("compressor"):  # rows -> groups of r rows
            r = max(ref_in.shape[1] // max(ref_out.shape[1], 1), 1)
            where = (where[::r] // r)[: y.shape[1]]
        want = ref_out[:, where]
    else:
        sel = rows < total
        want, y = ref_out[:, rows[sel]], y[:, sel]
    return int((want != y).reshape(*y.shape[:2], -1).any(-1).sum())


def choice_inputs(model: torch.nn.Module, ids: torch.Tensor, group: Any, layout: str) -> dict:
    """The inputs of NeMo V4.1's discrete choices under CP (the CP path, also at cp 1),
    against one process, with each attention layer's output replaced by one process's
    (docs/semantics.md, "Discrete choices"): what remains different can only
    come from elsewhere. Returns, per recorded site (quantizer inputs, router inputs and
    picks), the rows CP computed and how many differ bitwise from one process's
    (``site_rows`` / ``site_diff``; a row CP computed on other rows than one process, as the
    compressor's groups across a rank edge, counts as differing unless it matches a row),
    the attention outputs' largest difference before replacement (``attn_diff``), and
    whether the logits are bitwise one process's (``logits_equal``)."""
    from hp_cp_core import DeepSeekV4CPConfig as Config

    ref_model, cp_model = copy.deepcopy(model).eval(), copy.deepcopy(model).eval()
    ref: dict = {}
    _choice_hooks(ref_model, ref, None)
    with torch.no_grad():
        want = ref_model(ids).logits
    got: dict = {}
    _choice_hooks(cp_model, got, ref)
    handle = enable_cp(cp_model, group, Config(layout=layout, single_rank_bypass=False))
    try:
        batch = cp_nemo_batch(handle, ids)
        batch.pop("labels"), batch.pop("n_tokens")
        with torch.no_grad():
            logits = handle.unshard(cp_model(**batch).logits, 1, rows=ids.shape[1])
    finally:
        disable_cp(handle)
    site_rows, site_diff, per_site = 0, 0, {}
    for key, calls in got.items():
        if not isinstance(calls, list):
            continue
        ((ref_in, ref_out, _),) = ref[key]
        for x, y, rows in calls:
            n = y.shape[0] if key.endswith("ffn.gate") else y.shape[1]
            differ = _rows_differing(key, ref_in, ref_out, x, y, rows, ids.shape[1])
            site_rows, site_diff = site_rows + n, site_diff + differ
            per_site[key] = per_site.get(key, 0) + differ
    attn = [v for k, v in got.items() if k.endswith(".diff")]
    scale = max(float(v.abs().max()) for k, v in ref.items() if k.endswith(".attn"))
    return {
        "site_rows": site_rows,
        "site_diff": site_diff,
        "first_diff": next((k for k, v in per_site.items() if v), None),
        "attn_diff": max(attn) / scale,
        "logits_equal": bool(torch.equal(logits, want)),
        "logits": float((logits - want).abs().max() / want.abs().max()),
    }

"""bf16 precision of a training step under CP at the published attention widths.

``python -m hp_cp_torch.bench.precision --model v4`` (``v32``, ``glm5``; ``--seeds``,
``--seq``, ``--out``; nox session ``bench_precision``) builds transformers'
``DeepseekV4ForCausalLM`` / ``DeepseekV32ForCausalLM`` / ``GlmMoeDsaForCausalLM`` with the
attention and indexer at the published shape (:data:`MODELS`), two layers (``--layers 1``:
one), routed experts that rounding cannot flip and a shared one, and for each seed runs one
training step

* in fp32 on one process (the truth),
* in bf16 on one process (the model cast as ``from_pretrained(dtype=torch.bfloat16)`` casts
  it: the model's ``_keep_in_fp32_modules_strict`` stay fp32),
* in bf16 under CP at cp 2, 3 and 4, both layouts (and, for the DSA models, a packed batch at
  cp 4), through the public API (``hp_cp_core.enable_cp``, ``handle.batch``,
  ``cp_causal_lm_loss``, ``cp_sum_gradients``),

and measures each bf16 run against fp32: the loss error, the logits' per-token RMS error
(mean over tokens) and largest error, every parameter's gradient error (max |diff| over
max(the parameter's largest fp32 gradient, 1e-2 of the model's largest): the suites' rule),
and the fraction of the indexer's (query, pick) pairs that differ from one process's bf16
picks and from fp32's (over the queries that see more candidates than top-k).

Note [Judging bf16 precision across seeds]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
One bf16 run's error against fp32 is one draw of rounding noise: at one seed CP's loss error
can be 0.6x or 4.6x one process's. So each target is judged on the median over seeds of the
per-seed ratio CP error / one-process error: loss (or both errors under three standard
errors of the per-token loss mean, where a ratio says nothing), logits' per-token RMS, and
per parameter. A parameter of at most 64 entries (hyper-connection scales, sinks, norms of
few channels: a handful of whole-sequence sums) is judged together with the others of its
kind, by the geometric mean of their median ratios. Targets: loss and logits <= 1.25,
parameters of more than 64 entries <= 2, the small ones' geometric mean <= 1.5.

The selection is recorded by wrapping the adapters' ``select`` for the run (measurement
only, :func:`recording_selections`); one process's by forward hooks on the model's indexers.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import re
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

__all__ = [
    "MODELS",
    "ModelShape",
    "build_model",
    "cast_like_from_pretrained",
    "main",
    "precision_job",
    "precision_runs",
    "summarise",
]

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)

SMALL_PARAM = 64
"""Parameters of at most this many entries are judged by their geometric mean (Note)."""
GRAD_FLOOR = 1e-2
"""Gradient errors are over max(the parameter's largest gradient, this x the model's)."""
TARGETS = {"loss": 1.25, "logits_rms": 1.25, "large_param": 2.0, "small_param_geomean": 1.5}
KEY_NAMES = {
    "v4": "deepseek_v4",
    "v32": "deepseek_v32",
    "glm5": "glm_moe_dsa",
    "veomni_v4": "veomni_deepseek_v4",
}
"""The model's name in ``bench-real.json``'s keys (``real_<model>_...``), as the memory and
time bench (:mod:`hp_cp_torch.bench.real_widths`) names it."""


@dataclass(frozen=True)
class ModelShape:
    """One model of the bench: transformers' class and the config overrides (published
    attention widths; layers, experts, vocabulary and top-k cut to what the CPUs afford)."""

    cls: str
    config_cls: str
    config: dict[str, Any]
    packed: bool
    """The model has a packed mode (``handle.batch(..., cu_seqlens=...)``)."""
    notes: str = ""
    fp32_strict: tuple[str, ...] = field(default=())
    modeling: str = "transformers"
    """The module holding :attr:`cls` (default: transformers' top level)."""
    configuration: str = "transformers"
    """The module holding :attr:`config_cls`."""
    slot_candidates: bool = False
    """The indexer chooses among compressed slots (V4's CSA: ``(t + 1) // 4`` for query
    ``t``), not tokens (V3.2 / GLM-5)."""


MODELS: dict[str, ModelShape] = {
    "v4": ModelShape(
        "DeepseekV4ForCausalLM",
        "DeepseekV4Config",
        dict(
            hidden_size=4096,
            num_attention_heads=64,
            num_key_value_heads=1,
            head_dim=512,
            partial_rotary_factor=0.125,  # rope 64
            q_lora_rank=1024,
            o_lora_rank=1024,
            o_groups=8,
            index_n_heads=64,
            index_head_dim=128,
            sliding_window=128,
            hc_mult=4,
            num_hidden_layers=2,
            layer_types=[CSA, HCA],
            mlp_layer_types=["hash_moe", "moe"],
            compress_rates={CSA: 4, HCA: 128},
            n_routed_experts=1,
            num_experts_per_tok=1,
            n_shared_experts=1,
            moe_intermediate_size=512,
            vocab_size=512,
            attention_dropout=0.0,
            use_cache=False,
        ),
        packed=False,
        notes="transformers' DeepSeek V4 has no packed mode under CP",
        slot_candidates=True,
    ),
    "v32": ModelShape(
        "DeepseekV32ForCausalLM",
        "DeepseekV32Config",
        dict(
            hidden_size=7168,
            num_attention_heads=128,
            num_key_value_heads=128,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            q_lora_rank=1536,
            index_n_heads=64,
            index_head_dim=128,
            num_hidden_layers=2,
            first_k_dense_replace=0,
            mlp_layer_types=["sparse", "sparse"],
            n_routed_experts=2,  # top-2 of 2: every token to both experts, no flip
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            moe_intermediate_size=512,
            intermediate_size=512,
            vocab_size=512,
            max_position_embeddings=4096,
            attention_dropout=0.0,
        ),
        packed=True,
    ),
    "glm5": ModelShape(
        "GlmMoeDsaForCausalLM",
        "GlmMoeDsaConfig",
        dict(
            hidden_size=6144,
            num_attention_heads=64,
            num_key_value_heads=64,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=192,
            v_head_dim=256,
            q_lora_rank=2048,
            index_n_heads=32,
            index_head_dim=128,
            num_hidden_layers=2,
            indexer_types=["full", "full"],
            first_k_dense_replace=0,
            mlp_layer_types=["sparse", "sparse"],
            n_routed_experts=2,  # top-2 of 2: every token to both experts, no flip
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            moe_intermediate_size=512,
            intermediate_size=512,
            vocab_size=512,
            max_position_embeddings=4096,
            attention_dropout=0.0,
        ),
        packed=True,
    ),
}
MODELS["veomni_v4"] = replace(
    MODELS["v4"],
    modeling="veomni.models.transformers.deepseek_v4.generated.patched_modeling_deepseek_v4_gpu",
    configuration="veomni.models.transformers.deepseek_v4.configuration_deepseek_v4",
    notes="VeOmni's generated copy of transformers' DeepSeek V4 (its parallel state set up "
    "by the caller: veomni.distributed.parallel_state.init_parallel_state)",
)
"""The published attention and indexer widths (transformers 5.23's defaults); two layers,
routing that cannot flip (V4: one routed expert; DSA: top-2 of two, as the DSA gate scores
groups by their two best) and one shared expert, intermediate 512 instead of 2048 and a
vocabulary of 512 (token-local, CPU time), top-k :func:`topk_for` the sequence."""


TINY: dict[str, dict[str, Any]] = {
    "v4": dict(
        hidden_size=64, num_attention_heads=4, head_dim=32, q_lora_rank=32, o_lora_rank=16,
        o_groups=2, index_n_heads=4, index_head_dim=16, sliding_window=16,
        partial_rotary_factor=0.25, moe_intermediate_size=32, vocab_size=128,
    ),
    "v32": dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, q_lora_rank=24, index_n_heads=4,
        index_head_dim=16, moe_intermediate_size=32, intermediate_size=32, vocab_size=128,
    ),
    "glm5": dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, q_lora_rank=24, index_n_heads=4,
        index_head_dim=16, moe_intermediate_size=32, intermediate_size=32, vocab_size=128,
    ),
}  # fmt: skip
TINY["veomni_v4"] = TINY["v4"]
"""``--tiny``: the tests' widths (a smoke run of the harness in seconds)."""


def topk_for(name: str, seq: int) -> int:
    """The indexer's top-k at ``seq``: the published 512 (V4) / 2048 (DSA) would keep every
    candidate at the S these CPUs afford, so the bench keeps a quarter of the most candidates
    a query sees (V4: S / 4 slots; DSA: S tokens), so that the selection really chooses."""
    candidates = seq // 4 if MODELS[name].slot_candidates else seq
    return max(candidates // 4, 1)


def cast_like_from_pretrained(model: Any, dtype: torch.dtype) -> Any:
    """Cast ``model`` to ``dtype`` as ``from_pretrained(dtype=dtype)`` loads it: the
    parameters and buffers of modules named in ``_keep_in_fp32_modules_strict`` stay fp32
    (DeepSeek V4: hyper-connections, sinks, position biases, norms)."""
    keep = tuple(getattr(type(model), "_keep_in_fp32_modules_strict", None) or ())
    pattern = re.compile(r"(^|\.)(" + "|".join(map(re.escape, keep)) + r")(\.|$)") if keep else None
    for name, module in model.named_modules():
        if pattern is not None and pattern.search(name):
            continue
        for pname, p in module.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            if pattern is not None and pattern.search(full):
                continue
            if p.is_floating_point():
                p.data = p.data.to(dtype)
        for bname, b in module.named_buffers(recurse=False):
            if b is not None and b.is_floating_point() and b.dtype == torch.float32:
                full = f"{name}.{bname}" if name else bname
                if pattern is None or not pattern.search(full):
                    if "inv_freq" not in bname:
                        module._buffers[bname] = b.to(dtype)
    return model


def build_model(name: str, seed: int, seq: int, tiny: bool = False, layers: int = 2) -> Any:
    """The fp32 eager model of :data:`MODELS` ``[name]`` (the same on every rank for a
    seed), its attention parameters drawn at O(1) activations as the parity tests draw them;
    ``layers`` 1 keeps the first layer (V4's CSA layer, the DSA models' first indexer)."""
    from hp_cp_torch.cli.parity import randomise_attention_weights

    shape = MODELS[name]
    torch.manual_seed(seed)
    overrides = {**shape.config, **(TINY[name] if tiny else {}), "index_topk": topk_for(name, seq)}
    overrides["num_hidden_layers"] = layers
    for key in ("layer_types", "mlp_layer_types", "indexer_types"):
        if key in overrides:
            overrides[key] = overrides[key][:layers]
    cfg = getattr(importlib.import_module(shape.configuration), shape.config_cls)(**overrides)
    cfg._attn_implementation = "eager"
    model = getattr(importlib.import_module(shape.modeling), shape.cls)(cfg).float()
    return randomise_attention_weights(model, cfg.n_routed_experts, seed)


def _ids(vocab: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1000 + seed))


def packed_boundaries(seq: int) -> list[int]:
    """Three documents of unequal lengths (the packed case)."""
    return [0, seq // 5, seq // 5 + seq // 2 + 3, seq]


def _positions(seq: int, cu: list[int] | None) -> torch.Tensor:
    if cu is None:
        return torch.arange(seq)[None]
    return torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])[None]


def _labels(ids: torch.Tensor, cu: list[int] | None) -> torch.Tensor:
    from hp_cp_torch.integrations.transformers import cp_shift_labels

    shifted = cp_shift_labels(ids)
    if cu is not None:
        shifted[:, [c - 1 for c in cu[1:]]] = -100
    return shifted


def _indexers(model: Any) -> list[tuple[int, Any]]:
    found = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        ix = getattr(attn, "indexer", None)
        if ix is None and getattr(attn, "compressor", None) is not None:
            ix = getattr(attn.compressor, "indexer", None)
        if ix is not None:
            found.append((i, ix))
    return found


@contextlib.contextmanager
def recording_one_process_picks(model: Any, store: dict[int, torch.Tensor]) -> Iterator[None]:
    """The model's own indexer picks ``[S, k]`` per layer (forward hooks on its indexers)."""
    hooks = []
    for i, ix in _indexers(model):

        def hook(_m: Any, _a: Any, out: Any, i: int = i) -> None:
            store[i] = out[0].detach().long()

        hooks.append(ix.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def recording_selections(store: dict[int, list[tuple[Any, torch.Tensor]]]) -> Iterator[None]:
    """CP's picks: the runner's ``select`` (:meth:`hp_cp_torch.model.runner.LayerRunner.select`,
    over the indexer scores every shipped adapter supplies) wrapped for the duration of one
    run (measurement only; the original is back on exit). ``store[layer]`` gets ``(global
    rows, picks)``."""
    from hp_cp_torch.model.runner import LayerRunner

    original = LayerRunner.__dict__["select"]

    def select(self: Any, state: Any, call: Any) -> Any:
        picks = original(self, state, call)
        if picks is None:  # a layer without an indexer
            return picks
        rows = torch.as_tensor(call.plan.local_rows)  # global rows (positions restart)
        store.setdefault(int(self.module.layer_idx), []).append((rows, picks[0].detach()))
        return picks

    try:
        LayerRunner.select = select
        yield
    finally:
        LayerRunner.select = original


def _visible(name: str, seq: int, cu: list[int] | None) -> torch.Tensor:
    """Candidates each query sees (V4: CSA slots, ``(t + 1) // 4``; DSA: tokens)."""
    pos = _positions(seq, cu)[0]
    return (pos + 1) // 4 if MODELS[name].slot_candidates else pos + 1


def pick_difference(
    name: str, a: dict[int, torch.Tensor], b: dict[int, torch.Tensor], seq: int, cu: Any, k: int
) -> float:
    """Fraction of (query, pick) pairs of ``b`` not picked in ``a``, over the queries that see
    more than ``k`` candidates (the others keep every candidate), every indexer layer."""
    visible = _visible(name, seq, cu)
    choosing = visible > k
    differ = total = 0
    for layer, want in b.items():
        got = a[layer]
        rows = choosing.nonzero().squeeze(-1)
        if not rows.numel():
            continue
        w, g = want[rows, :k], got[rows, :k]
        same = (w.unsqueeze(-1) == g.unsqueeze(-2)).any(-1)
        differ += int((~same).sum())
        total += int(w.numel())
    return differ / total if total else 0.0


def _gather_picks(store: dict[int, list[tuple[Any, torch.Tensor]]], seq: int, k: int) -> Any:
    out = {}
    for layer, parts in store.items():
        full = torch.full((seq, k), -1, dtype=torch.long)
        for rows, picks in parts:
            keep = rows < seq
            full[rows[keep]] = picks[keep.nonzero().squeeze(-1), :k].long().cpu()
        out[layer] = full
    return out


def _step_one_process(model: Any, ids: torch.Tensor, cu: Any) -> dict[str, Any]:
    from hp_cp_torch.integrations.transformers import cp_causal_lm_loss

    model.train()
    model.zero_grad(set_to_none=True)
    labels = _labels(ids, cu)
    picks: dict[int, torch.Tensor] = {}
    with recording_one_process_picks(model, picks):
        out = model(input_ids=ids, position_ids=_positions(ids.shape[1], cu), use_cache=False)
    loss = cp_causal_lm_loss(out.logits, labels, (labels != -100).sum())
    loss.backward()
    return {"logits": out.logits.detach().float()[0], "loss": float(loss.detach()), "picks": picks}


def _step_cp(
    name: str, model: Any, ids: torch.Tensor, cu: Any, group: Any, layout: str, k: int
) -> dict[str, Any]:
    import torch.distributed as dist

    import hp_cp_core
    from hp_cp_torch.integrations.transformers import cp_causal_lm_loss, cp_sum_gradients

    model.train()
    model.zero_grad(set_to_none=True)
    config = hp_cp_core.CPConfig(layout=layout)
    handle = hp_cp_core.enable_cp(model, group, config)
    store: dict[int, list[Any]] = {}
    try:
        batch = handle.batch(ids, cu_seqlens=cu if MODELS[name].packed else None)
        with recording_selections(store):
            out = model(**batch.model_inputs(), use_cache=False)
        loss = cp_causal_lm_loss(out.logits, batch.labels, batch.n_tokens)
        loss.backward()
        cp_sum_gradients(model.parameters(), group)
        logits = handle.unshard(out.logits.detach(), 1, rows=ids.shape[1])
        total = loss.detach().float().clone()
        dist.all_reduce(total, group=group)
        gathered: list[Any] = [None] * group.size()
        dist.all_gather_object(gathered, store, group=group)
    finally:
        hp_cp_core.disable_cp(handle)
    merged: dict[int, list[Any]] = {}
    for part in gathered:
        for layer, items in part.items():
            merged.setdefault(layer, []).extend(items)
    return {
        "logits": logits.float()[0],
        "loss": float(total),
        "picks": _gather_picks(merged, ids.shape[1], k),
    }


def _grad_errors(model: Any, ref: dict[str, torch.Tensor], largest: float) -> dict[str, float]:
    errors = {}
    for n, p in model.named_parameters():
        want = ref.get(n)
        if want is None:
            continue
        got = torch.zeros_like(want) if p.grad is None else p.grad.float()
        scale = max(float(want.abs().max()), GRAD_FLOOR * largest)
        errors[n] = float((got - want).abs().max()) / scale if scale > 0 else 0.0
    return errors


def _errors(run: dict[str, Any], truth: dict[str, Any]) -> dict[str, Any]:
    diff = run["logits"] - truth["logits"]
    return {
        "loss": abs(run["loss"] - truth["loss"]),
        "logits_rms": float(diff.pow(2).mean(-1).sqrt().mean()),
        "logits_max": float(diff.abs().max()),
    }


def precision_job(
    rank: int,
    world: int,
    name: str,
    seeds: list[int],
    seq: int,
    tiny: bool = False,
    layers: int = 2,
) -> Any:
    """One gloo job of ``world`` ranks: every seed's fp32 and bf16 one-process steps (rank
    0) and the bf16 CP steps (cp 2 .. world on sub-groups, both layouts, and a packed batch
    at cp ``world`` where the model has a packed mode); rank 0 returns the per-seed errors."""
    import torch.distributed as dist

    groups = {cp: dist.new_group(list(range(cp))) for cp in range(2, world)}
    groups[world] = dist.group.WORLD
    cases = [(cp, layout, None) for cp in groups for layout in ("contiguous", "load_balanced")]
    if MODELS[name].packed:
        cases.append((world, "load_balanced", packed_boundaries(seq)))
    return precision_runs(rank, name, seeds, seq, groups, cases, tiny, layers)


def precision_runs(
    rank: int,
    name: str,
    seeds: list[int],
    seq: int,
    groups: dict[int, Any],
    cases: list[tuple[int, str, list[int] | None]],
    tiny: bool = False,
    layers: int = 2,
) -> list[dict[str, Any]] | None:
    """The runs of :func:`precision_job` inside a running job (every rank calls it; group
    ``cp`` holds ranks ``0 .. cp-1``): ``cases`` are ``(cp, layout, cu_seqlens or None)``.
    Rank 0 returns the per-seed errors (:func:`summarise` judges them), the others ``None``."""
    import torch.distributed as dist

    k = topk_for(name, seq)
    per_seed = []
    vocab = int((TINY[name] if tiny else MODELS[name].config)["vocab_size"])
    for seed in seeds:
        # rank 0 runs one process first, alone: the others build their copy after it (the
        # fp32 model, its gradients and the truth's are the largest things held at once)
        model = build_model(name, seed, seq, tiny, layers) if rank == 0 else None
        ids = _ids(vocab, seq, seed)
        truths: dict[Any, Any] = {}
        result: dict[str, Any] = {"seed": seed, "runs": {}}
        if rank == 0:
            for cu in {None, *(tuple(c) for _, _, c in cases if c is not None)}:
                cu_l = None if cu is None else list(cu)
                t0 = time.perf_counter()
                truth = _step_one_process(model, ids, cu_l)
                grads = {
                    n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None
                }
                tok = _token_losses(truth["logits"], _labels(ids, cu_l)[0])
                truth.update(grads=grads, largest=max(float(g.abs().max()) for g in grads.values()))
                truth["loss_se"] = float(tok.std() / math.sqrt(tok.numel()))
                truth["seconds"] = time.perf_counter() - t0
                truths[cu] = truth
                model.zero_grad(set_to_none=True)
        singles: dict[Any, Any] = {}
        if rank == 0:
            cast_like_from_pretrained(model, torch.bfloat16)
            for cu, truth in truths.items():
                one = _step_one_process(model, ids, None if cu is None else list(cu))
                res = _errors(one, truth)
                res["grads"] = _grad_errors(model, truth["grads"], truth["largest"])
                res["picks_vs_fp32"] = pick_difference(
                    name, one["picks"], truth["picks"], seq, cu, k
                )
                singles[cu] = one
                label = "one_process" if cu is None else "one_process_packed"
                result["runs"][label] = res
                model.zero_grad(set_to_none=True)
        dist.barrier()
        if rank != 0:
            model = cast_like_from_pretrained(
                build_model(name, seed, seq, tiny, layers), torch.bfloat16
            )
        sizes = {n: p.numel() for n, p in model.named_parameters()}
        for cp, layout, cu in cases:
            key = None if cu is None else tuple(cu)
            label = f"cp{cp}_{layout}" + ("_packed" if cu is not None else "")
            if rank < cp:
                got = _step_cp(name, model, ids, cu, groups[cp], layout, k)
                if rank == 0:
                    truth, one = truths[key], singles[key]
                    res = _errors(got, truth)
                    res["grads"] = _grad_errors(model, truth["grads"], truth["largest"])
                    res["picks_vs_fp32"] = pick_difference(
                        name, got["picks"], truth["picks"], seq, cu, k
                    )
                    res["picks_vs_one_process"] = pick_difference(
                        name, got["picks"], one["picks"], seq, cu, k
                    )
                    res["single"] = "one_process" if cu is None else "one_process_packed"
                    result["runs"][label] = res
                model.zero_grad(set_to_none=True)
            dist.barrier()
        if rank == 0:
            result["loss_se"] = {
                ("plain" if c is None else "packed"): t["loss_se"] for c, t in truths.items()
            }
            result["sizes"] = sizes
            per_seed.append(result)
            if os.environ.get("HP_CP_BENCH_PROGRESS") == "1":
                print(f"{name}: seed {seed} done ({time.strftime('%H:%M:%S')})", flush=True)
        del model, truths, singles
    return per_seed if rank == 0 else None


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    keep = labels != -100
    return torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="none")


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (1.0 if a == 0 else float("inf"))


def summarise(name: str, per_seed: list[dict[str, Any]], seq: int) -> dict[str, Any]:
    """Medians over seeds of each CP run's ratios to one process (Note [Judging bf16
    precision across seeds]), each target's verdict, and the keys of ``bench-real.json``."""
    labels = [k for k in per_seed[0]["runs"] if k.startswith("cp")]
    sizes = per_seed[0]["sizes"]
    cases = {}
    for label in labels:
        single = per_seed[0]["runs"][label]["single"]
        se_key = "packed" if single.endswith("packed") else "plain"
        loss_r, rms_r, max_r, pick_one, pick_fp32, one_pick_fp32 = [], [], [], [], [], []
        under_se = []
        grad_r: dict[str, list[float]] = {}
        for s in per_seed:
            run, one = s["runs"][label], s["runs"][single]
            loss_r.append(_ratio(run["loss"], one["loss"]))
            rms_r.append(_ratio(run["logits_rms"], one["logits_rms"]))
            max_r.append(_ratio(run["logits_max"], one["logits_max"]))
            pick_one.append(run["picks_vs_one_process"])
            pick_fp32.append(run["picks_vs_fp32"])
            one_pick_fp32.append(one["picks_vs_fp32"])
            se = s["loss_se"][se_key]
            under_se.append(run["loss"] < 3 * se and one["loss"] < 3 * se)
            for n, e in run["grads"].items():
                grad_r.setdefault(n, []).append(_ratio(e, one["grads"][n]))
        grad_med = {n: _median(v) for n, v in grad_r.items()}
        large = {n: r for n, r in grad_med.items() if sizes[n] > SMALL_PARAM}
        small = [r for n, r in grad_med.items() if sizes[n] <= SMALL_PARAM and math.isfinite(r)]
        geo = math.exp(statistics.fmean(math.log(max(r, 1e-12)) for r in small)) if small else 1.0
        loss_med = _median(loss_r)
        cases[label] = {
            "loss_ratio_median": loss_med,
            "loss_under_3se_all_seeds": all(under_se),
            "logits_rms_ratio_median": _median(rms_r),
            "logits_max_ratio_median": _median(max_r),
            "pick_diff_vs_one_process_mean": statistics.fmean(pick_one),
            "pick_diff_vs_fp32_mean": statistics.fmean(pick_fp32),
            "one_process_pick_diff_vs_fp32_mean": statistics.fmean(one_pick_fp32),
            "worst_large_param": max(large.items(), key=lambda kv: kv[1]) if large else None,
            "large_params_over_2x": {n: r for n, r in large.items() if r > TARGETS["large_param"]},
            "small_param_geomean": geo,
            "grad_ratio_median_by_param": grad_med,
            "ok": {
                "loss": loss_med <= TARGETS["loss"] or all(under_se),
                "logits_rms": _median(rms_r) <= TARGETS["logits_rms"],
                "large_params": all(r <= TARGETS["large_param"] for r in large.values()),
                "small_params": geo <= TARGETS["small_param_geomean"],
            },
        }
    worst_loss = max(c["loss_ratio_median"] for c in cases.values())
    worst_rms = max(c["logits_rms_ratio_median"] for c in cases.values())
    pick = max(c["pick_diff_vs_one_process_mean"] for c in cases.values())
    return {
        "model": name,
        "seq": seq,
        "seeds": [s["seed"] for s in per_seed],
        "index_topk": topk_for(name, seq),
        "cases": cases,
        "per_seed": per_seed,
        "keys": {
            f"real_{KEY_NAMES[name]}_bf16_err_over_single_loss_median": worst_loss,
            f"real_{KEY_NAMES[name]}_bf16_err_over_single_logits_rms": worst_rms,
            f"real_{KEY_NAMES[name]}_pick_diff_fraction": pick,
        },
    }


def _table(summary: dict[str, Any]) -> str:
    lines = [
        f"{summary['model']} (S {summary['seq']}, top-k {summary['index_topk']}, "
        f"seeds {summary['seeds']}): medians over seeds of CP err / one-process err",
        "case | loss | (<3 SE) | logits RMS | logits max | worst param >64 | small geomean "
        "| picks vs 1p bf16 | vs fp32 (1p: fp32) | ok",
    ]
    for label, c in summary["cases"].items():
        worst = c["worst_large_param"]
        lines.append(
            f"{label} | {c['loss_ratio_median']:.2f} | {c['loss_under_3se_all_seeds']} | "
            f"{c['logits_rms_ratio_median']:.2f} | {c['logits_max_ratio_median']:.2f} | "
            f"{worst[1]:.2f} {worst[0]} | {c['small_param_geomean']:.2f} | "
            f"{c['pick_diff_vs_one_process_mean']:.4f} | {c['pick_diff_vs_fp32_mean']:.4f} "
            f"({c['one_process_pick_diff_vs_fp32_mean']:.4f}) | "
            f"{all(c['ok'].values())}"
        )
    return "\n".join(lines)


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _merge_keys(path: str, keys: dict[str, Any]) -> None:
    old: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    old.update(_json_safe(keys))
    with open(path, "w") as f:
        json.dump(old, f, indent=1, sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m hp_cp_torch.bench.precision``: run the models, print the tables, update
    ``--keys-out`` (default ``bench-real.json``, beside the memory and time keys) with each
    model's headline keys and ``--out`` (default ``bench-real-precision.json``) with its
    details (every case, seed and parameter)."""
    from hp_cp_torch.cli.launch import run_ranks

    parser = argparse.ArgumentParser(prog="python -m hp_cp_torch.bench.precision")
    parser.add_argument("--model", action="append", choices=sorted(MODELS))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--cp", type=int, default=4, help="largest cp (cp 2 .. this)")
    parser.add_argument("--out", default="bench-real-precision.json")
    parser.add_argument("--keys-out", default="bench-real.json")
    parser.add_argument("--tiny", action="store_true", help="the tests' widths (a smoke run)")
    parser.add_argument("--layers", type=int, default=2, choices=(1, 2))
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    data: dict[str, Any] = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            data = json.load(f)
    for name in args.model or sorted(MODELS):
        t0 = time.perf_counter()
        per_seed = run_ranks(
            args.cp,
            precision_job,
            name,
            list(range(args.seeds)),
            args.seq,
            args.tiny,
            args.layers,
            timeout=7200,
        )[0]
        summary = summarise(name, per_seed, args.seq)
        summary["layers"] = args.layers
        summary["seconds"] = time.perf_counter() - t0
        summary["command"] = (
            f"python -m hp_cp_torch.bench.precision --model {name} --seeds {args.seeds} "
            f"--seq {args.seq} --cp {args.cp} --layers {args.layers}"
            + (" --tiny" if args.tiny else "")
        )
        print(_table(summary), flush=True)
        data[f"real_{KEY_NAMES[name]}_precision"] = _json_safe(
            {k: v for k, v in summary.items() if k != "keys"}
        )
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        _merge_keys(args.keys_out, summary["keys"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

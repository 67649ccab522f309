"""hp_cp vs the all-gather CP that the public DSA code uses, inside transformers 5.23's
``DeepseekV32ForCausalLM`` (DeepSeek V3.2) and ``GlmMoeDsaForCausalLM`` (GLM-5) (gloo, CPU).

The baseline (:class:`AllGatherDSA`) is the CP NeMo Automodel 0.7.0 ships for GLM-5
(``glm_moe_dsa/cp.py``, ``layers.py``), written for these models: contiguous query shards,
and in every layer a differentiable all-gather of every rank's MLA latents ``[c ; k_rot]``
and (in layers with an indexer) index keys, so each rank holds the whole sequence's; a
shared GLM-5 layer reuses the previous layer's top-k. Its attention is a variant:

* ``latent`` (the headline, fixed before measuring): the same indexer scoring, top-k and
  attention code as hp_cp's (``transformers_dsa``: chunked scores, HF's ``torch.topk`` row,
  attention on the latents over the selected tokens, query chunks recomputed in backward),
  as NeMo's sparse kernels run on the gathered latents: only the CP differs;
* ``hf_ops``: HF's own dense ops on the gathered tokens (``expand_kv`` of every token, the
  indexer's and the attention's ``[L, S]`` rows and mask), the one path the public code has
  that runs off GPU kernels.

hp_cp runs load-balanced through ``enable_cp`` / ``handle.batch``. Same weights, inputs and
machine; interleaved rounds (median); bytes received per training step (forward + backward,
gradient sums excluded) counted by the same wrappers around torch.distributed's collectives
(bench/peers_nemo.py's Counter); errors against one process. Peak memory and the longest S
under the baseline's budget at cp 4, by real training steps: bench/peers_memory.py's ladder.
Writes the ``dsa_allgather_*`` keys of ``bench-peers.json``.

    OMP_NUM_THREADS=1 python bench/peers_dsa.py
    HP_CP_PEERS_PARTS=compare,memory,memory_step,memory_live,memory_wide  HP_CP_PEERS_SEQ=2048
    HP_CP_PEERS_ROUNDS=3

Memory three ways (bench/peers_memory.py), every side, the same ladder: ``memory`` the
resident growth since the first step (``ladder_peaks``), ``memory_step`` each step's own
resident peak (``step_peaks``, keys ending ``_per_step``), ``memory_live`` each step's peak of
live tensor bytes (``live_peaks``, keys ending ``_live``: what a GPU's
``max_memory_allocated`` reports, without the allocator's and the system's noise).
``memory_wide`` (keys ending ``_live_wide``) measures live peaks again at the family's real
attention widths (:data:`WIDE_CONFIG`), the headline baseline against hp_cp by default and
with ``regather_compressed_kv``.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(ROOT, "tests", "torch")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from peers_nemo import Counter  # noqa: E402

from hp_cp_torch.attention import SCORE_CHUNK_CELLS  # noqa: E402

SEQ = int(os.environ.get("HP_CP_PEERS_SEQ", "2048"))
ROUNDS = int(os.environ.get("HP_CP_PEERS_ROUNDS", "3"))
LADDER = [int(s) for s in os.environ.get("HP_CP_PEERS_LADDER", "").split(",") if s] or list(
    range(2048, 8193, 512)
)
MODELS = ("deepseek_v32", "glm_moe_dsa")
SIDES = ("ours", "ours_regather", "ours_smallop", "allgather", "allgather_hf_ops")

BENCH_CONFIG: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_attention_heads=8,
    num_key_value_heads=8,
    kv_lora_rank=64,
    q_lora_rank=96,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    index_topk=64,
    index_head_dim=32,
    index_n_heads=4,
    max_position_embeddings=1 << 17,
)
"""The tests' tiny models (tests/torch/dsa_cases.py: 3 layers, GLM-5 one full indexer layer
and two sharing its top-k) at bench dims: 8 heads, latent 64 + 16, top-k 64."""

WIDE_CONFIG: dict[str, Any] = dict(
    num_hidden_layers=8, kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128
)
"""The part ``memory_wide``: the family's real MLA and indexer widths (latent 512 + 64, index
heads of 128) and 8 layers (GLM-5: two groups of one full indexer layer and three sharing it),
so the state each layer keeps for backward weighs against the transients as in the real
models; at :data:`BENCH_CONFIG`'s widths one chunk's indexer scores, the same on every side,
make most of every rank's peak."""

WIDE_LADDER = list(range(4096, 8193, 512))
"""``memory_wide``'s ladder: the budget is the headline baseline's peak at its first S."""


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence (dim 1); backward: reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        parts = [p.contiguous() for p in grad.chunk(dist.get_world_size(ctx.group), 1)]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=ctx.group)
        return out, None


class AllGatherDSA:
    """The baseline CP: every DSA attention's forward replaced; :meth:`undo` restores."""

    def __init__(self, model: Any, group: Any, variant: str) -> None:
        from hp_cp_torch.integrations.transformers_dsa import DSAAttentionAdapter
        from hp_cp_torch.model.registry import registered_adapter

        self.group, self.variant, self.kept = group, variant, []
        self.documents: Any = None  # [S] document ids when packed (set by step)
        for layer in model.model.layers:
            attn = layer.self_attn
            adapter = registered_adapter(attn, DSAAttentionAdapter)
            self.kept.append((attn, attn.forward))
            attn.forward = self._forward(attn, adapter)

    def undo(self) -> None:
        for attn, forward in self.kept:
            attn.forward = forward

    def _forward(self, m: Any, adapter: Any) -> Any:
        from hp_cp_torch.kernels.latent_attention import MLADims, chunk_rows, latent_attention

        group, hf_ops, cp = self.group, self.variant == "hf_ops", self

        def forward(hidden_states, position_embeddings=None, prev_topk_indices=None, **_):
            mod = adapter._mod()
            batch, length = hidden_states.shape[:-1]
            rank = dist.get_rank(group)
            cos, sin = position_embeddings
            q_resid = m.q_a_layernorm(m.q_a_proj(hidden_states))
            q = m.q_b_proj(q_resid).view(batch, length, -1, m.qk_head_dim).transpose(1, 2)
            q_pass, q_rot = torch.split(q, [m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
            kv = m.kv_a_proj_with_mqa(hidden_states)
            kv_pass, k_rot = torch.split(kv, [m.kv_lora_rank, m.qk_rope_head_dim], -1)
            k_rot = k_rot.view(batch, 1, length, m.qk_rope_head_dim)
            q_rot, k_rot = mod.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
            latent = torch.cat([m.kv_a_layernorm(kv_pass), k_rot[:, 0]], -1)
            latent = _GatherSeq.apply(latent, group)  # [B, S, rank + rope]: every token
            seq = latent.shape[1]
            rows = torch.arange(length) + rank * length  # contiguous shards
            if adapter.shared:
                topk = prev_topk_indices
            else:
                iq, ik = adapter.indexer_qk(hidden_states, q_resid, cos, sin)
                keys = _GatherSeq.apply(ik, group)
                topk = _indexer_topk(m.indexer, hidden_states, iq, keys, rows, cp.documents)
                if not hf_ops:  # invisible ids (picked when fewer are visible): none, -1
                    topk = torch.where(_hidden(topk, rows, cp.documents), -1, topk)
            if hf_ops:
                every = torch.arange(seq)[None, :].expand(length, -1)
                out = _hf_attention(
                    m, q_pass, q_rot, latent, topk, _hidden(every, rows, cp.documents)
                )
            else:  # hp_cp's attention code, its chunk rule
                dims = MLADims(
                    m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank, m.scaling
                )
                step = chunk_rows(1024, topk.shape[-1], latent.shape[-1], q.shape[1])
                chunks = [(lo, min(lo + step, length)) for lo in range(0, length, step)]
                out = latent_attention(
                    q_pass, q_rot, latent, topk, m.kv_b_proj.weight, dims, chunks
                )
            out = m.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
            return (out, None, topk) if adapter.glm else (out, None)

        return forward


def _indexer_topk(
    ix: Any, hs: Any, q: torch.Tensor, keys: torch.Tensor, rows: Any, documents: Any
) -> Any:
    """HF's indexer scores of the local queries (global ``rows``) over every gathered key
    (query chunks as hp_cp sizes them, HF's op order), HF's additive causal mask, ``torch.topk`` on
    each whole row (packed: one row for the stream, other documents masked, as HF's packed
    mask has it)."""
    with torch.no_grad():
        weights = ix.weights_proj(hs.to(ix.weights_proj.weight.dtype)).float() * ix.n_heads**-0.5
        neg = torch.finfo(weights.dtype).min
        picks = []
        step = max(1, min(1024, SCORE_CHUNK_CELLS // keys.shape[1]))  # hp_cp's chunk rule
        for lo in range(0, hs.shape[1], step):
            hi = min(lo + step, hs.shape[1])
            s = torch.matmul(q[:, lo:hi].float(), keys.transpose(-1, -2).float().unsqueeze(1))
            s = torch.matmul(weights[:, lo:hi].unsqueeze(-2), s.mul_(ix.softmax_scale).relu_())
            every = torch.arange(keys.shape[1])[None, :].expand(hi - lo, -1)
            s = s.squeeze(-2) + torch.where(_hidden(every, rows[lo:hi], documents), neg, 0.0)
            picks.append(s.topk(min(ix.index_topk, s.shape[-1]), dim=-1).indices)
        return torch.cat(picks, 1)


def _hf_attention(m, q_pass, q_rot, latent, topk, hidden) -> torch.Tensor:
    """HF's eager path on the gathered tokens: ``expand_kv`` of all, the dense masked rows."""
    batch, seq = latent.shape[:2]
    kv_pass, k_rot = torch.split(latent, [m.kv_lora_rank, m.qk_rope_head_dim], -1)
    keys, values = m.expand_kv(kv_pass[:, None], k_rot[:, None])
    neg = torch.finfo(q_pass.dtype).min
    unpicked = torch.ones(batch, q_pass.shape[2], seq, dtype=torch.bool)
    unpicked.scatter_(-1, topk.long(), False)
    mask = torch.where(unpicked | hidden, neg, 0.0)[:, None]  # [B, 1, L, S]
    w = torch.matmul(torch.cat([q_pass, q_rot], -1), keys.transpose(2, 3)) * m.scaling + mask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q_pass.dtype)
    return torch.matmul(w, values)


def build(kind: str, wide: bool = False) -> Any:
    """The bench model; ``wide``: at :data:`WIDE_CONFIG`."""
    import dsa_cases

    config = dict(BENCH_CONFIG)
    if wide:
        config.update(WIDE_CONFIG)
        if kind == "glm_moe_dsa":
            config["indexer_types"] = ["full", "shared", "shared", "shared"] * 2
    return dsa_cases.build_dsa_model(kind, 0, **config)


def make_ids(seq: int) -> torch.Tensor:
    return torch.randint(
        0, BENCH_CONFIG["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(3)
    )


def step(
    model: Any, ids: torch.Tensor, side: str, state: Any, group: Any, cu: Any = None
) -> torch.Tensor:
    """One training step of one side (``cu``: packed document boundaries, or ``None``);
    returns this rank's logits."""
    import dsa_cases

    from hp_cp_torch.integrations.transformers_dsa import cp_causal_lm_loss

    if side.startswith("ours"):
        batch = state.batch(ids, cu_seqlens=cu)
        out = model(**batch.model_inputs(), use_cache=False)
        cp_causal_lm_loss(out.logits, batch.labels, batch.n_tokens).backward()
        return out.logits
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    seq = ids.shape[1]
    length = seq // cp
    labels = dsa_cases._labels(ids, cu)
    own = slice(rank * length, (rank + 1) * length)
    state.documents = None if cu is None else _documents(cu, seq)
    positions = dsa_cases._positions(seq, cu)
    out = model(input_ids=ids[:, own], position_ids=positions[:, own], use_cache=False)
    cp_causal_lm_loss(out.logits, labels[:, own], (labels != -100).sum()).backward()
    return out.logits


def _documents(cu: list[int], seq: int) -> torch.Tensor:
    """``[S]``: the packed document of every token."""
    return torch.searchsorted(torch.as_tensor(cu[1:-1]), torch.arange(seq), right=True)


def _hidden(keys: torch.Tensor, rows: torch.Tensor, documents: Any) -> torch.Tensor:
    """Which ``keys`` (token ids, any shape ``[..., L, n]``) the queries ``rows [L]`` may not
    read: later tokens, and, packed, other documents' tokens."""
    hidden = keys > rows[:, None]
    if documents is not None:
        hidden = hidden | (documents[keys] != documents[rows][:, None])
    return hidden


def _full_logits(logits: torch.Tensor, side: str, state: Any, group: Any, seq: int) -> Any:
    if side.startswith("ours"):
        return state.unshard(logits.detach().float(), 1, rows=seq)
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.detach().contiguous(), group=group)
    return torch.cat(parts, 1).float()


def _install(model: Any, side: str, group: Any) -> Any:
    from hp_cp_core import CPConfig, enable_cp

    if side.startswith("ours"):
        config = CPConfig(
            layout="load_balanced",
            regather_compressed_kv=side == "ours_regather",
            attention_kernel="model_ops" if side == "ours_smallop" else "banded",
        )
        return enable_cp(model, group, config)
    return AllGatherDSA(model, group, "hf_ops" if side.endswith("hf_ops") else "latent")


def packed_documents(seq: int) -> list[int]:
    """Five packed documents of uneven lengths, none a multiple of anything."""
    return [0] + [int(seq * f) + 1 for f in (0.15, 0.35, 0.55, 0.8)] + [seq]


def compare_job(rank: int, world: int, kind: str, packed: bool) -> dict[str, Any]:
    """Bytes, step time (interleaved rounds), errors of logits and gradients vs one process."""
    import dsa_cases

    from hp_cp_torch.integrations.transformers_dsa import cp_causal_lm_loss

    counter = Counter()
    counter.install()
    group = dist.group.WORLD
    base = build(kind)
    ids = make_ids(SEQ)
    cu = packed_documents(SEQ) if packed else None
    ref = copy.deepcopy(base)
    labels = dsa_cases._labels(ids, cu)
    positions = dsa_cases._positions(SEQ, cu)
    ref_logits = ref(input_ids=ids, position_ids=positions, use_cache=False).logits
    cp_causal_lm_loss(ref_logits, labels, (labels != -100).sum()).backward()
    models = {s: copy.deepcopy(base) for s in SIDES}
    states = {s: _install(models[s], s, group) for s in SIDES}
    times: dict[str, list[float]] = {s: [] for s in SIDES}
    bytes_: dict[str, int] = {}
    errs: dict[str, dict[str, float]] = {}
    for r in range(ROUNDS + 1):
        for side in SIDES:
            model = models[side]
            model.zero_grad(set_to_none=True)
            dist.barrier()
            counter.bytes, counter.on = 0, True
            t0 = time.perf_counter()
            logits = step(model, ids, side, states[side], group, cu)
            elapsed = time.perf_counter() - t0
            counter.on = False
            if r:
                times[side].append(elapsed)
                continue
            bytes_[side] = counter.bytes
            full = _full_logits(logits, side, states[side], group, SEQ)
            grad_err = 0.0
            for p, q in zip(model.parameters(), ref.parameters()):
                if q.grad is None:
                    continue
                g = p.grad.detach().clone()
                dist.all_reduce(g, group=group)
                grad_err = max(grad_err, float((g - q.grad).abs().max() / q.grad.abs().max()))
            scale = float(ref_logits.abs().max())
            errs[side] = {
                "logits": float((full - ref_logits.detach()).abs().max()) / scale,
                "grads": grad_err,
            }
    return {
        "rank": rank,
        "bytes": bytes_,
        "time": {s: statistics.median(v) for s, v in times.items()},
        "err": errs,
    }


MEMORY_METHODS = {
    "memory": ("", "ladder_peaks", "the resident growth since the first step"),
    "memory_step": ("_per_step", "step_peaks", "each step's own resident peak"),
    "memory_live": ("_live", "live_peaks", "each step's live-tensor peak"),
}
"""The memory parts (``HP_CP_PEERS_PARTS``): their keys' suffix, the measure of
bench/peers_memory.py, what it is."""


def memory_job(
    rank: int,
    world: int,
    kind: str,
    side: str,
    budget: int | None,
    method: str = "memory",
    wide: bool = False,
) -> dict:
    """One side's busiest-rank peak memory per S of the ladder, by ``method`` (a key of
    :data:`MEMORY_METHODS`); ``wide``: the model at :data:`WIDE_CONFIG`, :data:`WIDE_LADDER`."""
    import peers_memory

    group = dist.group.WORLD
    model = build(kind, wide)
    state = _install(model, side, group)

    def one(seq: int) -> None:
        model.zero_grad(set_to_none=True)
        step(model, make_ids(seq), side, state, group)
        model.zero_grad(set_to_none=True)

    ladder = WIDE_LADDER if wide else LADDER
    peaks = getattr(peers_memory, MEMORY_METHODS[method][1])(one, ladder, budget, group)
    return {"rank": rank, "peaks": peaks}


def compare_keys(ranks: list[dict], kind: str, case: str) -> dict[str, Any]:
    """The bytes, step-time and error keys of one model in one case (every side over ours)."""
    busiest = {s: max(r["bytes"][s] for r in ranks) for s in SIDES}
    total = {s: sum(r["bytes"][s] for r in ranks) for s in SIDES}
    step_s = {s: max(r["time"][s] for r in ranks) for s in SIDES}
    sfx = f"_{kind}_{case}"
    out: dict[str, Any] = {}
    for side in SIDES[1:]:
        name = side if side.startswith("ours") else "dsa_" + side
        out[f"{name}_busiest_rank_bytes_over_ours{sfx}"] = busiest[side] / busiest["ours"]
        out[f"{name}_total_bytes_over_ours{sfx}"] = total[side] / total["ours"]
        out[f"{name}_step_time_over_ours{sfx}"] = step_s[side] / step_s["ours"]
        out[f"{name}_step_time_s{sfx}"] = step_s[side]
        out[f"{name}_busiest_rank_bytes{sfx}"] = busiest[side]
        out[f"{name}_max_rel_err{sfx}"] = ranks[0]["err"][side]
    out[f"ours_busiest_rank_bytes_vs_dsa{sfx}"] = busiest["ours"]
    out[f"ours_step_time_s_vs_dsa{sfx}"] = step_s["ours"]
    out[f"ours_max_rel_err_vs_dsa{sfx}"] = ranks[0]["err"]["ours"]
    return out


def memory_keys(
    run_ranks: Any, max_seq_summary: Any, kind: str, method: str = "memory"
) -> dict[str, Any]:
    """Peak memory at the ladder's first S, and the longest S of every side under one budget:
    the public code's dense path (all-gather, HF's ops) at that S, every side at cp 4, by
    ``method`` (:data:`MEMORY_METHODS`: every key ends with its suffix)."""
    first = LADDER[0]
    job = (memory_job, kind)
    peaks = {"allgather_hf_ops": run_ranks(4, *job, "allgather_hf_ops", None, method)}
    if peaks["allgather_hf_ops"][0]["peaks"] is None:
        note = "VmHWM cannot be reset here"
        return {f"dsa_allgather_memory_note_{kind}{MEMORY_METHODS[method][0]}": note}
    budget = peaks["allgather_hf_ops"][0]["peaks"][first]
    for side in ("allgather", "ours", "ours_regather", "ours_smallop"):
        peaks[side] = run_ranks(4, *job, side, budget, method, timeout=7200)
    peaks = {s: r[0]["peaks"] for s, r in peaks.items()}
    out: dict[str, Any] = {f"dsa_allgather_peak_mem_seq_{kind}": first}
    for side in ("allgather", "allgather_hf_ops"):
        out[f"dsa_{side}_peak_mem_over_ours_{kind}"] = peaks[side][first] / peaks["ours"][first]
    for side in ("ours_regather", "ours_smallop"):
        out[f"dsa_allgather_peak_mem_over_{side}_{kind}"] = (
            peaks["allgather"][first] / peaks[side][first]
        )
    suffix, measure, how = MEMORY_METHODS[method]
    why = f"the all-gather with HF's dense ops: its busiest rank's step at S={first}; {how}"
    why += f" ({measure})"
    for peer in ("allgather", "allgather_hf_ops"):
        for side in ("ours", "ours_regather", "ours_smallop"):
            summary = max_seq_summary(
                f"dsa_{peer}_{kind}", peaks[peer], peaks[side], budget=budget, budget_is=why
            )
            out.update(_renamed(summary, side) if side != "ours" else summary)
    return {k + suffix: v for k, v in out.items()}


def wide_memory_keys(run_ranks: Any, max_seq_summary: Any, kind: str) -> dict[str, Any]:
    """``memory_wide``: live-tensor peaks at :data:`WIDE_CONFIG`, the headline baseline against
    hp_cp as configured by default and with ``regather_compressed_kv``; the budget is the
    baseline's own peak at :data:`WIDE_LADDER`'s first S (keys end ``_live_wide``)."""
    job = (memory_job, kind)
    peaks = {"allgather": run_ranks(4, *job, "allgather", None, "memory_live", True)}
    first = WIDE_LADDER[0]
    budget = peaks["allgather"][0]["peaks"][first]
    for side in ("ours", "ours_regather"):
        peaks[side] = run_ranks(4, *job, side, budget, "memory_live", True, timeout=7200)
    peaks = {s: r[0]["peaks"] for s, r in peaks.items()}
    out: dict[str, Any] = {f"dsa_allgather_peak_mem_seq_{kind}": first}
    out[f"dsa_allgather_peak_mem_over_ours_{kind}"] = (
        peaks["allgather"][first] / peaks["ours"][first]
    )
    regather = peaks["ours_regather"][first]
    out[f"dsa_allgather_peak_mem_over_ours_regather_{kind}"] = peaks["allgather"][first] / regather
    why = f"the all-gather's busiest rank's live-tensor peak of a step at S={first} (live_peaks)"
    for side in ("ours", "ours_regather"):
        summary = max_seq_summary(
            f"dsa_allgather_{kind}", peaks["allgather"], peaks[side], budget=budget, budget_is=why
        )
        out.update(_renamed(summary, side) if side != "ours" else summary)
    return {k + "_live_wide": v for k, v in out.items()}


def _renamed(summary: dict[str, Any], side: str) -> dict[str, Any]:
    """``max_seq_summary``'s keys for another of our sides (``ours_`` -> ``<side>_``)."""
    out = {}
    for key, value in summary.items():
        name = side + key[len("ours") :] if key.startswith("ours_") else f"{key}_{side[5:]}"
        out[name] = value
    return out


def main() -> None:
    from dist_utils import run_ranks
    from peers_memory import max_seq_summary

    out: dict[str, Any] = {}
    every = ["compare", *MEMORY_METHODS, "memory_wide"]
    parts = os.environ.get("HP_CP_PEERS_PARTS", ",".join(every)).split(",")
    for kind in MODELS:
        for cp in (2, 4) if "compare" in parts else ():
            ranks = run_ranks(cp, compare_job, kind, False, timeout=3600)
            out.update(compare_keys(ranks, kind, f"cp{cp}"))
        if "compare" in parts:  # packed documents, cp 4
            ranks = run_ranks(4, compare_job, kind, True, timeout=3600)
            out.update(compare_keys(ranks, kind, "cp4_packed"))
        for method in MEMORY_METHODS:
            if method in parts:
                out.update(memory_keys(run_ranks, max_seq_summary, kind, method))
        if "memory_wide" in parts:
            out.update(wide_memory_keys(run_ranks, max_seq_summary, kind))
    out["dsa_allgather_bench_setup"] = (
        "transformers 5.23 DeepseekV32ForCausalLM / GlmMoeDsaForCausalLM, 3 layers (GLM-5: "
        "one full indexer layer, two sharing its top-k), hidden 256, 8 heads, latent 64+16, "
        "4 indexer heads, top-k 64, fp32 eager, gloo CPU, one process per rank, "
        f"S={SEQ} (packed: documents {packed_documents(SEQ)}), median of {ROUNDS} "
        f"interleaved rounds; memory: cp 4, ladder {LADDER} (each part's peaks name the S it ran); "
        "headline baseline: all-gather with hp_cp's indexer and attention code and chunk rules "
        "(latent); hf_ops: all-gather with HF's dense ops; ours_regather: hp_cp with "
        "regather_compressed_kv=True; ours_smallop: hp_cp with attention_kernel='smallop' "
        "(transformers' op order); memory_wide (keys ending _live_wide): live-tensor peaks "
        f"with {WIDE_CONFIG} (GLM-5: 2 x one full indexer layer and three sharing it), "
        f"ladder {WIDE_LADDER}, budget the all-gather's peak at its first S"
    )
    path = os.path.join(ROOT, "bench-peers.json")
    data = json.load(open(path)) if os.path.exists(path) else {}
    data.update(out)
    with open(path, "w") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.write("\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

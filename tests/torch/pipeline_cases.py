"""Rank functions of tests/torch/test_pipeline.py: pipeline parallel x CP x recomputation.

transformers' DeepSeek V4 (its hyper-connection streams cross the stage boundary) and
GLM-5 (shared-indexer groups inside a stage) cut by hand into stages, each stage under
``enable_cp`` on its row of a ``(pp, cp)`` mesh, every layer recomputed in backward, run by
``torch.distributed.pipelining`` schedules against the whole model on one process on the
global batch (every gradient by name, the floor of ``cases.py``). Two steps of other real
lengths, so every step pads differently.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hp_cp_core import CPConfig, disable_cp, enable_cp
from hp_cp_torch.integrations.transformers import cp_sum_gradients
from hp_cp_torch.integrations.transformers_dsa import cp_causal_lm_loss

MICRO_BATCHES = 4
BATCH = 4
LENGTHS = (37, 41)
"""One step each; both pad under every layout and cp here."""


def build(kind: str) -> Any:
    """V4 with four layers (window, CSA, HCA, CSA); GLM-5 with four shared groups
    (full, shared), so two and four stages both cut between groups."""
    if kind == "deepseek_v4":
        from hp_cp_torch.cli.parity import CSA, HCA, SLIDING, build_tiny_model

        return build_tiny_model(
            0,
            num_hidden_layers=4,
            layer_types=[SLIDING, CSA, HCA, CSA],
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            sliding_window=8,
        )
    from dsa_cases import build_dsa_model

    return build_dsa_model(kind, 0, num_hidden_layers=8, indexer_types=["full", "shared"] * 4)


class HFStage(nn.Module):
    """Layers ``lo:hi`` of an HF DeepSeek V4 or GLM-5 causal LM (the embedding in the first
    stage, the final norm and head in the last), the model's own forward cut in two.

    :attr:`position_ids` (this rank's global positions, ``[1, L]``: the CP batch's) is set
    before each step; every micro-batch of a step shares it.
    """

    def __init__(self, model: Any, lo: int, hi: int) -> None:
        super().__init__()
        inner = model.model
        self.v4 = model.config.model_type == "deepseek_v4"
        self.config = inner.config
        self.embed = inner.embed_tokens if lo == 0 else None
        self.layers = nn.ModuleList(inner.layers[lo:hi])
        self.rotary = inner.rotary_emb
        last = hi == len(inner.layers)
        self.norm = inner.norm if last else None
        self.hc_head = inner.hc_head if last and self.v4 else None
        self.lm_head = model.lm_head if last else None
        self.position_ids: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        pos = self.position_ids.expand(x.shape[0], -1)
        ids = x if self.embed is not None else None
        h = self.embed(x) if self.embed is not None else x
        if self.v4:
            if self.embed is not None:
                h = h.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
            flat = h[:, :, 0]
            mask = create_sliding_window_causal_mask(
                config=self.config, inputs_embeds=flat, attention_mask=None,
                past_key_values=None, position_ids=pos,
            )  # fmt: skip
            pe = {
                kind: self.rotary(flat, position_ids=pos, layer_type=kind)
                for kind in ("main", "compress")
            }
            for layer in self.layers:
                h = layer(
                    h, position_embeddings=pe, position_ids=pos, attention_mask=mask,
                    input_ids=ids, past_key_values=None,
                )  # fmt: skip
            if self.norm is not None:
                h = self.norm(self.hc_head(h))
        else:
            mask = create_causal_mask(
                config=self.config, inputs_embeds=h, attention_mask=None,
                past_key_values=None, position_ids=pos, allow_is_causal_skip=False,
            )  # fmt: skip
            pe = self.rotary(h, position_ids=pos)
            topk = None
            for layer in self.layers:
                h, topk = layer(
                    h, attention_mask=mask, position_embeddings=pe, position_ids=pos,
                    past_key_values=None, use_cache=False, prev_topk_indices=topk,
                )  # fmt: skip
            if self.norm is not None:
                h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h


def _ids(vocab: int, seq: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(50 + step)
    return torch.randint(0, vocab, (BATCH, seq), generator=gen)


def reference(kind: str, reentrant: bool) -> list[dict[str, torch.Tensor]]:
    """One process, the whole model on each step's global batch: every gradient by name."""
    model = build(kind)
    model.train()
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    out = []
    for step, seq in enumerate(LENGTHS):
        ids = _ids(model.config.vocab_size, seq, step)
        labels = torch.full_like(ids, -100)
        labels[:, :-1] = ids[:, 1:]
        logits = model(input_ids=ids, position_ids=torch.arange(seq)[None], use_cache=False)
        cp_causal_lm_loss(logits.logits, labels, (labels != -100).sum()).backward()
        out.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
    return out


def pipeline_case(
    kind: str, schedule: str, mesh: Any, layout: str, reentrant: bool, want: list[dict]
) -> dict[str, Any]:
    """Stages of ``kind`` on this rank's pp row, CP on its cp column, run by ``schedule``:
    the worst per-parameter gradient error against ``want`` over both steps."""
    from torch.distributed import pipelining as pl

    pp = mesh.size(0)
    pp_rank = mesh.get_local_rank(0)
    dp = mesh["dp"].size() if "dp" in mesh.mesh_dim_names else 1
    dp_rank = mesh["dp"].get_local_rank() if dp > 1 else 0
    model = build(kind)
    model.train()
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    names = {id(p): n for n, p in model.named_parameters()}
    n_layers = len(model.model.layers)
    n_stages = 2 * pp if schedule.startswith("interleaved") else pp
    cuts = [n_layers * k // n_stages for k in range(n_stages + 1)]
    mine = list(range(pp_rank, n_stages, pp))
    modules = [HFStage(model, cuts[s], cuts[s + 1]) for s in mine]
    full_names = [{n: names[id(p)] for n, p in m.named_parameters()} for m in modules]
    config = CPConfig(layout=layout, single_rank_bypass=False)
    handles = [enable_cp(m, mesh["cp"], config) for m in modules]
    if dp > 1:  # FSDP2 over the flattened (dp, cp) mesh: it averages over dp x cp ranks
        from torch.distributed.fsdp import fully_shard

        dp_cp = mesh["dp", "cp"]._flatten()
        for m in modules:
            for layer in m.layers:
                fully_shard(layer, mesh=dp_cp)
            fully_shard(m, mesh=dp_cp)
    stages = [
        pl.PipelineStage(m, s, n_stages, torch.device("cpu"), group=mesh["pp"].get_group())
        for m, s in zip(modules, mine)
    ]
    micro = MICRO_BATCHES // dp
    errors: list[float] = []
    live: list[int] = []
    worst_name = ""
    try:
        for step, seq in enumerate(LENGTHS):
            ids = _ids(model.config.vocab_size, seq, step)
            rows = BATCH // dp
            ids = ids[dp_rank * rows : (dp_rank + 1) * rows]  # this replica's share
            batches = [h.batch(ids) for h in handles]  # each stage's handle: this step's batch
            for m, b in zip(modules, batches):
                m.position_ids = b.position_ids
            n_tokens = batches[0].n_tokens.clone()
            if dp > 1:
                dist.all_reduce(n_tokens, group=mesh["dp"].get_group())
            share = dp * mesh["cp"].size()  # FSDP averages over dp x cp: undo it

            def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
                loss = cp_causal_lm_loss(logits, labels, n_tokens)
                return loss * share if dp > 1 else loss

            kinds = {
                "gpipe": pl.ScheduleGPipe,
                "1f1b": pl.Schedule1F1B,
                "interleaved_1f1b": pl.ScheduleInterleaved1F1B,
                "interleaved_zero_bubble": pl.ScheduleInterleavedZeroBubble,
            }
            sched_cls = kinds[schedule]
            one = schedule in ("gpipe", "1f1b")
            run = sched_cls(
                stages[0] if one else stages, micro, loss_fn=loss_fn, scale_grads=False
            )  # the loss is already divided by the global token count
            first, last = 0 in mine, (n_stages - 1) in mine
            target = batches[-1].labels if last else None
            if first:  # the CP batch's ids [rows, L], cut into micro-batches by the schedule
                run.step(batches[0].input_ids, target=target)
            else:
                run.step(target=target)
            if dp == 1:
                params = [p for m in modules for p in m.parameters()]
                cp_sum_gradients(params, mesh["cp"].get_group())
            scale = max(float(g.abs().max()) for g in want[step].values())
            for m, naming in zip(modules, full_names):
                for n, p in m.named_parameters():
                    full = naming[n]
                    ref = want[step].get(full)
                    got = p.grad
                    if got is not None and hasattr(got, "full_tensor"):
                        got = got.full_tensor()
                    if ref is None and got is None:
                        continue
                    like = ref if ref is not None else got
                    ref = torch.zeros_like(like) if ref is None else ref
                    got = torch.zeros_like(like) if got is None else got
                    err = float((got - ref).abs().max()) / max(float(ref.abs().max()), 1e-2 * scale)
                    if not errors or err > max(errors):
                        worst_name = full
                    errors.append(err)
            for m in modules:
                m.zero_grad(set_to_none=True)
            gc.collect()  # the step's graphs are gone: their records with them
            live.append(sum(len(h.records.live()) for h in handles))
    finally:
        for h in handles:
            disable_cp(h)
    return {
        "grad_err": max(errors),
        "worst": worst_name,
        "params_checked": len(errors),
        "live_records": live,
        "stages": len(modules),
    }


def pipeline_suite(rank: int, world: int, cases: list[tuple]) -> list[dict[str, Any]]:
    """Every ``(kind, schedule, cp, layout, reentrant)`` on a ``(2, cp)`` mesh of the world."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    out = []
    refs: dict[tuple, Any] = {}
    for kind, schedule, cp, layout, reentrant in cases:
        key = (kind, reentrant)
        if key not in refs:
            refs[key] = reference(kind, reentrant)
        if world == 4 * cp:  # (pp, dp, cp): FSDP2 over the flattened (dp, cp)
            mesh = init_device_mesh("cpu", (2, 2, cp), mesh_dim_names=("pp", "dp", "cp"))
        else:
            mesh = init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("pp", "cp"))
        res = pipeline_case(kind, schedule, mesh, layout, reentrant, refs[key])
        out.append({"case": (kind, schedule, cp, layout, reentrant), **res})
        dist.barrier()
    out.append({"cut_group": cut_group_error(mesh)})
    return out


def cut_group_error(mesh: Any) -> str:
    """A GLM-5 stage that starts inside a shared-indexer group (its first layer reuses the
    selection of a layer in the stage before): the HpCpError ``enable_cp`` raises."""
    from hp_cp_core import HpCpError

    stage = HFStage(build("glm_moe_dsa"), 1, 4)
    try:
        disable_cp(enable_cp(stage, mesh["cp"]))
    except HpCpError as exc:
        return str(exc)
    return "no error"

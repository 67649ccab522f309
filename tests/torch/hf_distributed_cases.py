"""Rank function of tests/torch/test_hf_distributed.py: CP next to HF's own parallelism.

A tiny random ``DeepseekV4ForCausalLM`` is saved to a directory and reloaded with
``from_pretrained(path, distributed_config=DistributedConfig(...))`` (TP / EP on the experts,
FSDP2 applied by HF), CP on one of HF's data-parallel axes through
``cp_layout_from_hf_model``. One 4-rank gloo job runs everything:

* ``single``: rank 0, the same directory loaded without a ``DistributedConfig`` and without
  CP, on the global batch with HF's own ``labels=`` loss: the gradients of the first step,
  the loss of each of STEPS AdamW steps (new batches);
* each layout of LAYOUTS: the same STEPS steps under CP (the first step's gradients, every
  loss); SAVE_FROM also saves a torch.distributed.checkpoint after
  SAVE_AT steps;
* ``resumed``: RESUME_ON loads that checkpoint into a fresh model and optimizer and trains
  the remaining steps;
* ``refused``: what ``cp_layout_from_hf_model`` raised on every rank, for ``axis="tp"`` and
  for a ``tp_plan`` that shards the attention.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from hp_cp_core import DeepSeekV4CPConfig, HpCpError, disable_cp

GLOBAL_BATCH, SEQ, STEPS, SAVE_AT, LR = 2, 37, 3, 2, 1e-3
CONFIG = {"compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}}
LAYOUTS: dict[str, tuple[dict[str, int], str]] = {
    "tp2_fsdp2@fsdp": ({"tp_size": 2, "fsdp_size": 2}, "fsdp"),
    "ep2_dpr2_fsdp2@fsdp": ({"ep_size": 2, "dp_replicate_size": 2, "fsdp_size": 2}, "fsdp"),
    "ep2_dpr2_fsdp2@dp_replicate": (
        {"ep_size": 2, "dp_replicate_size": 2, "fsdp_size": 2},
        "dp_replicate",
    ),
    "tp2_ep2_fsdp2@fsdp": ({"tp_size": 2, "ep_size": 2, "fsdp_size": 2}, "fsdp"),
}
SAVE_FROM, RESUME_ON = "tp2_ep2_fsdp2@fsdp", "ep2_dpr2_fsdp2@dp_replicate"


def save_tiny_model(path: str) -> None:
    """Rank 0 saves a tiny random DeepseekV4ForCausalLM (seed 0) to ``path``."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from hp_cp_torch.cli.parity import TINY_CONFIG

    if dist.get_rank() == 0:
        torch.manual_seed(0)
        DeepseekV4ForCausalLM(DeepseekV4Config(**{**TINY_CONFIG, **CONFIG})).save_pretrained(path)
    dist.barrier()


def load(path: str, sizes: dict[str, Any] | None = None) -> Any:
    from transformers import DeepseekV4ForCausalLM, DistributedConfig

    kwargs = {} if sizes is None else {"distributed_config": DistributedConfig(**sizes)}
    return DeepseekV4ForCausalLM.from_pretrained(path, attn_implementation="eager", **kwargs)


def batch(step: int, first: int, count: int) -> torch.Tensor:
    """Sequences ``first .. first+count-1`` of the global batch of ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 128, (GLOBAL_BATCH, SEQ), generator=g)[first : first + count]


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a DTensor gathered: a collective on its mesh)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def optimizer(model: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def single_process(path: str) -> dict[str, Any]:
    from hp_cp_torch.integrations.transformers import freeze_csa_indexer

    model = load(path)
    freeze_csa_indexer(model)
    opt, losses, grads = optimizer(model), [], {}
    for step in range(STEPS):
        ids = batch(step, 0, GLOBAL_BATCH)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # HF's own loss
        loss.backward()
        if step == 0:
            grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return {"losses": losses, "grads": grads}


def cp_run(
    path: str,
    sizes: dict[str, int],
    axis: str,
    steps: range = range(STEPS),
    save: str | None = None,
    load_from: str | None = None,
) -> dict[str, Any]:
    """HF's DistributedConfig layout, CP on ``axis``; results gathered to rank 0."""
    from hp_cp_torch.integrations.transformers import cp_layout_from_hf_model

    model = load(path, sizes)
    layout = cp_layout_from_hf_model(model, axis=axis)
    handle = layout.enable_cp(model, DeepSeekV4CPConfig(layout="load_balanced"))
    opt = optimizer(model)
    if load_from is not None:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=load_from)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    per_replica = GLOBAL_BATCH // layout.dp_size
    first = layout.dp_mesh.get_local_rank() * per_replica
    losses, grads = [], {}
    for step in steps:
        b = handle.batch(batch(step, first, per_replica))
        out = model(**b.model_inputs(), use_cache=False)
        loss = layout.causal_lm_loss(out.logits, b.labels, b.n_tokens)
        loss.backward()
        if step == 0:
            grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(layout.global_loss(loss))
        if save is not None and step + 1 == SAVE_AT:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=save)
    disable_cp(handle)
    res = {"losses": losses, "grads": grads, "cp_size": layout.cp_size}
    return res if dist.get_rank() == 0 else {"losses": losses}


def refused(path: str) -> dict[str, str]:
    """The errors of CP on HF's ``tp`` axis and of a ``tp_plan`` sharding the attention
    (raised on every rank, before any collective)."""
    from hp_cp_torch.integrations.transformers import cp_layout_from_hf_model

    out = {}
    attn_plan = {"model.layers.*.self_attn.q_b_proj": "colwise"}
    for name, sizes, axis in [
        ("tp", {"tp_size": 2, "fsdp_size": 2}, "tp"),
        ("tp_attention", {"tp_size": 2, "fsdp_size": 2, "tp_plan": attn_plan}, "fsdp"),
    ]:
        model = load(path, sizes)
        try:
            cp_layout_from_hf_model(model, axis=axis)
            out[name] = "no error"
        except HpCpError as exc:
            out[name] = str(exc)
    return out


def hf_distributed_suite(rank: int, world: int, model_dir: str, ckpt_dir: str) -> dict[str, Any]:
    assert world == 4
    torch.set_num_threads(1)
    save_tiny_model(model_dir)
    res: dict[str, Any] = {}
    if rank == 0:
        res["single"] = single_process(model_dir)
    dist.barrier()
    for name, (sizes, axis) in LAYOUTS.items():
        res[name] = cp_run(model_dir, sizes, axis, save=ckpt_dir if name == SAVE_FROM else None)
    sizes, axis = LAYOUTS[RESUME_ON]
    res["resumed"] = cp_run(model_dir, sizes, axis, range(SAVE_AT, STEPS), load_from=ckpt_dir)
    res["refused"] = refused(model_dir)
    return res

"""Rank function of tests/torch/test_training.py: the recipe in
``examples/train_deepseek_v4_cp.py`` (its own functions, imported by path) trained on 4 gloo
ranks and compared with one process on the global batch.

One job runs everything (a 4-rank job costs seconds to start):

* ``single``: rank 0 trains the tiny DeepseekV4ForCausalLM without CP on the global batch
  (HF's own ``labels=`` loss), SGD, recording the loss of each step and the final weights;
* ``fsdp`` (dp 2 x cp 2, load-balanced, FSDP2 per decoder layer over the flattened mesh),
  ``ddp`` (dp 2 x cp 2, contiguous) and ``fsdp_hf_checkpointing`` (HF's
  ``gradient_checkpointing_enable``): the same steps under CP;
* checkpoints (AdamW): ``straight`` trains STEPS steps; ``resumed`` trains SAVE_AT steps,
  saves with torch.distributed.checkpoint, loads into a fresh model and optimizer and trains
  on; ``resumed_cp4`` loads the same checkpoint on a dp 1 x cp 4 mesh;
* the reference layer under CP (cp 4) inside ``torch.utils.checkpoint`` (non-reentrant) and
  under ``torch.compile``, against the same layer without them.

The sequence length (SEQ = 37) suits neither layout: every step pads.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hp_cp_core import DeepSeekV4CPConfig, disable_cp, enable_cp
from hp_cp_torch.integrations.transformers import freeze_csa_indexer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_deepseek_v4_cp.py"
DP, BATCH, SEQ, STEPS, SAVE_AT, LR = 2, 1, 37, 3, 2, 0.2
CONFIG = {"compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}}


def recipe() -> Any:
    """The example script as a module (it is a script, not part of a package)."""
    name = "train_deepseek_v4_cp"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def batch(step: int, first: int, count: int, vocab: int) -> torch.Tensor:
    return recipe().synthetic_batch(step, first, count, SEQ, vocab, seed=0)


def full_params(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor (FSDP's DTensors gathered; a collective)."""
    inner = getattr(model, "module", model)
    out = {}
    for name, p in inner.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().clone()
    return out


@functools.cache
def full_params_init() -> dict[str, torch.Tensor]:
    """The weights before training (to check that training moved them)."""
    return full_params(recipe().build_model(CONFIG, 0, torch.device("cpu")))


def single_process(optimizer: str) -> dict[str, Any]:
    """One process, no CP, the global batch (DP * BATCH sequences) each step."""
    r = recipe()
    model = r.build_model(CONFIG, 0, torch.device("cpu"))
    freeze_csa_indexer(model)
    opt = _optimizer(model, optimizer)
    vocab, losses = model.config.vocab_size, []
    for step in range(STEPS):
        ids = batch(step, 0, DP * BATCH, vocab)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # HF's own loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return {"losses": losses, "params": full_params(model)}


def _optimizer(model: Any, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return recipe().make_optimizer(model, 1e-2)
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)


def cp_run(
    dp: int,
    cp: int,
    layout: str,
    parallel: str,
    optimizer: str = "sgd",
    checkpointing: bool = False,
    steps: range = range(STEPS),
    save: str | None = None,
    load: str | None = None,
) -> dict[str, Any]:
    """The recipe's own setup and train_step on a (dp, cp) mesh of the 4 ranks."""
    r = recipe()
    mesh, device = r.setup_mesh(dp, cp)
    model = r.build_model(CONFIG, 0, device)
    model, handle = r.parallelize(model, mesh, layout, parallel, checkpointing)
    opt = _optimizer(model, optimizer)
    if load is not None:
        start, _ = r.load_checkpoint(Path(load), model, opt)
        assert start == steps.start, (start, steps)
    per_replica = DP * BATCH // dp
    first = mesh["dp"].get_local_rank() * per_replica
    vocab = int(getattr(model, "module", model).config.vocab_size)
    losses = []
    for step in steps:
        ids = batch(step, first, per_replica, vocab)
        losses.append(r.train_step(model, opt, handle, ids, mesh))
    if save is not None:
        r.save_checkpoint(Path(save), model, opt, steps.stop, losses)
    params = full_params(model)
    disable_cp(handle)
    return {"losses": losses, "params": params if dist.get_rank() == 0 else None}


class Block(nn.Module):
    """A linear layer, then the reference attention layer: what torch.compile compiles."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.attn = attn

    def forward(self, x: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        return self.attn(torch.tanh(self.proj(x)), loss_mask=loss_mask)


def layer_wrappers(rank: int) -> dict[str, Any]:
    """A linear layer and the reference CSA layer under CP (cp 4, load-balanced, S = 37
    padded) plain, inside ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
    and ``torch.compile``d (``aot_eager``: AOTAutograd without a C++ toolchain): output,
    indexer loss and every gradient of the three, unsharded on rank 0."""
    from cases import layer_config

    from hp_cp_torch.reference import DeepSeekV4Attention

    out: dict[str, Any] = {}
    for mode in ("plain", "checkpoint", "compile"):
        torch.manual_seed(5)
        attn = DeepSeekV4Attention(layer_config(4))
        block = Block(attn)
        x = torch.randn(2, SEQ, 32, generator=torch.Generator().manual_seed(6))
        g = torch.randn(2, SEQ, 32, generator=torch.Generator().manual_seed(7))
        handle = enable_cp(attn, dist.group.WORLD, DeepSeekV4CPConfig(layout="load_balanced"))
        xl = handle.shard(x, 1, pad_value=0.0).requires_grad_(True)
        mask = handle.shard(torch.ones(2, SEQ), 1, pad_value=0)
        if mode == "checkpoint":
            y = torch.utils.checkpoint.checkpoint(block, xl, mask, use_reentrant=False)
        elif mode == "compile":
            y = torch.compile(block, backend="aot_eager")(xl, mask)
        else:
            y = block(xl, mask)
        loss = (y * handle.shard(g, 1, pad_value=0.0)).sum()
        params = dict(block.named_parameters())
        grads = torch.autograd.grad(loss, [xl, *params.values()], allow_unused=True)
        summed = {}
        for name, gr in zip(params, grads[1:]):
            t = torch.zeros_like(params[name]) if gr is None else gr.detach().clone()
            dist.all_reduce(t)
            summed[name] = t
        out[mode] = {
            "out": handle.unshard(y.detach(), 1, rows=SEQ),
            "gx": handle.unshard(grads[0], 1, rows=SEQ),
            "pgrads": summed,
            "indexer_loss": attn.indexer_loss,
        }
        if mode == "compile":  # dynamo really compiled graphs around the CP layer
            from torch._dynamo.utils import counters

            out[mode]["graphs"] = int(counters["stats"]["unique_graphs"])
        disable_cp(handle)
    return out if rank == 0 else {}


def training_suite(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    assert world == 4
    torch.set_num_threads(1)
    res: dict[str, Any] = {}
    if rank == 0:
        res["single"] = single_process("sgd")
    dist.barrier()
    res["fsdp"] = cp_run(2, 2, "load_balanced", "fsdp")
    res["ddp"] = cp_run(2, 2, "contiguous", "ddp")
    res["fsdp_hf_checkpointing"] = cp_run(2, 2, "load_balanced", "fsdp", checkpointing=True)
    res["straight"] = cp_run(2, 2, "load_balanced", "fsdp", "adamw")
    cp_run(2, 2, "load_balanced", "fsdp", "adamw", steps=range(SAVE_AT), save=ckpt_dir)
    later = range(SAVE_AT, STEPS)
    res["resumed"] = cp_run(2, 2, "load_balanced", "fsdp", "adamw", steps=later, load=ckpt_dir)
    res["resumed_cp4"] = cp_run(1, 4, "load_balanced", "fsdp", "adamw", steps=later, load=ckpt_dir)
    res["layer"] = layer_wrappers(rank)
    return res

"""Train a DeepseekV4ForCausalLM with context parallelism (hp_cp) and FSDP2 over (dp, cp).

Every process is one rank of a (dp, cp) mesh: the ``cp`` ranks of a data-parallel replica
split each sequence (``enable_cp`` on ``mesh["cp"]``), the ``dp`` replicas take different
sequences, and FSDP2 (or DDP) shards and reduces the parameters over all dp x cp ranks::

    torchrun --standalone --nproc-per-node 4 examples/train_deepseek_v4_cp.py \\
        --dp 2 --cp 2 --steps 20 --save ckpt
    torchrun --standalone --nproc-per-node 4 examples/train_deepseek_v4_cp.py \\
        --dp 2 --cp 2 --steps 40 --resume ckpt --save ckpt

Or next to Hugging Face's own parallelism: ``--hf-parallel tp2,fsdp2 --cp-axis fsdp`` loads the
model with ``from_pretrained(path, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))``
(TP / EP on the experts, FSDP2 by HF) and runs CP on HF's ``fsdp`` (or ``dp_replicate``) axis::

    torchrun --standalone --nproc-per-node 4 examples/train_deepseek_v4_cp.py \
        --hf-parallel tp2,ep2,fsdp2 --cp-axis fsdp --steps 20

CPU: gloo; GPUs: NCCL, one rank per GPU (``LOCAL_RANK``). The model is tiny by default
(``--config model.json`` overrides any ``DeepseekV4Config`` field); the data are synthetic
token sequences (``--text FILE`` trains on the bytes of a local text file instead). Prints
per-step loss, tokens/s per rank and max memory; writes a loss-curve PNG at the end.
Needs ``pip install ./hp_cp_core ./hp_cp_torch[train]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from hp_cp_core import CPConfig, CPHandle, enable_cp
from hp_cp_torch.cli.parity import TINY_CONFIG
from hp_cp_torch.integrations.transformers import (
    HFCPLayout,
    cp_causal_lm_loss,
    cp_layout_from_hf_model,
    freeze_csa_indexer,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--cp", type=int, default=None, help="CP ranks per replica (default: all)")
    p.add_argument("--layout", default="load_balanced", choices=["contiguous", "load_balanced"])
    p.add_argument("--seq-len", type=int, default=250, help="tokens per sequence (any length)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per dp replica")
    p.add_argument("--steps", type=int, default=20, help="train until this global step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parallel", default="fsdp", choices=["fsdp", "ddp"])
    p.add_argument(
        "--hf-parallel",
        help="HF's own parallelism instead of --dp/--parallel: DistributedConfig sizes as "
        "tpN,epN,fsdpN,dp_replicateN (e.g. tp2,fsdp2); CP on --cp-axis",
    )
    p.add_argument(
        "--cp-axis",
        default="fsdp",
        help="with --hf-parallel: HF's data-parallel axis CP splits sequences over "
        "(fsdp or dp_replicate)",
    )
    p.add_argument(
        "--model",
        type=Path,
        help="with --hf-parallel: a saved DeepseekV4ForCausalLM directory (default: the tiny "
        "model, saved by rank 0 to a temporary directory on this machine)",
    )
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--config", type=Path, help="JSON of DeepseekV4Config overrides")
    p.add_argument("--text", type=Path, help="train on this file's bytes (vocab 256)")
    p.add_argument("--save", type=Path, help="save a torch.distributed.checkpoint here")
    p.add_argument("--resume", type=Path, help="resume from a checkpoint saved with --save")
    p.add_argument("--plot", type=Path, default=Path("train_loss.png"), help="loss curve PNG")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- setup


def setup_device() -> torch.device:
    """This rank's device, with the process group: NCCL with one GPU per rank, else gloo."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def setup_mesh(dp: int, cp: int | None) -> tuple[DeviceMesh, torch.device]:
    """The (dp, cp) device mesh: NCCL with one GPU per rank, else gloo on CPU."""
    device = setup_device()
    world = dist.get_world_size()
    cp = world // dp if cp is None else cp
    if dp * cp != world:
        raise SystemExit(f"--dp {dp} x --cp {cp} must equal the {world} ranks torchrun started")
    mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
    return mesh, device


def build_model(overrides: dict[str, Any], seed: int, device: torch.device) -> Any:
    """A DeepseekV4ForCausalLM from a config (the same weights on every rank for one seed)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV4Config(**{**TINY_CONFIG, **overrides})
    config._attn_implementation = "eager"
    return DeepseekV4ForCausalLM(config).to(device)


def parallelize(
    model: Any,
    mesh: DeviceMesh,
    layout: str = "load_balanced",
    parallel: str = "fsdp",
    checkpointing: bool = False,
) -> tuple[Any, CPHandle]:
    """CP over ``mesh["cp"]``, then FSDP2 per decoder layer (or DDP) over dp x cp.

    The gradient of every parameter must be reduced over the CP ranks too (each holds the
    gradient of its own tokens), so FSDP / DDP span the flattened (dp, cp) mesh.
    """
    handle = enable_cp(model, mesh["cp"], CPConfig(layout=layout))
    freeze_csa_indexer(model)  # it gets no gradient: keep it out of the optimizer
    if checkpointing:  # HF's switch: torch's non-reentrant checkpoint per decoder layer
        model.gradient_checkpointing_enable({"use_reentrant": False})
    dp_cp = mesh["dp", "cp"]._flatten()
    if parallel == "fsdp":
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp_cp)
        fully_shard(model, mesh=dp_cp)
        return model, handle
    # a parameter without gradient on some step (a router no token reached) is allowed
    ddp = DistributedDataParallel(
        model, process_group=dp_cp.get_group(), find_unused_parameters=True
    )
    return ddp, handle


def parse_hf_parallel(spec: str) -> dict[str, int]:
    """``"tp2,fsdp2"`` -> ``{"tp_size": 2, "fsdp_size": 2}`` (DistributedConfig's sizes)."""
    sizes = {}
    for part in spec.split(","):
        m = re.fullmatch(r"(tp|ep|fsdp|dp_replicate)([1-9][0-9]*)", part.strip())
        if m is None:
            raise SystemExit(
                f"--hf-parallel {spec!r}: {part!r} is not tpN, epN, fsdpN or dp_replicateN; "
                "write e.g. --hf-parallel tp2,fsdp2"
            )
        sizes[f"{m[1]}_size"] = int(m[2])
    return sizes


def hf_parallelize(
    model_dir: Path | None,
    spec: str,
    cp_axis: str,
    overrides: dict[str, Any],
    seed: int,
    layout: str = "load_balanced",
    checkpointing: bool = False,
) -> tuple[Any, CPHandle, HFCPLayout]:
    """``from_pretrained(..., distributed_config=DistributedConfig(...))``, then CP on HF's
    ``cp_axis`` (:func:`cp_layout_from_hf_model`; the indexer frozen). Without
    ``model_dir``, rank 0 saves :func:`build_model`'s model to a temporary directory."""
    from transformers import DeepseekV4ForCausalLM, DistributedConfig

    sizes = parse_hf_parallel(spec)
    path = [str(model_dir) if model_dir is not None else None]
    if model_dir is None and dist.get_rank() == 0:
        path[0] = tempfile.mkdtemp(prefix="hp_cp_model_")
        build_model(overrides, seed, torch.device("cpu")).save_pretrained(path[0])
    dist.broadcast_object_list(path)
    model = DeepseekV4ForCausalLM.from_pretrained(
        path[0], attn_implementation="eager", distributed_config=DistributedConfig(**sizes)
    )
    dist.barrier()
    if model_dir is None and dist.get_rank() == 0:
        shutil.rmtree(path[0], ignore_errors=True)
    hf = cp_layout_from_hf_model(model, axis=cp_axis)
    handle = hf.enable_cp(model, CPConfig(layout=layout))
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    return model, handle, hf


def make_optimizer(model: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)


# ----------------------------------------------------------------------------- data


def synthetic_batch(step: int, first: int, count: int, seq_len: int, vocab: int, seed: int):
    """Sequences ``first .. first+count-1`` of global step ``step``: arithmetic progressions
    ``(a + b*t) mod vocab`` with a random start and stride (learnable in context)."""
    rows = []
    for i in range(first, first + count):
        g = np.random.default_rng([seed, step, i])
        a, b = int(g.integers(vocab)), int(g.integers(1, 8))
        rows.append((a + b * np.arange(seq_len)) % vocab)
    return torch.as_tensor(np.stack(rows), dtype=torch.long)


def text_batch(data: np.ndarray, step: int, first: int, count: int, seq_len: int, seed: int):
    """Random windows of a byte array (the same windows for one (seed, step, index))."""
    rows = []
    for i in range(first, first + count):
        g = np.random.default_rng([seed, step, i])
        at = int(g.integers(max(len(data) - seq_len, 1)))
        rows.append(np.resize(data[at : at + seq_len], seq_len))
    return torch.as_tensor(np.stack(rows).astype(np.int64))


# ----------------------------------------------------------------------------- training


def train_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    handle: CPHandle,
    ids: torch.Tensor,
    mesh: DeviceMesh,
) -> float:
    """One optimizer step on this rank's rows of its replica's sequences ``ids`` [B, S].

    Loss: the mean cross-entropy over every target of the GLOBAL batch. Each rank computes
    ``sum over its tokens / N`` (N: targets of all replicas); those shares sum to the global
    mean, so the summed gradients are its gradients. FSDP / DDP average over the dp x cp
    ranks, hence the backward of ``share * dp * cp``. Returns the global loss (all ranks).
    """
    batch = handle.batch(ids)  # shifted, padded and sharded for this rank
    n_tokens = batch.n_tokens.clone()
    dist.all_reduce(n_tokens, group=mesh["dp"].get_group())  # targets of the global batch
    out = model(**batch.model_inputs(), use_cache=False)
    share = cp_causal_lm_loss(out.logits, batch.labels, n_tokens)
    (share * mesh.size()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    total = share.detach().clone()
    dist.all_reduce(total)  # the shares of all ranks sum to the global loss
    return float(total)


def hf_train_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    handle: CPHandle,
    ids: torch.Tensor,
    hf: HFCPLayout,
) -> float:
    """:func:`train_step` under HF's parallelism: HF's FSDP2 divides the gradients by
    ``hf.grad_divide_factor`` (it counts the CP ranks), which ``hf.causal_lm_loss`` applies,
    with the targets summed over the real data-parallel ranks. Returns the global loss."""
    batch = handle.batch(ids)
    out = model(**batch.model_inputs(), use_cache=False)
    loss = hf.causal_lm_loss(out.logits, batch.labels, batch.n_tokens)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return hf.global_loss(loss)


def save_checkpoint(path: Path, model: Any, optimizer: Any, step: int, losses: list) -> None:
    """Model and optimizer with torch.distributed.checkpoint (sharded, any mesh can load it),
    plus the step and loss history (rank 0, JSON). CP itself has no state to save."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    if dist.get_rank() == 0:
        (path / "train_state.json").write_text(json.dumps({"step": step, "losses": losses}))
    dist.barrier()


def load_checkpoint(path: Path, model: Any, optimizer: Any) -> tuple[int, list]:
    """Load what :func:`save_checkpoint` wrote into an already parallelised model."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    meta = json.loads((path / "train_state.json").read_text())
    return int(meta["step"]), list(meta["losses"])


def max_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak RSS (Linux: KiB)


def plot_losses(losses: list[float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (global batch mean)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    train(parse_args(argv))
    # Everything that held a process group (model, optimizer, CP handle, meshes) died with
    # train's frame; cycles go now, so gloo's threads end in destroy_process_group, not at
    # interpreter exit (where a rank can abort with "terminate called without an active
    # exception"). The barrier keeps every rank's teardown after the last collective of all.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def train(args: argparse.Namespace) -> None:
    """The recipe: build, parallelise, (resume,) train, (save,) plot. Leaves the process group
    up; :func:`main` tears it down."""
    from tqdm import tqdm

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    overrides = json.loads(args.config.read_text()) if args.config else {}
    text = None
    if args.text is not None:
        text = np.frombuffer(args.text.read_bytes(), dtype=np.uint8)
        overrides["vocab_size"] = 256
    if args.hf_parallel:
        device = setup_device()
        model, handle, hf = hf_parallelize(
            args.model,
            args.hf_parallel,
            args.cp_axis,
            overrides,
            args.seed,
            args.layout,
            args.checkpointing,
        )
        dp, dp_rank = hf.dp_size, hf.dp_mesh.get_local_rank()
        what = f"HF {args.hf_parallel}, CP on {args.cp_axis}"
        optimizer = make_optimizer(model, args.lr)

        def step_fn(ids: torch.Tensor) -> float:
            return hf_train_step(model, optimizer, handle, ids, hf)
    else:
        mesh, device = setup_mesh(args.dp, args.cp)
        dp, dp_rank = args.dp, mesh["dp"].get_local_rank()
        model = build_model(overrides, args.seed, device)
        model, handle = parallelize(model, mesh, args.layout, args.parallel, args.checkpointing)
        what = args.parallel
        optimizer = make_optimizer(model, args.lr)

        def step_fn(ids: torch.Tensor) -> float:
            return train_step(model, optimizer, handle, ids, mesh)

    rank, vocab = dist.get_rank(), int(getattr(model, "module", model).config.vocab_size)
    start, losses = 0, []
    if args.resume is not None:
        start, losses = load_checkpoint(args.resume, model, optimizer)
    if rank == 0:
        print(
            f"dp {dp} x cp {handle.cp_size} ({args.layout}, {what}) on "
            f"{device.type}; seq {args.seq_len} (padded to "
            f"{handle.padding(args.seq_len).padded_rows}), {args.batch_size} seq / replica; "
            f"steps {start} -> {args.steps}",
            flush=True,
        )
    bar = tqdm(range(start, args.steps), disable=rank != 0, desc="train", unit="step")
    first = dp_rank * args.batch_size
    for step in bar:
        if text is None:
            ids = synthetic_batch(step, first, args.batch_size, args.seq_len, vocab, args.seed)
        else:
            ids = text_batch(text, step, first, args.batch_size, args.seq_len, args.seed)
        t0 = time.perf_counter()
        loss = step_fn(ids.to(device))
        seconds = time.perf_counter() - t0
        losses.append(loss)
        local_tokens = args.batch_size * handle.padding(args.seq_len).padded_rows // handle.cp_size
        tok_s = local_tokens / seconds
        mem = max_memory_mib(device)
        if rank == 0:
            bar.set_postfix(loss=f"{loss:.4f}", tok_s_rank=f"{tok_s:.0f}")
            bar.write(
                f"step {step + 1:4d}  loss {loss:.4f}  tokens/s per rank {tok_s:8.1f}  "
                f"max memory {mem:7.1f} MiB"
            )
    if args.save is not None:
        save_checkpoint(args.save, model, optimizer, args.steps, losses)
        if rank == 0:
            print(f"saved checkpoint at step {args.steps} to {args.save}", flush=True)
    if rank == 0 and losses:
        title = f"DeepSeek V4, dp {dp} x cp {handle.cp_size}, seq {args.seq_len}"
        plot_losses(losses, args.plot, title)
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; curve: {args.plot}", flush=True)


if __name__ == "__main__":
    main()

"""GPU check of the hot path (issue 22): steady-state training steps with no host sync.

Run on a CUDA machine from the repository root (torch, numpy, pluggy, transformers; triton
for the second part)::

    PYTHONPATH=hp_cp_core/src:hp_cp_torch/src python scripts/device_hotpath.py [--out PATH]

Two parts, each: warm-up steps, then timed steady-state training steps (forward, backward,
optimizer step) under ``torch.cuda.set_sync_debug_mode("error")``, where any
device-to-host sync raises:

* ``hf``: the 4-layer HF ``DeepseekV4ForCausalLM`` of the benches (sliding, CSA, HCA, CSA;
  hidden 1024, ``hp_cp_torch.bench.memory.HF_MEM_CONFIG``), bf16, at cp = 1 on NCCL
  through the CP path (``CPConfig(single_rank_bypass=False)``), default kernel;
* ``csa_triton``: the reference CSA layer (``hp_cp_torch.reference.DeepSeekV4Attention``,
  the step bench's config) with ``attention_kernel="triton"``, same CP path.

A part whose steps raise under ``"error"`` is rerun under ``"warn"`` and the warnings (one
per sync, with where it came from) are recorded, so one call says both whether and where.
Recorded per part, to ``--out`` (default ``bench/device/hotpath.json``): tokens/s over the
timed steps, peak memory (``torch.cuda.max_memory_allocated``), the sync mode it passed
under, the syncs seen (``"warn"`` rerun) and the error.

``--dry-run``: the same on the CPU with gloo and small shapes (no sync debug mode there: the
host reads are counted by ``hp_cp_torch.bench.hotpath.HostReads`` instead, as in
``hp-cp bench``); the Triton part runs with the banded kernel. Meant to finish in about a
minute on an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

DEFAULT_OUT = "bench/device/hotpath.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="the JSON written")
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, small shapes")
    parser.add_argument("--seq", type=int, default=None, help="S (default 8192; dry run 256)")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the timed ones")
    parser.add_argument("--steps", type=int, default=5, help="timed steady-state steps")
    parser.add_argument(
        "--parts", default="hf,csa_triton", help="which parts to run (comma-separated)"
    )
    args = parser.parse_args(argv)
    if args.seq is None:
        args.seq = 256 if args.dry_run else 8192
    return args


def _init_group(dry_run: bool) -> str:
    import torch
    import torch.distributed as dist

    backend = "gloo" if dry_run else "nccl"
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        if not dry_run:
            torch.cuda.set_device(0)
        dist.init_process_group(backend, rank=0, world_size=1)
    return backend


def _hf_part(args: argparse.Namespace, device: Any) -> tuple[Any, Any, int]:
    """``(step, handle, tokens per step)`` of the HF model at cp = 1 through the CP path."""
    import torch

    from hp_cp_core import CPConfig, enable_cp
    from hp_cp_torch.bench.memory import HF_MEM_CONFIG
    from hp_cp_torch.cli.parity import (
        CSA,
        HCA,
        SLIDING,
        build_tiny_model,
        make_inputs,
    )
    from hp_cp_torch.integrations.transformers import cp_causal_lm_loss, cp_shift_labels

    dtype = torch.float32 if args.dry_run else torch.bfloat16
    model = build_tiny_model(
        0,
        **HF_MEM_CONFIG,
        num_hidden_layers=4,
        layer_types=[SLIDING, CSA, HCA, CSA],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    )
    model = model.to(device=device, dtype=dtype).train()
    handle = enable_cp(model, None, CPConfig(single_rank_bypass=False))
    ids = make_inputs(HF_MEM_CONFIG["vocab_size"], 1, args.seq).to(device)
    labels = cp_shift_labels(ids)
    n_tok = (labels != -100).sum()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        # no position_ids: HF's packed-sequence check on them reads the device
        out = model(input_ids=ids, use_cache=False)
        cp_causal_lm_loss(out.logits, labels, n_tok).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, handle, args.seq


def _csa_part(args: argparse.Namespace, device: Any) -> tuple[Any, Any, int]:
    """The reference CSA layer with the Triton kernel (banded on a dry run), CP path."""
    import torch

    from hp_cp_core import CPConfig, enable_cp
    from hp_cp_torch.bench.scaling import step_config
    from hp_cp_torch.reference import DeepSeekV4Attention

    dtype = torch.float32 if args.dry_run else torch.bfloat16
    torch.manual_seed(0)
    cfg = step_config()
    layer = DeepSeekV4Attention(cfg).to(device=device, dtype=dtype).train()
    kernel = "banded" if args.dry_run else "triton"
    options = CPConfig(attention_kernel=kernel, single_rank_bypass=False)
    handle = enable_cp(layer, None, options)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, args.seq, cfg.hidden_size, generator=gen).to(device=device, dtype=dtype)
    g = torch.randn(1, args.seq, cfg.hidden_size, generator=gen).to(device=device, dtype=dtype)
    opt = torch.optim.SGD(layer.parameters(), lr=1e-4)

    def step() -> None:
        torch.autograd.backward(layer(x.detach().requires_grad_(True)), g)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, handle, args.seq


PARTS = {"hf": _hf_part, "csa_triton": _csa_part}


def _timed(step: Any, steps: int, dry_run: bool) -> tuple[float, int]:
    """Seconds of ``steps`` steps (synchronised around them, not inside)."""
    import torch

    if not dry_run:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if not dry_run:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, steps


def run_part(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from hp_cp_core import disable_cp
    from hp_cp_torch.bench.hotpath import HostReads

    device = torch.device("cpu" if args.dry_run else "cuda")
    res: dict[str, Any] = {"seq": args.seq, "steps": args.steps}
    try:
        step, handle, tokens = PARTS[name](args, device)
        for _ in range(args.warmup):
            step()
        if not args.dry_run:
            torch.cuda.reset_peak_memory_stats()
        if args.dry_run:
            reads = HostReads()
            with reads:
                seconds, n = _timed(step, args.steps, True)
            res["host_reads_per_step_cp"] = reads.counts["cp"] / n
            res["host_reads_per_step_model"] = reads.counts["model"] / n
            res["sync_mode"] = "none (CPU: counted host reads)"
        else:
            try:
                torch.cuda.set_sync_debug_mode("error")
                seconds, n = _timed(step, args.steps, False)
                res["sync_mode"] = "error"
            except RuntimeError as exc:
                torch.cuda.set_sync_debug_mode(0)
                res["error_under_sync_error_mode"] = f"{type(exc).__name__}: {exc}"[:2000]
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    seconds, n = _timed(step, args.steps, False)
                res["sync_mode"] = "warn (failed under error)"
                res["syncs_per_step"] = len(seen) / n
                res["sync_sites"] = sorted({f"{w.filename}:{w.lineno}" for w in seen})[:40]
            finally:
                torch.cuda.set_sync_debug_mode(0)
            res["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated())
        res["tokens_per_s"] = tokens * n / seconds
        res["step_s"] = seconds / n
        disable_cp(handle)
    except Exception as exc:  # noqa: BLE001 - recorded, the other part still runs
        res["failed"] = f"{type(exc).__name__}: {exc}"[:2000]
        res["traceback"] = traceback.format_exc()[-4000:]
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    backend = _init_group(args.dry_run)
    out: dict[str, Any] = {
        "backend": backend,
        "dry_run": args.dry_run,
        "torch": torch.__version__,
        "device": "cpu" if args.dry_run else torch.cuda.get_device_name(0),
        "host": platform.node(),
    }
    for name in (p for p in args.parts.split(",") if p):
        out[name] = run_part(name, args)
        print(name, json.dumps(out[name], indent=1)[:3000], flush=True)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, sort_keys=True))
    print(f"wrote {path}")
    import torch.distributed as dist

    dist.destroy_process_group()
    failed = [n for n in out if isinstance(out[n], dict) and "failed" in out[n]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

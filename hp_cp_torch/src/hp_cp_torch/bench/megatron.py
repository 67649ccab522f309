"""Side by side with Megatron's own DSA context parallelism: one megatron-core 0.19.2
``GPTModel`` of MLA + DSA layers (Megatron's own spec), the same weights and the same batch,
one training step (``schedules.forward_step`` + ``backward_step``, Megatron's loss) at cp 2
and 4 under

* ``megatron``: Megatron's all-gather DSA CP (``cp_comm_type="allgather"``: the latent keys and
  the indexer keys all-gathered, their gradients reduce-scattered; the batch sharded by
  ``get_batch_on_this_cp_rank``, zigzag), its unfused CPU path
  (``dsa_kernel_backend="none"``);
* ``hp_cp``: hp_cp on Megatron's CP group (``hp_cp_torch.integrations.megatron``; the batch
  from ``handle.batch``, load-balanced), the latents and indexer keys of each rank's causal
  prefix moved point to point;
* ``allgather``: the same hp_cp kernels with every rank's latents and indexer keys
  all-gathered (the group's ``point_to_point`` off): the same-kernel all-gather baseline, so
  that a memory lead over Megatron is split into what CP's exchange saves and what the
  kernels save.

Widths: the published latent widths of DeepSeek V3.2 / GLM-5 (``kv_lora_rank`` 512 + rope 64,
``qk_head_dim`` 128, ``v_head_dim`` 128, indexer heads x 128) with fewer attention heads and a
small hidden size, so that Megatron's dense ``[heads, S / cp, S]`` scores fit a CPU; top-k
2048, or the largest power of two below S (so that it selects); the sparse indexer loss on
(``dsa_indexer_loss_coeff=0.1``).

Measures, per cp (max over ranks):

* ``bytes``: bytes each rank receives, forward + backward (hp_cp: counted by its group;
  Megatron: what its all-gathers and reduce-scatters deliver to each rank, Note [Megatron's
  all-gather bytes]; received, not sent, because what a rank receives is the same for any
  all-gather algorithm);
* ``step_time``: seconds of the step (wall, each rank timed alone, this machine's cores
  shared by the ranks: a ratio within one run);
* ``peak_mem``: the most tensor bytes alive at once during the step (``live_tensor_peak``:
  torch's profiler, the CPU's ``max_memory_allocated``).

Keys ``megatron_<measure>_cp<N>_ratio`` are hp_cp over Megatron (lower is better),
``megatron_peak_mem_vs_allgather_cp<N>_ratio`` hp_cp over the same-kernel all-gather.

Runs from a checkout on a CPU: Megatron's MLA + DSA need three CPU shims and a local-backend
spec, which are the test harness's (``tests/megatron/megatron_shims.py``,
``megatron_model.py``), never this library's. ``hp-cp bench --megatron``.

Note [Megatron's all-gather bytes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Per layer with its own indexer, Megatron's ``DSAttention.forward`` all-gathers over CP the
latent keys ``[S / cp, B, 1, kv_lora_rank + rope]`` and the indexer keys ``[S / cp, B, d_I]``
(``gather_from_sequence_parallel_region``, ``tensor_parallel/mappings.py:145``); their
backward reduce-scatters the gradients (``:185``; the indexer keys' only with the indexer loss
on). An all-gather of ``cp`` shards delivers the ``cp - 1`` other shards to each rank, and a
reduce-scatter the ``cp - 1`` other ranks' parts of each rank's shard, so each rank receives
``2 (cp - 1) (S / cp) B (kv_lora_rank + rope + d_I)`` elements per layer (without the loss,
the indexer keys only once). hp_cp's own all-gather baseline, counted by its group, receives
exactly this many bytes.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["MEGATRON_WIDTHS", "megatron_allgather_bytes", "megatron_measures"]

MEGATRON_WIDTHS: dict[str, Any] = dict(
    num_layers=1,
    hidden_size=512,
    ffn_hidden_size=512,
    num_attention_heads=8,
    q_lora_rank=512,
    kv_lora_rank=512,
    qk_head_dim=128,
    qk_pos_emb_head_dim=64,
    v_head_dim=128,
    dsa_indexer_n_heads=32,
    dsa_indexer_head_dim=128,
    dsa_indexer_topk=2048,
)
"""The published latent widths (kv_lora 512 + rope 64, heads of 128 + 64 / 128, indexer
32 x 128, top-k 2048) with 8 attention heads and hidden size 512 (a CPU's scale)."""

VOCAB = 1024
ELEMENT_BYTES = 4  # fp32 on the CPU; bf16 halves both sides alike


def checkout_tests() -> Path:
    """``tests/megatron`` of this checkout (the CPU harness the bench borrows)."""
    return Path(__file__).resolve().parents[4] / "tests" / "megatron"


def megatron_allgather_bytes(seq: int, batch: int, cp: int, layers: int, loss: bool) -> int:
    """Bytes each rank receives in one step of Megatron's all-gather DSA CP (Note [Megatron's
    all-gather bytes]), :data:`MEGATRON_WIDTHS`, fp32."""
    w = MEGATRON_WIDTHS
    latent = w["kv_lora_rank"] + w["qk_pos_emb_head_dim"]
    index = w["dsa_indexer_head_dim"]
    shard_rows = seq // cp * batch
    per_layer = (cp - 1) * shard_rows * (2 * latent + (2 if loss else 1) * index)
    return per_layer * layers * ELEMENT_BYTES


def _topk(seq: int) -> int:
    top = MEGATRON_WIDTHS["dsa_indexer_topk"]
    while top >= seq:
        top //= 2
    return top


def _worker(rank: int, world: int, seq: int, loss_coeff: float) -> dict[str, Any]:
    """One rank: Megatron's CP step, hp_cp's, the same-kernel all-gather's."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(checkout_tests()))
    from megatron_model import build_gpt_model, init_parallel, make_batch, make_config
    from megatron_own_cp_check import megatron_step
    from megatron_shims import megatron_cpu_shims

    from hp_cp_core import DeepSeekV4CPConfig, disable_cp, enable_cp
    from hp_cp_torch.bench.memory import live_tensor_peak

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    with megatron_cpu_shims():
        from megatron.core import parallel_state
        from megatron.core.utils import get_batch_on_this_cp_rank

        init_parallel(world)
        widths = {**MEGATRON_WIDTHS, "dsa_indexer_topk": _topk(seq)}
        config = make_config(
            context_parallel_size=world,
            indexer_loss_coeff=loss_coeff,
            sparse_loss=True,
            **widths,
        )
        model = build_gpt_model(config, vocab_size=VOCAB, max_seq=seq)
        model.train()
        group = parallel_state.get_context_parallel_group()
        full = make_batch(1, seq, vocab_size=VOCAB)

        def measure(name: str, step: Any) -> None:
            model.zero_grad(set_to_none=True)
            dist.barrier(group)
            t0 = time.perf_counter()
            step()
            out[f"{name}_step_s"] = time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
            dist.barrier(group)
            out[f"{name}_peak_bytes"] = live_tensor_peak(step)
            model.zero_grad(set_to_none=True)

        local = get_batch_on_this_cp_rank(
            {k: (None if v is None else v.clone()) for k, v in full.items()},
            is_hybrid_cp=False,
            cp_group=group,
        )
        measure("megatron", lambda: megatron_step(model, local, config, world))

        cfg = DeepSeekV4CPConfig(layout="load_balanced")
        for name, p2p in (("hp_cp", True), ("allgather", False)):
            handle = enable_cp(model, group, cfg)
            handle.group.point_to_point = p2p  # the core's exchange: p2p or all-gather
            try:
                batch = handle.batch(full["tokens"])
                mask = (batch.labels != -100).to(torch.float32)
                hp = {
                    "tokens": batch.input_ids,
                    "position_ids": batch.position_ids,
                    "attention_mask": None,
                    "labels": torch.where(mask.bool(), batch.labels, 0),
                    "loss_mask": mask,
                }
                before = handle.stats()
                measure(name, lambda hp=hp: megatron_step(model, hp, config, world))
                after = handle.stats()
                # two steps ran (timed, profiled): half the bytes of the pair
                out[f"{name}_bytes_sent"] = (after["bytes_sent"] - before["bytes_sent"]) // 2
                out[f"{name}_bytes_recv"] = (after["bytes_recv"] - before["bytes_recv"]) // 2
            finally:
                disable_cp(handle)
    out["megatron_bytes_recv"] = megatron_allgather_bytes(
        seq, 1, world, MEGATRON_WIDTHS["num_layers"], loss_coeff > 0
    )
    out["topk"] = _topk(seq)
    return out


def megatron_measures(seq: int = 2048, cps: tuple[int, ...] = (2, 4)) -> dict[str, Any]:
    """The side-by-side keys (module docstring) at ``seq`` for each cp in ``cps``."""
    import importlib.util

    from hp_cp_torch.cli.launch import run_ranks

    if importlib.util.find_spec("megatron.core") is None:
        raise RuntimeError(
            "hp-cp bench --megatron needs megatron-core 0.19.2: pip install "
            "--ignore-requires-python megatron-core==0.19.2 (and triton, or the stub in "
            "tests/megatron/megatron_shims.py)"
        )
    res: dict[str, Any] = {"megatron_seq": seq}
    for cp in cps:
        t0 = time.perf_counter()
        ranks = run_ranks(cp, _worker, seq, 0.1, timeout=1800)
        res[f"megatron_topk_cp{cp}"] = ranks[0]["topk"]
        for side in ("megatron", "hp_cp", "allgather"):
            for measure in ("step_s", "peak_bytes", "bytes_recv"):
                values = [r.get(f"{side}_{measure}") for r in ranks]
                if all(v is not None for v in values):
                    res[f"megatron_{side}_{measure}_cp{cp}"] = max(values)
        for side in ("hp_cp", "allgather"):
            res[f"megatron_{side}_bytes_sent_cp{cp}"] = max(r[f"{side}_bytes_sent"] for r in ranks)
        for measure, key in (
            ("bytes", "bytes_recv"),
            ("step_time", "step_s"),
            ("peak_mem", "peak_bytes"),
        ):
            res[f"megatron_{measure}_cp{cp}_ratio"] = (
                res[f"megatron_hp_cp_{key}_cp{cp}"] / res[f"megatron_megatron_{key}_cp{cp}"]
            )
        res[f"megatron_peak_mem_vs_allgather_cp{cp}_ratio"] = (
            res[f"megatron_hp_cp_peak_bytes_cp{cp}"] / res[f"megatron_allgather_peak_bytes_cp{cp}"]
        )
        res[f"megatron_wall_cp{cp}_s"] = time.perf_counter() - t0
    return res


def main_megatron(args: Any) -> int:
    """``hp-cp bench --megatron``: the side-by-side keys, merged into ``--megatron-out``."""
    import json

    cps = tuple(int(v) for v in args.megatron_cps.split(",") if v)
    res = megatron_measures(args.megatron_seq, cps)
    path = os.path.abspath(args.megatron_out)
    old: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    old.update(res)
    with open(path, "w") as f:
        json.dump(old, f, indent=1, sort_keys=True)
    for key in sorted(res):
        value = res[key]
        print(f"{key:<48} {value:>14.6g}" if isinstance(value, float) else f"{key:<48} {value:>14}")
    print(f"wrote {path}")
    return 0

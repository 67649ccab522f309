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
``qk_head_dim`` 128, ``v_head_dim`` 128, indexer 32 heads x 128) with a small hidden size; the
sparse indexer loss on (``dsa_indexer_loss_coeff=0.1``). The attention heads, S, top-k and cp
are the cell's (:class:`Cell`): the default grid (:data:`GRID`) is heads {8, 32, 64} x S
{2048, 4096} x top-k {S / 8, S / 2} x cp {2, 4}, 24 cells, one job each; ``--megatron-cells``
takes ``quick`` (one tiny cell, a smoke run) or a list ``heads:S:topk:cp,...``. A cell whose
Megatron ranks would not fit the host together (:func:`megatron_peak_estimate`) runs hp_cp's
two sides only and is listed as skipped.

Measures, per cell (max over ranks):

* ``bytes``: bytes each rank receives, forward + backward (hp_cp: counted by its group;
  Megatron: what its all-gathers and reduce-scatters deliver to each rank, Note [Megatron's
  all-gather bytes]; received, not sent, because what a rank receives is the same for any
  all-gather algorithm);
* ``step_time``: seconds of the step (wall, each rank timed alone, this machine's cores
  shared by the ranks: a ratio within one run);
* ``peak_mem``: the most tensor bytes alive at once during the step (``live_tensor_peak``:
  torch's profiler, the CPU's ``max_memory_allocated``).

Keys ``megatron_<cell>_<measure>_ratio`` are hp_cp over Megatron (lower is better),
``megatron_<cell>_<measure>_vs_allgather_ratio`` hp_cp over the same-kernel all-gather
(``<cell>``: ``h<heads>_s<S>_k<topk>_cp<cp>``); ``megatron_worst_<measure>_ratio`` (and
``_cell``) the worst cell, the headline; ``megatron_<side>_over_24gib_cells`` the cells whose
busiest rank's peak (Megatron's estimated where it was skipped) exceeds 24 GiB;
``megatron_bench_wall_s`` the whole run.

Runs from a checkout on a CPU: Megatron's MLA + DSA need three CPU shims and a local-backend
spec, which are the test harness's (``tests/megatron/megatron_shims.py``,
``megatron_model.py``), never this library's. ``hp-cp bench --megatron`` (``--megatron-kernel
megatron`` runs hp_cp's sides with Megatron's own sparse attention on hp_cp's exchange).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hp_cp_core import HpCpError

__all__ = [
    "GRID",
    "MEGATRON_WIDTHS",
    "QUICK",
    "Cell",
    "megatron_allgather_bytes",
    "megatron_grid",
    "megatron_peak_estimate",
    "parse_cells",
]

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
32 x 128) with hidden size 512 (a CPU's scale); a :class:`Cell` sets the attention heads and
the top-k."""

VOCAB = 1024
ELEMENT_BYTES = 4  # fp32 on the CPU; bf16 halves both sides alike
GIB = 1 << 30
FIT_BYTES = 24 * GIB
"""The per-rank budget a cell is judged against (a 24 GiB accelerator)."""


@dataclass(frozen=True)
class Cell:
    """One point of the side by side: attention ``heads``, sequence ``seq``, ``topk``, ``cp``."""

    heads: int
    seq: int
    topk: int
    cp: int

    @property
    def name(self) -> str:
        """``h<heads>_s<seq>_k<topk>_cp<cp>``, the cell's part of its keys."""
        return f"h{self.heads}_s{self.seq}_k{self.topk}_cp{self.cp}"


GRID: tuple[Cell, ...] = tuple(
    Cell(heads, seq, seq // share, cp)
    for heads in (8, 32, 64)
    for seq in (2048, 4096)
    for share in (8, 2)
    for cp in (2, 4)
)
"""The default grid (24 cells): heads {8, 32, 64} x S {2048, 4096} x top-k {S / 8, S / 2} x
cp {2, 4}."""

QUICK: tuple[Cell, ...] = (Cell(4, 128, 32, 2),)
"""A smoke run (seconds): one tiny cell at cp 2."""


def parse_cells(text: str) -> tuple[Cell, ...]:
    """``--megatron-cells``: ``grid`` (:data:`GRID`), ``quick`` (:data:`QUICK`) or cells
    ``heads:S:topk:cp`` separated by commas (``8:2048:256:2,64:4096:2048:4``).

    Raises:
        HpCpError: a cell that is not four positive integers, or whose top-k is not below S
            or whose S is not a multiple of cp.
    """
    if text in ("grid", "quick"):
        return GRID if text == "grid" else QUICK
    cells = []
    for part in (p for p in text.split(",") if p.strip()):
        try:
            heads, seq, topk, cp = (int(v) for v in part.split(":"))
        except ValueError:
            heads = seq = topk = cp = 0
        if min(heads, seq, topk, cp) <= 0 or topk >= seq or seq % cp:
            raise HpCpError(
                f"--megatron-cells: {part!r} is not a cell; give heads:S:topk:cp (positive "
                "integers, top-k below S, S a multiple of cp), e.g. 8:2048:256:2, or 'grid' "
                "or 'quick'."
            )
        cells.append(Cell(heads, seq, topk, cp))
    if not cells:
        raise HpCpError("--megatron-cells: no cell given; e.g. 'grid', 'quick' or 8:2048:256:2.")
    return tuple(cells)


def megatron_peak_estimate(cell: Cell) -> int:
    """Megatron's per-rank peak bytes at ``cell``, estimated: its unfused path and indexer
    loss hold about ``55 + 7 heads`` dense fp32 ``[S / cp, S]`` planes (fitted to one-process
    steps of this model, 112, 259 and 512 planes at 8, 32 and 64 heads: 7146 MiB at S 4096,
    4142 and 8203 MiB at S 2048; 8 heads at cp 2 and 4, S 4096: 112 and 113). Used to skip
    Megatron's side of a cell whose ranks together would not fit the host."""
    planes = 55 + 7 * cell.heads
    return planes * (cell.seq // cell.cp) * cell.seq * ELEMENT_BYTES


def host_bytes() -> int:
    """The memory this host has available now (``MemAvailable``; 0 where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def checkout_tests() -> Path:
    """``tests/megatron`` of the checkout (the CPU harness the bench borrows): this source
    tree's, else the working directory's (an installed hp_cp_torch run from a checkout).

    Raises:
        HpCpError: neither has ``tests/megatron``.
    """
    for root in (Path(__file__).resolve().parents[4], Path.cwd()):
        if (root / "tests" / "megatron" / "megatron_model.py").is_file():
            return root / "tests" / "megatron"
    raise HpCpError(
        "hp-cp bench --megatron borrows the CPU harness of a checkout's tests/megatron; run "
        "it from the root of an hp_cp checkout."
    )


def megatron_allgather_bytes(seq: int, batch: int, cp: int, layers: int, loss: bool) -> int:
    """Bytes each rank receives in one step of Megatron's all-gather DSA CP (Note [Megatron's
    all-gather bytes]), :data:`MEGATRON_WIDTHS`, fp32."""
    w = MEGATRON_WIDTHS
    latent = w["kv_lora_rank"] + w["qk_pos_emb_head_dim"]
    index = w["dsa_indexer_head_dim"]
    shard_rows = seq // cp * batch
    per_layer = (cp - 1) * shard_rows * (2 * latent + (2 if loss else 1) * index)
    return per_layer * layers * ELEMENT_BYTES


def _worker(
    rank: int, world: int, cell: Cell, loss_coeff: float, with_megatron: bool, kernel: str | None
) -> dict[str, Any]:
    """One rank of ``cell``: Megatron's CP step (unless skipped), hp_cp's, the same-kernel
    all-gather's."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(checkout_tests()))
    from megatron_model import build_gpt_model, init_parallel, make_batch, make_config
    from megatron_own_cp_check import megatron_step
    from megatron_shims import megatron_cpu_shims

    from hp_cp_core import CPConfig, disable_cp, enable_cp
    from hp_cp_torch.bench.memory import live_tensor_peak

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    with megatron_cpu_shims():
        from megatron.core import parallel_state
        from megatron.core.utils import get_batch_on_this_cp_rank

        init_parallel(world)
        widths = {
            **MEGATRON_WIDTHS,
            "num_attention_heads": cell.heads,
            "dsa_indexer_topk": cell.topk,
        }
        config = make_config(
            context_parallel_size=world,
            indexer_loss_coeff=loss_coeff,
            sparse_loss=True,
            **widths,
        )
        model = build_gpt_model(config, vocab_size=VOCAB, max_seq=cell.seq)
        model.train()
        group = parallel_state.get_context_parallel_group()
        full = make_batch(1, cell.seq, vocab_size=VOCAB)

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

        if with_megatron:
            local = get_batch_on_this_cp_rank(
                {k: (None if v is None else v.clone()) for k, v in full.items()},
                is_hybrid_cp=False,
                cp_group=group,
            )
            measure("megatron", lambda: megatron_step(model, local, config, world))

        cfg = CPConfig(layout="load_balanced")
        if kernel is not None:
            cfg = CPConfig(layout="load_balanced", attention_kernel=kernel)
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
        cell.seq, 1, world, MEGATRON_WIDTHS["num_layers"], loss_coeff > 0
    )
    return out


SIDES = ("megatron", "hp_cp", "allgather")
MEASURES = ("step_s", "peak_bytes", "bytes_recv")
RATIOS = (("bytes", "bytes_recv"), ("step_time", "step_s"), ("peak_mem", "peak_bytes"))


def megatron_grid(
    cells: tuple[Cell, ...] = GRID,
    *,
    kernel: str | None = None,
    host: int | None = None,
    timeout: float = 3600,
) -> dict[str, Any]:
    """The side-by-side keys (module docstring) of every cell, and the headline: the worst
    cell of each ratio.

    Args:
        cells: the cells, run one job each, in order.
        kernel: hp_cp's ``attention_kernel`` (``None``: hp_cp's default).
        host: bytes the host may hold for one cell's ranks (default: its available memory);
            a cell whose Megatron side would not fit (:func:`megatron_peak_estimate` x cp)
            runs hp_cp's sides only, and says so.
        timeout: seconds one cell's job may run.
    """
    import importlib.util

    from hp_cp_torch.cli.launch import run_ranks

    if importlib.util.find_spec("megatron.core") is None:
        raise HpCpError(
            "hp-cp bench --megatron needs megatron-core 0.19.2: pip install "
            "--ignore-requires-python megatron-core==0.19.2 (and triton, or the stub in "
            "tests/megatron/megatron_shims.py)"
        )
    checkout_tests()  # refused here, not in every rank
    host = host_bytes() if host is None else host
    res: dict[str, Any] = {"megatron_cells": [c.name for c in cells]}
    wall = time.perf_counter()
    for cell in cells:
        key = f"megatron_{cell.name}"
        estimate = megatron_peak_estimate(cell)
        res[f"{key}_megatron_peak_estimate_bytes"] = estimate
        with_megatron = not host or estimate * cell.cp <= host
        t0 = time.perf_counter()
        ranks = run_ranks(cell.cp, _worker, cell, 0.1, with_megatron, kernel, timeout=timeout)
        res[f"{key}_wall_s"] = time.perf_counter() - t0
        for side in SIDES:
            for measure in MEASURES:
                values = [r.get(f"{side}_{measure}") for r in ranks]
                if all(v is not None for v in values):
                    res[f"{key}_{side}_{measure}"] = max(values)
        for side in ("hp_cp", "allgather"):
            res[f"{key}_{side}_bytes_sent"] = max(r[f"{side}_bytes_sent"] for r in ranks)
        for measure, field in RATIOS:
            for base, suffix in (("megatron", "ratio"), ("allgather", "vs_allgather_ratio")):
                if f"{key}_{base}_{field}" in res:
                    res[f"{key}_{measure}_{suffix}"] = (
                        res[f"{key}_hp_cp_{field}"] / res[f"{key}_{base}_{field}"]
                    )
        megatron_peak = res.get(f"{key}_megatron_peak_bytes", estimate)
        res[f"{key}_megatron_fits_24gib"] = megatron_peak <= FIT_BYTES
        res[f"{key}_hp_cp_fits_24gib"] = res[f"{key}_hp_cp_peak_bytes"] <= FIT_BYTES
        res[f"{key}_megatron_ran"] = with_megatron
    res["megatron_bench_wall_s"] = time.perf_counter() - wall
    res.update(_headline(res, cells))
    return res


def _headline(res: dict[str, Any], cells: tuple[Cell, ...]) -> dict[str, Any]:
    """``megatron_worst_<ratio>`` and ``megatron_worst_<ratio>_cell``: the largest of each
    ratio over the cells that have it (hp_cp's worst cell), and the cells that do not fit."""
    out: dict[str, Any] = {}
    for measure, _ in RATIOS:
        for suffix in ("ratio", "vs_allgather_ratio"):
            found = {
                c.name: res[f"megatron_{c.name}_{measure}_{suffix}"]
                for c in cells
                if f"megatron_{c.name}_{measure}_{suffix}" in res
            }
            if found:
                worst = max(found, key=found.get)
                out[f"megatron_worst_{measure}_{suffix}"] = found[worst]
                out[f"megatron_worst_{measure}_{suffix}_cell"] = worst
    for side in ("megatron", "hp_cp"):
        out[f"megatron_{side}_over_24gib_cells"] = [
            c.name for c in cells if not res[f"megatron_{c.name}_{side}_fits_24gib"]
        ]
    out["megatron_skipped_cells"] = [
        c.name for c in cells if not res[f"megatron_{c.name}_megatron_ran"]
    ]
    return out


def main_megatron(args: Any) -> int:
    """``hp-cp bench --megatron``: the side-by-side keys, merged into ``--megatron-out``."""
    import json

    cells = parse_cells(args.megatron_cells)
    host = None if args.megatron_host_gib is None else int(args.megatron_host_gib * GIB)
    res = megatron_grid(cells, kernel=args.megatron_kernel, host=host)
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
        print(f"{key:<64} {value:>14.6g}" if isinstance(value, float) else f"{key:<64} {value}")
    print(f"wrote {path}")
    return 0

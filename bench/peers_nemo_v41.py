"""hp_cp vs NeMo Automodel 0.7.0's own DeepSeek V4.1 CP (``deepseek_v41/cp.py``), both inside
NeMo's ``DeepseekV41ForCausalLM`` (gloo, CPU).

The model is the tests' tiny V4.1 (tests/nemo_automodel/nemo_v41_cases.py: sliding-window,
ratio 2 Full / Reuse / Reindex, ratio 1 Full with candidates / Reindex / Reuse, Engram, MoE,
mHC), fp32; same weights, inputs and machine; interleaved rounds (median). Bytes received per
training step (forward + backward, the gradient sum excluded on both sides) are counted by
wrapping torch.distributed's collectives (bench/peers_nemo.py's Counter), the same way for
both. Peak memory and the longest S under NeMo's budget (cp 4, real training steps): the
ladder of bench/peers_memory.py. Writes the ``nemo_v41_*`` keys of ``bench-peers.json``.

    TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=1 python bench/peers_nemo_v41.py
    HP_CP_PEERS_PARTS=compare|memory  HP_CP_PEERS_SEQ=2048  HP_CP_PEERS_ROUNDS=3
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [
    HERE,
    os.path.join(ROOT, "tests", "nemo_automodel"),
    os.path.join(ROOT, "tests", "torch"),
]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from peers_nemo import Counter  # noqa: E402

SEQ = int(os.environ.get("HP_CP_PEERS_SEQ", "2048"))
ROUNDS = int(os.environ.get("HP_CP_PEERS_ROUNDS", "3"))
LADDER = [int(s) for s in os.environ.get("HP_CP_PEERS_LADDER", "").split(",") if s] or list(
    range(2048, 8193, 512)
)


class _Mesh:
    """The calls NeMo's contiguous sharder makes on a DeviceMesh."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def size(self) -> int:
        return dist.get_world_size(self.group)

    def get_group(self) -> Any:
        return self.group

    def get_local_rank(self) -> int:
        return dist.get_rank(self.group)


def _step_nemo(model: Any, ids: torch.Tensor, group: Any) -> tuple[torch.Tensor, Any]:
    """NeMo's own V4.1 CP: its model-owned sharder (shard_cp_batch), then the forward."""
    import math

    from nemo_automodel.components.models.deepseek_v41.cp import shard_cp_batch

    from hp_cp_torch.integrations.nemo_automodel import cp_shift_labels

    text = model.config.text_config
    ratios = text.compress_ratios[: text.num_hidden_layers]
    shifted = cp_shift_labels(ids)
    batch = {"input_ids": ids.clone(), "labels": shifted.clone()}
    _, batch, _ = shard_cp_batch(
        _Mesh(group), None, batch, pad_multiple=math.lcm(*(r for r in ratios if r))
    )
    labels = batch.pop("labels")
    logits = model(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        attention_mask=batch["attention_mask"],
        cp_group=batch["cp_group"],
    ).logits
    n = (shifted != -100).sum()
    loss = (
        F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        / n
    )
    loss.backward()
    return logits, None


def _step_ours(model: Any, ids: torch.Tensor, handle: Any) -> tuple[torch.Tensor, Any]:
    from hp_cp_torch.integrations.nemo_automodel import cp_causal_lm_loss, cp_nemo_batch

    batch = cp_nemo_batch(handle, ids)
    labels, n = batch.pop("labels"), batch.pop("n_tokens")
    logits = model(**batch).logits
    cp_causal_lm_loss(logits, labels, n).backward()
    return logits, handle


def _full(logits: torch.Tensor, group: Any, handle: Any, seq: int) -> torch.Tensor:
    if handle is not None:
        return handle.unshard(logits.detach().float(), 1, rows=seq)
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.detach().contiguous(), group=group)
    return torch.cat(parts, 1)[:, :seq].float()


def compare_job(rank: int, world: int) -> dict[str, Any]:
    """Bytes, step time (interleaved rounds) and error vs one process, both sides."""
    import nemo_v41_cases as cases

    from hp_cp_core import disable_cp, enable_cp

    counter = Counter()
    counter.install()
    group = dist.group.WORLD
    base = cases.build_model(0)
    ids = cases.make_ids(SEQ)
    ref = None
    if rank == 0:
        with torch.no_grad():
            ref = cases.copy.deepcopy(base)(ids).logits.detach().float()
    nemo_model = cases.copy.deepcopy(base)
    ours_model = cases.copy.deepcopy(base)
    handle = enable_cp(ours_model, group)
    times: dict[str, list[float]] = {"nemo": [], "ours": []}
    bytes_: dict[str, int] = {}
    logits: dict[str, torch.Tensor] = {}
    for r in range(ROUNDS + 1):
        for side in ("nemo", "ours"):
            model = nemo_model if side == "nemo" else ours_model
            model.zero_grad(set_to_none=True)
            dist.barrier()
            counter.bytes, counter.on = 0, True
            t0 = time.perf_counter()
            if side == "nemo":
                out, h = _step_nemo(model, ids, group)
            else:
                out, h = _step_ours(model, ids, handle)
            elapsed = time.perf_counter() - t0
            counter.on = False
            if r == 0:
                bytes_[side] = counter.bytes
                logits[side] = _full(out, group, h, SEQ)
            else:
                times[side].append(elapsed)
    slot_calls = handle.group.calls.get("slot_exchange", 0)
    disable_cp(handle)
    errs = {}
    if rank == 0:
        scale = float(ref.abs().max())
        errs = {s: float((logits[s] - ref).abs().max()) / scale for s in logits}
    return {
        "rank": rank,
        "bytes": bytes_,
        "time": {s: statistics.median(v) for s, v in times.items()},
        "err": errs,
        "slot_exchanges_per_forward": slot_calls / (ROUNDS + 1),
    }


def memory_job(rank: int, world: int, side: str, budget: int | None) -> dict[str, Any]:
    """One side's peak memory per S of the ladder (bench/peers_memory.py)."""
    import nemo_v41_cases as cases
    from peers_memory import ladder_peaks

    from hp_cp_core import enable_cp

    group = dist.group.WORLD
    model = cases.build_model(0)
    handle = enable_cp(model, group) if side == "ours" else None

    def step(seq: int) -> None:
        model.zero_grad(set_to_none=True)
        ids = cases.make_ids(seq)
        _step_nemo(model, ids, group) if side == "nemo" else _step_ours(model, ids, handle)
        model.zero_grad(set_to_none=True)

    return {"rank": rank, "peaks": ladder_peaks(step, LADDER, budget, group)}


def main() -> None:
    from dist_utils import run_ranks
    from peers_memory import max_seq_summary

    out: dict[str, Any] = {}
    parts = os.environ.get("HP_CP_PEERS_PARTS", "compare,memory").split(",")
    for cp in (2, 4) if "compare" in parts else ():
        ranks = run_ranks(cp, compare_job, timeout=3600)
        busiest = {s: max(r["bytes"][s] for r in ranks) for s in ("nemo", "ours")}
        step = {s: max(r["time"][s] for r in ranks) for s in ("nemo", "ours")}
        sfx = f"_cp{cp}"
        out["nemo_v41_busiest_rank_bytes_over_ours" + sfx] = busiest["nemo"] / max(
            busiest["ours"], 1
        )
        out["nemo_v41_busiest_rank_bytes" + sfx] = busiest["nemo"]
        out["ours_busiest_rank_bytes_vs_nemo_v41" + sfx] = busiest["ours"]
        out["nemo_v41_step_time_over_ours" + sfx] = step["nemo"] / step["ours"]
        out["nemo_v41_step_time_s" + sfx] = step["nemo"]
        out["ours_step_time_s_vs_nemo_v41" + sfx] = step["ours"]
        out["nemo_v41_max_rel_err" + sfx] = ranks[0]["err"]["nemo"]
        out["ours_max_rel_err_vs_nemo_v41" + sfx] = ranks[0]["err"]["ours"]
        out["ours_slot_exchanges_per_forward_v41" + sfx] = ranks[0]["slot_exchanges_per_forward"]
    if "memory" in parts:
        nemo_peaks = run_ranks(4, memory_job, "nemo", None, timeout=3600)[0]["peaks"]
        ours_peaks = run_ranks(4, memory_job, "ours", nemo_peaks[LADDER[0]], timeout=3600)[0][
            "peaks"
        ]
        out["nemo_v41_peak_mem_over_ours"] = nemo_peaks[LADDER[0]] / ours_peaks[LADDER[0]]
        out["nemo_v41_peak_mem_seq"] = LADDER[0]
        out.update(max_seq_summary("nemo_v41", nemo_peaks, ours_peaks))
    out["nemo_v41_bench_setup"] = (
        "tiny NeMo DeepseekV41ForCausalLM (7 layers: sliding; ratio 2 Full/Reuse/Reindex; "
        "ratio 1 Full+candidates/Reindex/Reuse; Engram; MoE; mHC), fp32, sdpa, gloo CPU, "
        f"S={SEQ}, median of {ROUNDS} interleaved rounds, one process per rank"
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

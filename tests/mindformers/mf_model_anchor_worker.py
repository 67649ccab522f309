"""msrun worker of ``nox -s bench_mindformers`` (``--model``): hp_cp side by side with MindFormers'
own CP on the WHOLE real mindformers 2.1.0 ``PyNativeDeepseekV4ForCausalLM`` (tiny,
``mf_real_model``, no MTP), the same weights, input and msrun world (cp = world size).

MindFormers' own CP is put on the model as its ``parallelize_gptmodel`` does for a CSA block
(``_apply_cp_to_block``: ``DSv4HybridAttentionContextParallel(cp_mesh)._apply(self_attention)``
on every decoder layer: the parent's RoPE at ``cp_rank * L`` and
``CompressedSparseAttentionContextParallel`` on the core), with a minimal stand-in mesh. Its
input: contiguous, padded (no ``actual_seq_len``), local rows a multiple of every r (128), so
S = 128 * cp. Every rank runs the model on one device (the reference: loss, every parameter
gradient), then hp_cp and then the anchor: one warm-up and ``HP_CP_BENCH_ITERS`` timed training
steps each (forward + backward), the bytes this rank received (the same CPU collective model
for both), and the loss and gradient errors against one device (gradients summed over the
ranks). Writes ``<outdir>/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mf_real_env as env  # noqa: E402  (stubs, CPU stand-ins, the real classes)

if env.SKIP_REASON or env.IMPORT_ERROR:
    raise SystemExit(
        f"the real mindformers model cannot run: {env.SKIP_REASON or env.IMPORT_ERROR}"
    )

import mf_real_model as mdl  # noqa: E402
import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
from mindformers.pynative.distributed import csa_context_parallel as anchor_module  # noqa: E402
from mindspore import Tensor, ops  # noqa: E402
from mindspore.communication import GlobalComm, get_group_size, get_rank, init  # noqa: E402

from hp_cp_core import DeepSeekV4CPConfig, disable_cp, enable_cp  # noqa: E402

init()
RANK, WORLD = get_rank(), get_group_size()
GROUP = GlobalComm.WORLD_COMM_GROUP
ITERS = int(os.environ.get("HP_CP_BENCH_ITERS", "1"))


def all_reduce(values: np.ndarray) -> np.ndarray:
    return ops.AllReduce(ops.ReduceOp.SUM, group=GROUP)(Tensor(values)).asnumpy()


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-30))


class CountingGather:
    """Wraps the anchor's only collective (``_ag_seq``, a CP all-gather) to count the bytes this
    rank receives, forward and backward, with the model hp_cp's MindSporeGroup counts with."""

    def __init__(self, inner, world: int) -> None:
        self.inner, self.world, self.bytes_recv = inner, world, 0

    def __call__(self, tensor: Tensor, group: str) -> Tensor:
        n = int(np.prod(tensor.shape)) * 4
        self.bytes_recv += (self.world - 1) * n + 2 * (self.world - 1) * n
        return self.inner(tensor, group)


def apply_anchor(model) -> int:
    """MindFormers' own CP on every CSA block, as ``_apply_cp_to_block`` does."""
    mesh = env.FixedMesh(WORLD, RANK, GROUP)
    blocks = 0
    for layer in model.model.decoder.layers:
        if isinstance(layer.self_attention.core_attention, env.mf_csa.CompressedSparseAttention):
            anchor_module.DSv4HybridAttentionContextParallel(mesh)._apply(
                layer.self_attention, mesh
            )
            blocks += 1
    return blocks


def timed(model, ids, labels, mask, total, bytes_now) -> dict:
    mdl.loss_and_grads(model, ids, labels, mask, total_tokens=total)  # warm-up (plans, caches)
    before = bytes_now()
    all_reduce(np.zeros(1, np.float32))  # start together
    t0 = time.perf_counter()
    for _ in range(ITERS):
        loss, grads = mdl.loss_and_grads(model, ids, labels, mask, total_tokens=total)
    ms.runtime.synchronize()
    seconds = (time.perf_counter() - t0) / ITERS
    return {"loss": loss, "grads": grads, "seconds": seconds, "bytes": bytes_now() - before}


def compare(got: dict, ref: dict) -> dict:
    names = sorted(ref["grads"])
    flat = np.concatenate([got["grads"][k].reshape(-1) for k in names] + [np.array([got["loss"]])])
    total = all_reduce(flat.astype(np.float32))
    scale = max(float(np.abs(g).max()) for g in ref["grads"].values())
    at, errs, scaled = 0, {}, {}
    for k in names:
        n = ref["grads"][k].size
        got_k = total[at : at + n].reshape(ref["grads"][k].shape)
        errs[k] = rel(got_k, ref["grads"][k])
        scaled[k] = float(np.abs(got_k - ref["grads"][k]).max()) / scale
        at += n
    # a gradient ~0 on one device (a saturated hyper-connection gate) is fp32 noise relative
    # to itself: those compare by their error over the model's largest gradient
    tiny = {k for k, g in ref["grads"].items() if float(np.abs(g).max()) < 1e-6 * scale}
    indexer = [e for k, e in errs.items() if ".indexer." in k]
    return {
        "seconds": got["seconds"],
        "bytes_recv": got["bytes"] // ITERS,
        "loss_rel_err": abs(float(total[-1]) - ref["loss"]) / abs(ref["loss"]),
        "max_grad_rel_err": max(errs.values()),
        "max_grad_rel_err_indexer_params": max(indexer) if indexer else 0.0,
        "max_grad_rel_err_other": max(e for k, e in errs.items() if ".indexer." not in k),
        "worst_param": max(errs, key=errs.get),
        "max_grad_err_over_model_scale": max(scaled.values()),
        "max_grad_rel_err_not_tiny": max(e for k, e in errs.items() if k not in tiny),
        "tiny_grads": sorted(tiny),
    }


def main() -> None:
    out_dir = sys.argv[1]
    seq = 128 * WORLD
    report: dict = {"rank": RANK, "world": WORLD, "seq": seq, "local_rows": seq // WORLD}
    path = os.path.join(out_dir, f"rank{RANK}.json")
    try:
        model = mdl.tiny_model(mtp=0, seed=9)
        ids, labels = mdl.sample(seq, seed=2)
        mask = np.ones(ids.shape, np.float32)
        total = float(mask.sum())
        t0 = time.perf_counter()
        loss, grads = mdl.loss_and_grads(model, ids, labels, mask, total_tokens=total)
        ref = {"loss": loss, "grads": grads, "seconds": time.perf_counter() - t0}
        report["one_device_seconds"] = ref["seconds"]
        lo, hi = RANK * seq // WORLD, (RANK + 1) * seq // WORLD
        local = (ids[:, lo:hi], labels[:, lo:hi], mask[:, lo:hi])

        handle = enable_cp(model, GROUP, DeepSeekV4CPConfig(layout="contiguous"))
        ours = timed(model, *local, total, lambda: handle.stats()["bytes_recv"])
        disable_cp(handle)
        report["ours"] = compare(ours, ref)

        report["anchor_blocks"] = apply_anchor(model)
        counter = CountingGather(anchor_module._ag_seq, WORLD)
        anchor_module._ag_seq = counter
        try:
            anchor = timed(model, *local, total, lambda: counter.bytes_recv)
        finally:
            anchor_module._ag_seq = counter.inner
        report["anchor"] = compare(anchor, ref)
    except Exception as exc:  # noqa: BLE001 - reported to the driver
        report["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        report["traceback"] = traceback.format_exc()[-4000:]
    with open(path, "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()

"""Train mindformers' pynative DeepSeek V4 model (``PyNativeDeepseekV4ForCausalLM``) with context
parallelism (hp_cp) under ``msrun``: every rank is one CP rank of the world group, holds the
whole (replicated) model and its share of each packed sequence; the parameter gradients are
summed over the CP ranks (AllReduce) and every rank takes the same optimizer step::

    msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --join=True \\
        examples/train_mindformers_cp.py --steps 2 --save ckpt
    msrun --worker_num=4 --local_worker_num=4 --master_port=8118 --join=True \\
        examples/train_mindformers_cp.py --steps 3 --resume ckpt

Without ``msrun`` it trains on one process (no CP): the run to compare with. ``--save DIR``
writes a MindSpore checkpoint (model parameters, the optimizer's momenta, the step) and
``--resume DIR`` continues from one, on any CP size: CP leaves the parameters untouched.
``--losses FILE`` appends ``{"step": loss}``; ``--expect FILE`` fails unless this run's losses
equal that file's (relative 1e-4) on the steps both have.

The model is tiny (3 layers: sliding window, CSA r = 4 with its indexer, HCA r = 128; one
MTP layer; MoE with an expert bias, hyper-connections; fp32; ``--config model.json`` overrides any
``DeepseekV4Config`` field) and the data are synthetic packed token streams of two documents.
On Ascend it runs as is. On CPU MindSpore 2.10 lacks some kernels the model calls (the MoE's
``GroupedMatmul``, ``histc``, ...) and mindformers 2.1.0 imports ``hyper_parallel`` (not on
PyPI): ``--cpu-standins tests/mindformers`` loads this repository's test stand-ins for them
(``mf_real_env``). Needs ``mindspore==2.10.0``, ``mindformers==2.1.0``, ``hp-cp-core`` and
``hp-cp-mindformers``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

MODEL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_nextn_predict_layers": 1,  # one MTP layer: its token shift runs across the CP ranks
    "num_attention_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "head_dim": 32,
    "v_head_dim": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "o_lora_rank": 16,
    "o_groups": 2,
    "index_n_heads": 4,
    "index_head_dim": 16,
    "index_topk": 4,
    "num_hash_layers": 0,
    "compress_ratios": [0, 4, 128, 0],  # sliding window, CSA, HCA; the MTP layer's: window
    "sliding_window": 8,
    "max_position_embeddings": 4096,
    "compute_dtype": "fp32",
    "params_dtype": "fp32",
    "use_flash_attention": False,
    "apply_dsa_kernel_fusion": False,
    "moe_grouped_gemm": True,
    "moe_permute_fusion": True,
    "calculate_per_token_loss": True,  # the summed loss: each rank divides by the GLOBAL count
    "dsa_indexer_loss_coeff": 0.5,
    "mtp_loss_scaling_factor": 0.3,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="train up to this step (resume counts)")
    p.add_argument("--seq-len", type=int, default=136, help="tokens per packed stream")
    p.add_argument("--layout", default="load_balanced", choices=["contiguous", "load_balanced"])
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", help="a JSON file of DeepseekV4Config fields to override")
    p.add_argument("--save", help="write a checkpoint to this directory at the end")
    p.add_argument("--resume", help="start from the checkpoint in this directory")
    p.add_argument("--losses", help="append this run's per-step losses to this JSON file")
    p.add_argument("--expect", help="fail unless the losses equal this JSON file's")
    p.add_argument("--cpu-standins", help="directory of mf_real_env.py (CPU runs)")
    return p.parse_args()


def setup(args: argparse.Namespace) -> tuple[Any, int, int]:
    """MindSpore in PyNative mode (CPU with the stand-ins), communication under msrun; returns
    ``(group or None, rank, size)``."""
    if args.cpu_standins:
        sys.path.insert(0, os.path.abspath(args.cpu_standins))
        import mf_real_env  # noqa: F401  (CPU context, stubs, stand-ins)
    import mindspore as ms

    ms.set_context(mode=ms.PYNATIVE_MODE)
    if "MS_WORKER_NUM" not in os.environ:  # not under msrun: one process, no CP
        return None, 0, 1
    from mindspore.communication import GlobalComm, get_group_size, get_rank, init

    init()
    return GlobalComm.WORLD_COMM_GROUP, get_rank(), get_group_size()


def build_model(args: argparse.Namespace) -> Any:
    from mindformers.models.deepseek4.configuration_deepseek_v4 import DeepseekV4Config
    from mindformers.models.deepseek4.modeling_deepseek_v4_pynative import (
        PyNativeDeepseekV4ForCausalLM,
    )
    from mindspore import Tensor

    fields = dict(MODEL, seq_length=args.seq_len)
    if args.config:
        with open(args.config) as fh:
            fields.update(json.load(fh))
    model = PyNativeDeepseekV4ForCausalLM(DeepseekV4Config(**fields))
    rng = np.random.default_rng(args.seed)  # the same weights on every rank
    trainable = {p.name for p in model.trainable_params()}
    for p in sorted(model.get_parameters(), key=lambda p: p.name):
        shape = tuple(p.shape)
        if p.name not in trainable:  # RMS gains 1; expert bias and token counts 0
            value = np.ones(shape) if "rms" in p.name else np.zeros(shape)
        elif "norm" in p.name or p.name.endswith("hc_scale"):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = 0.2 * rng.standard_normal(shape)
        p.set_data(Tensor(value.astype(np.float32)))
    model.set_train(True)
    return model


def batch(step: int, seq: int, vocab: int) -> dict[str, np.ndarray]:
    """Step ``step``'s packed stream: two documents, next-token labels, the GLOBAL document
    ends (``actual_seq_len``)."""
    rng = np.random.default_rng(1000 + step)
    ids = rng.integers(1, vocab, (1, seq)).astype(np.int32)
    cut = int(rng.integers(seq // 4, 3 * seq // 4))
    return {
        "ids": ids,
        "labels": np.roll(ids, -1, axis=1),
        "mask": np.ones((1, seq), np.float32),
        "ends": np.array([cut, seq], np.int64),
    }


def save(model: Any, optimizer: Any, step: int, path: str, rank: int) -> None:
    import mindspore as ms

    if rank == 0:  # every rank holds the same parameters
        os.makedirs(path, exist_ok=True)
        ms.save_checkpoint(model, os.path.join(path, "model.ckpt"))
        ms.save_checkpoint(optimizer, os.path.join(path, "optimizer.ckpt"))
        with open(os.path.join(path, "step.json"), "w") as fh:
            json.dump({"step": step}, fh)


def resume(model: Any, optimizer: Any, path: str) -> int:
    import mindspore as ms

    ms.load_param_into_net(model, ms.load_checkpoint(os.path.join(path, "model.ckpt")))
    ms.load_param_into_net(optimizer, ms.load_checkpoint(os.path.join(path, "optimizer.ckpt")))
    with open(os.path.join(path, "step.json")) as fh:
        return int(json.load(fh)["step"])


def main() -> None:
    args = parse_args()
    group, rank, size = setup(args)
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    from hp_cp_core import CPConfig, disable_cp, enable_cp

    model = build_model(args)
    params = model.trainable_params()
    optimizer = nn.Momentum(params, learning_rate=args.lr, momentum=0.9)
    start = resume(model, optimizer, args.resume) if args.resume else 0
    handle = None
    if group is not None:
        handle = enable_cp(model, group, CPConfig(layout=args.layout))
    vocab = int(model.config.vocab_size)
    no_mask = Tensor(np.zeros((1, 1, 1, 1), np.uint8))  # the hybrid attention ignores it
    losses: dict[int, float] = {}
    for step in range(start + 1, args.steps + 1):
        b = batch(step, args.seq_len, vocab)
        total_tokens = float(b["mask"].sum())
        ends = b["ends"]
        if handle is not None:  # this rank's rows; the ends stay GLOBAL
            pad = handle.padding(args.seq_len)
            ends = pad.cu_seqlens(np.concatenate([[0], ends]))[1:]
            b = {k: handle.shard(b[k], 1, pad_value=0) for k in ("ids", "labels", "mask")}

        def loss_fn(ids, labels, mask, ends=ends, total_tokens=total_tokens):
            numerator, _ = model(
                input_ids=ids,
                labels=labels,
                loss_mask=mask,
                attention_mask=no_mask,
                actual_seq_len=Tensor(ends.astype(np.int32)),
            )
            return numerator / total_tokens  # this rank's share of the global mean

        t0 = time.perf_counter()
        loss, grads = ms.value_and_grad(loss_fn, None, params)(
            Tensor(b["ids"]), Tensor(b["labels"]), Tensor(b["mask"])
        )
        if group is not None:  # sum the ranks' shares (the parameters are replicated)
            reduce = ops.AllReduce(ops.ReduceOp.SUM, group=group)
            grads = tuple(reduce(g) for g in grads)
            loss = reduce(loss)
        optimizer(grads)
        model._update_expert_bias(group, size)  # token counts summed over the CP ranks
        model.reset_model_temporary_tensors()
        losses[step] = float(loss.asnumpy())
        if rank == 0:
            print(
                f"step {step} loss {losses[step]:.6f} cp {size} ({time.perf_counter() - t0:.2f} s)",
                flush=True,
            )
    if handle is not None:
        disable_cp(handle)  # the model as it was built: its checkpoint loads at any CP size
    if args.save:
        save(model, optimizer, args.steps, args.save, rank)
    if rank == 0 and args.losses:
        old = {}
        if os.path.exists(args.losses):
            with open(args.losses) as fh:
                old = json.load(fh)
        old.update({str(k): v for k, v in losses.items()})
        with open(args.losses, "w") as fh:
            json.dump(old, fh, indent=1)
    if args.expect:
        with open(args.expect) as fh:
            want = {int(k): v for k, v in json.load(fh).items()}
        both = sorted(set(want) & set(losses))
        bad = [s for s in both if abs(losses[s] - want[s]) > 1e-4 * abs(want[s])]
        if not both or bad:
            raise SystemExit(
                f"losses differ from {args.expect} at steps {bad or 'none shared'}: "
                f"{ {s: (losses[s], want[s]) for s in bad or losses} }"
            )
        if rank == 0:
            print(f"losses equal {args.expect} at steps {both}", flush=True)


if __name__ == "__main__":
    main()

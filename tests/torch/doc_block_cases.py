"""The torch pages' code blocks (``<!-- tested: NAME -->``), run on gloo ranks: each block is
read from its page (``tests/doc_blocks.py``) and executed with what the page says the reader
has (a tiny model, the CP process group, a batch), then checked against the same model on one
process. One spawned job runs them all (``tests/torch/test_torch_doc_blocks.py``); a block
that fails reports its traceback and the others still run."""

from __future__ import annotations

import ast
import copy
import runpy
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
CASES: dict[str, Callable[[], Any]] = {}


docs = SimpleNamespace(**runpy.run_path(str(ROOT / "tests" / "doc_blocks.py")))


def case(*names: str):
    def register(fn):
        CASES[" + ".join(names)] = fn
        return fn

    return register


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-12)
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


def _group() -> Any:
    return dist.group.WORLD


# ------------------------------------------------------------------ the quick starts


def _reference_layer(r: int = 4, window: int = 8) -> Any:
    from cases import layer_config

    from hp_cp_torch.reference import DeepSeekV4Attention

    torch.manual_seed(0)
    return DeepSeekV4Attention(layer_config(r, window))


def _layer_inputs(seq: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(1, seq, 32, generator=gen), torch.arange(seq)[None]


@case("readme-quickstart", "design-quickstart")
def quick_starts() -> None:
    """The README's and the design note's first example: a layer under CP, its output
    unsharded equals the layer on one process, ``disable_cp`` restores its forward."""
    x, position_ids = _layer_inputs()
    for name in ("readme-quickstart", "design-quickstart"):
        model = _reference_layer()
        forward = model.forward
        want = model(x, position_ids=position_ids)
        mesh = _group()
        ns = docs.run(
            name,
            {"model": model, "mesh": mesh, "x": x, "input_ids": x} | {"position_ids": position_ids},
        )
        full = ns["full"] if "full" in ns else ns["handle"].unshard(ns["out"], 1)
        _close(full, want)
        assert model.forward == forward, name


# -------------------------------------------------------------- Hugging Face models


def _hf_model(seed: int = 0) -> Any:
    from hp_cp_torch.cli.parity import build_tiny_model

    return build_tiny_model(seed)


def _hf_batch(vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(2))


def _reference_grads(model: Any, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    ref = copy.deepcopy(model)
    ref(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
    return {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def _summed_grads_equal(model: Any, want: dict[str, torch.Tensor], summed: bool) -> None:
    checked = 0
    for name, p in model.named_parameters():
        if name not in want or p.grad is None:
            continue
        grad = p.grad.clone()
        if not summed:
            dist.all_reduce(grad)
        scale = want[name].abs().max().item()
        if scale > 1e-6:
            _close(grad, want[name], 1e-4)
            checked += 1
    assert checked > 10, checked


@case("readme-hf-batch")
def readme_hf() -> None:
    """``handle.batch`` and ``cp_causal_lm_loss``: the ranks' gradients sum to the model's
    on one process."""
    model, input_ids = _hf_model(), _hf_batch()
    want = _reference_grads(model, input_ids)
    ns = docs.run("readme-hf-batch", {"model": model, "cp_group": _group(), "input_ids": input_ids})
    _summed_grads_equal(model, want, summed=False)
    from hp_cp_core import disable_cp

    disable_cp(ns["handle"])


@case("hf-training-step")
def hf_training_step() -> None:
    """docs/huggingface.md's step by hand: after ``cp_sum_gradients`` every rank holds the
    one-process gradients."""
    model, input_ids = _hf_model(), _hf_batch()
    want = _reference_grads(model, input_ids)
    ns = docs.run(
        "hf-training-step",
        {"model": model, "cp_group": _group(), "input_ids": input_ids, "labels": input_ids},
    )
    _summed_grads_equal(model, want, summed=True)
    from hp_cp_core import disable_cp

    disable_cp(ns["handle"])


@case("regather-stats")
def regather_stats() -> None:
    """One re-gather per CSA / HCA layer backward (the tiny model has one of each)."""
    from hp_cp_core import disable_cp
    from hp_cp_torch.integrations.transformers import cp_causal_lm_loss

    model, input_ids = _hf_model(), _hf_batch()

    def train_step(model, handle):
        batch = handle.batch(input_ids)
        out = model(**batch.model_inputs(), use_cache=False)
        cp_causal_lm_loss(out.logits, batch.labels, batch.n_tokens).backward()

    ns = docs.run("regather-stats", {"model": model, "mesh": _group(), "train_step": train_step})
    stats = ns["handle"].stats()
    assert stats["collectives"]["slot_exchange_regather"] == 2, stats["collectives"]
    assert "regather_saved_views" in stats
    disable_cp(ns["handle"])


@case("train-fsdp-loop")
def train_fsdp_loop() -> None:
    """The recipe's mesh, FSDP2 and loss (dp 1 x cp 2 here): the loss share's gradients,
    reduced by FSDP, are the one-process gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hp_cp_core import CPConfig, disable_cp, enable_cp
    from hp_cp_torch.integrations.transformers import cp_causal_lm_loss

    model, input_ids = _hf_model(), _hf_batch()
    ref = copy.deepcopy(model)
    want = ref(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    ns = docs.run(
        "train-fsdp-loop",
        {"model": model, "dp": 1, "cp": 2, "input_ids": input_ids, "dist": dist}
        | {"init_device_mesh": init_device_mesh, "fully_shard": fully_shard}
        | {"enable_cp": enable_cp, "CPConfig": CPConfig, "cp_causal_lm_loss": cp_causal_lm_loss},
    )
    share = ns["share"].detach().clone()
    dist.all_reduce(share)
    _close(share, want.detach())
    disable_cp(ns["handle"])


# ------------------------------------------------------------ the example model packages


@case("model-adapter-register", "model-example-run")
def model_example() -> None:
    from hp_cp_model_example.adapter import PooledAttentionAdapter
    from hp_cp_model_example.model import PooledAttention, PooledStack

    from hp_cp_core import CPConfig, disable_cp, enable_cp

    gen = torch.Generator().manual_seed(3)
    x, pos = torch.randn(1, 384, 32, generator=gen), torch.arange(384)[None]
    torch.manual_seed(0)
    model = PooledStack()
    ns = docs.run(
        "model-adapter-register",
        {"PooledAttention": PooledAttention, "PooledAttentionAdapter": PooledAttentionAdapter}
        | {"model": model, "mesh": _group(), "enable_cp": enable_cp, "CPConfig": CPConfig},
    )
    try:
        out = model(ns["handle"].shard(x, 1), pos=ns["handle"].shard(pos, 1))
        assert out.shape == (1, 192, 32), out.shape
    finally:
        disable_cp(ns["handle"])
        ns["unregister_model_adapter"](PooledAttention)

    torch.manual_seed(0)
    packed_want = PooledStack()(x, doc_bounds=torch.tensor([0, 5, 130, 384]))
    torch.manual_seed(0)  # the block builds its PooledStack() with these weights
    ns = docs.run("model-example-run", {"mesh": _group(), "x": x, "pos": pos, "torch": torch})
    _close(ns["full"], packed_want)


@case("dsa-example-run")
def dsa_example() -> None:
    """The DSA example's training step under CP: its loss share sums to the one-process
    loss (the indexer loss riding along)."""
    from hp_cp_dsa_example.model import SparseLlama

    torch.manual_seed(0)
    vocab = SparseLlama().embed.num_embeddings
    input_ids = torch.randint(0, vocab, (1, 64), generator=torch.Generator().manual_seed(4))
    cu = torch.tensor([0, 20, 64])
    torch.manual_seed(0)
    ns = docs.run("dsa-example-run", {"mesh": _group(), "input_ids": input_ids, "cu": cu})
    share = ns["loss"].detach().clone()
    dist.all_reduce(share)
    assert torch.isfinite(share), share


@case("glm5-sharing")
def glm5_sharing() -> None:
    """The printed ``describe()`` of a GLM-5 model (one full layer, two shared after it)."""
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "torch"))
    from dsa_cases import build_dsa_model

    from hp_cp_core import CPConfig, disable_cp, enable_cp

    handle = enable_cp(build_dsa_model("glm_moe_dsa"), _group(), CPConfig())
    try:
        prompt, shown = docs.block("glm5-sharing").split("\n", 1)
        assert prompt.startswith(">>> ")
        got = eval(prompt[4:], {"handle": handle})  # noqa: S307 - the page's expression
        assert got == ast.literal_eval(shown), got
    finally:
        disable_cp(handle)


@case("reliability-errors")
def reliability_errors() -> None:
    """The two errors the page prints, raised on both ranks: a dtype on rank 1 only, and
    ranks given different ``cu_seqlens``. Each shown line (up to ``...``) starts the message."""
    from hp_cp_core import CPConfig, HpCpError, disable_cp, enable_cp

    shown: list[str] = []
    for line in docs.block("reliability-errors").splitlines():
        if line.startswith("CP "):
            shown.append(line)
        else:
            shown[-1] += " " + line
    shown = [" ".join(text.split()).split(" ...")[0] for text in shown]
    layer = _reference_layer()
    handle = enable_cp(layer, _group(), CPConfig())
    rank = dist.get_rank()
    x = torch.randn(1, 8, 32)
    messages = []
    try:
        for run in (
            lambda: layer(x.double() if rank == 1 else x, position_ids=torch.arange(8)[None]),
            lambda: layer(x, cu_seqlens=torch.tensor([0, 5 + rank, 16])),
        ):
            try:
                run()
            except HpCpError as exc:
                messages.append(" ".join(str(exc).split()))
            else:
                raise AssertionError("no HpCpError")
    finally:
        disable_cp(handle)
    for want, got in zip(shown, messages, strict=True):
        assert got.startswith(want.rstrip(".")), (want, got)


# ---------------------------------------------------------------- overriding a stage


@case("triton-kernel-config", "triton-plugin", "triton-plugin-host")
def triton_override() -> None:
    """The Triton kernel by name, and the page's plugin taking the attention stage of a
    reference layer without an indexer (Triton's interpreter on CPU): equal to one process."""
    from hp_cp_core import CPConfig, disable_cp, enable_cp, hookimpl
    from hp_cp_core.plugins import get_plugin_host

    x, position_ids = _layer_inputs()
    model = _reference_layer(r=128)
    want = model(x, position_ids=position_ids)
    ns = docs.run(
        "triton-kernel-config",
        {"model": model, "mesh": _group()} | {"enable_cp": enable_cp, "CPConfig": CPConfig},
    )
    handle = ns["handle"]
    _close(
        handle.unshard(model(handle.shard(x, 1), position_ids=handle.shard(position_ids, 1)), 1),
        want,
    )
    disable_cp(handle)

    plugin = docs.run("triton-plugin")

    class Counted(plugin["TritonAttention"]):
        calls = 0

        @hookimpl(tryfirst=True)
        def hp_cp_run_attention(self, module, query, ori_ext, x, qr, call):
            out = super().hp_cp_run_attention(module, query, ori_ext, x, qr, call)
            Counted.calls += out is not None
            return out

    host_names = set(get_plugin_host().statuses)
    ns = docs.run(
        "triton-plugin-host",
        {"TritonAttention": Counted, "layer": model, "mesh": _group()}
        | {"config": CPConfig(), "enable_cp": enable_cp},
    )
    try:
        handle = ns["handle"]
        local = model(handle.shard(x, 1), position_ids=handle.shard(position_ids, 1))
        _close(handle.unshard(local, 1), want)
        assert Counted.calls == 1, Counted.calls  # the page's plugin ran the attention
    finally:
        disable_cp(ns["handle"])
        host = get_plugin_host()
        for name in set(host.statuses) - host_names:
            host.remove(name)


# --------------------------------------------------------- a module of your own (last)


@case("patch-function-forward")
def patch_function_forward(port: int) -> None:
    """The guide's script, as torchrun would start it: it makes its own default process
    group (this job's is torn down first), with the foreign-module suite's concatenating
    module as ``MyAttention``."""
    import os
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "torch"))
    from foreign_cases import ConcatSeqMajor

    class MyAttention(ConcatSeqMajor):
        def __init__(self, compress_ratio: int, window_size: int) -> None:
            super().__init__(compress_ratio, window_size, seed=0)

    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    dist.destroy_process_group()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_PORT=str(port))
    ns = docs.run("patch-function-forward", {"MyAttention": MyAttention})
    _close(ns["full"], ns["want"])


def doc_blocks_suite(rank: int, world: int, port: int) -> dict[str, str | None]:
    """Every case on this rank: ``None`` when it passed, else its traceback."""
    results: dict[str, str | None] = {}
    for name, fn in CASES.items():
        try:
            fn(port) if name == "patch-function-forward" else fn()
            results[name] = None
        except Exception:  # noqa: BLE001 - reported per block by the test
            results[name] = traceback.format_exc()
    return results

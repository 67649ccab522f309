"""``python -m hp_cp_torch.bench.flips``: how often a model's discrete choices come out
differently under CP than on one process, and what such a flip costs (``bench-flips.json``).

Opt-in, out of CI; run from a checkout (the models are the tests' tiny ones, imported from
``tests/``)::

    TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=1 python -m hp_cp_torch.bench.flips \\
        --families nemo_v41 --seeds 8 --cps 1,2,4 --dtypes fp32,bf16

Note [Counting a flip]
~~~~~~~~~~~~~~~~~~~~~~
A *choice* is a discrete function of continuous values: a quantizer's grid point (NeMo
V4.1's fp8 window KV, nvfp4 compressed KV, mxfp4 index keys and queries), an indexer's
top-k, a MoE router's top-k. Each run is one training step of one seed's model and token
ids, at cp N through the CP path (``single_rank_bypass=False``, also at cp 1), against the
same step on one process in the same dtype, each choice recorded on both sides:

* quantizers: the quantized tensor (a quantized value is a grid point times a block scale,
  so two of them are either bitwise equal or a whole step apart): a flip is an element
  whose quantized value differs (code or block scale);
* top-k (indexer, router): a flip is a (query, pick) pair in one set and not the other.

Choices are ordered by where the reference forward makes them (layer, then quantizers,
selection, router). A run's *cause* is its earliest flipped choice: every flip after it
may be its consequence (a flipped fp8 element moves the next layers' inputs, and with them
index queries, top-k picks and router scores). Reported per model, dtype and kind:

* ``..._rate``: the fraction of runs where that kind flipped at least once;
* ``..._first_rate``: the fraction of runs where it was the cause;
* ``..._per_choice``: flipped elements / pairs over all made, over all runs;
* ``..._cost_logits`` / ``_cost_loss`` / ``_cost_grads``: the median over the runs it
  caused of CP's error against one process (relative max |diff| of the logits and the
  loss; the worst gradient by the suites' rule, each parameter's max |diff| over max(its
  largest gradient, 1e-2 of the model's largest)); ``..._cost_logits_max`` the worst;
* ``flips_<model>_none_<dtype>_*``: the same errors of runs without any flip (the
  summation-order floor);
* ``flips_<model>_picks_moved_<dtype>_*``: runs where a flip (of any kind) reached a top-k
  or router pick, their rate and cost; ``..._picks_kept_<dtype>_cost_logits_max`` the worst
  run that flipped only quantized values.

HF V4's gradient error is cli.parity's (each parameter's max |diff| over its own
largest, no floor). The recorders read the choices through forward hooks and, for what no
hook sees (NeMo's ``quantize_cache`` calls, hp_cp's ``select_topk_chunked`` in the HF
integration), wrap that one function for the duration of a ``with`` block, restored on
exit: measurement instrumentation, never installed by hp_cp itself.

The differences that move a choice arise upstream of it: at cp 1, with every attention
layer's output replaced by one process's, every quantizer input, router input and pick is
bitwise one process's (``test_cp1_choice_inputs_bitwise``); what differs is the attention
kernels' summation order (hp_cp's kernels against NeMo's dense SDPA), about 1 ulp of a
layer's output (docs/semantics.md, "Discrete choices").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

__all__ = [
    "ChoiceLog",
    "build_v41",
    "compare_logs",
    "flip_measures",
    "main",
    "markdown_table",
    "recording_hf_v4",
    "recording_v41",
    "summarise",
]

KINDS = ("fp8", "nvfp4", "mxfp4_keys", "mxfp4_queries", "topk", "router")
"""The choices recorded (NeMo V4.1 has all; a model without quantization only the last two)."""


def _log_run(run: dict) -> dict:
    """``run``, also appended to the JSON-lines file ``$HP_CP_FLIPS_LOG`` names (if any), so
    an interrupted bench keeps what it measured (``--combine`` reads such a file too)."""
    path = os.environ.get("HP_CP_FLIPS_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(run) + "\n")
    return run


def _cases_path(root: str) -> None:
    for sub in ("tests/nemo_automodel", "tests/torch"):
        path = os.path.join(root, sub)
        if path not in sys.path:
            sys.path.insert(0, path)


class ChoiceLog:
    """What one forward chose, by site (``"<layer>.<kind>"``), in the order it chose it.

    Each entry is ``(kind, rows, value)``: ``rows`` the global row id of each entry along
    dim 1 of ``value`` (``None`` for slot buffers, which are indexed by slot already).
    """

    def __init__(self) -> None:
        self.sites: dict[str, tuple[str, Any, Any]] = {}
        self.order: list[str] = []
        self.layer: str = ""
        self.rows: Any = None

    def add(self, kind: str, value: Any, rows: Any) -> None:
        site = f"{self.layer}.{kind}"
        if site not in self.sites:
            self.order.append(site)
        self.sites[site] = (kind, None if rows is None else rows.cpu(), value.detach().cpu())


@contextlib.contextmanager
def recording_v41(model: Any, log: ChoiceLog) -> Any:
    """Record NeMo V4.1's choices into ``log`` while inside (hooks, and NeMo's quantizer
    wrapped in the two modules that call it; all removed on exit)."""
    import nemo_automodel.components.models.deepseek_v41.attention as attention
    import nemo_automodel.components.models.deepseek_v41.quantization as quantization

    original = quantization.quantize_cache

    def quantize(values: Any, *, format: str, block_size: int) -> Any:
        out = original(values, format=format, block_size=block_size)
        if format == "fp8":
            log.add("fp8", out, log.rows)
        elif format == "mxfp4" and out.dim() == 4:
            log.add("mxfp4_queries", out, log.rows)
        return out  # slot buffers (nvfp4, mxfp4 keys): from the layer's state below

    handles = []
    for name, mod in model.named_modules():
        if type(mod).__name__ == "DeepseekV41Attention":

            def pre(mod: Any, args: Any, kwargs: dict, name: str = name) -> None:
                log.layer = name.replace("model.layers.", "L").replace(".attn", "")
                log.rows = kwargs["position_ids"].reshape(-1)

            def post(mod: Any, args: Any, kwargs: dict, out: Any) -> None:
                state = out.state
                if mod.compressor is not None:
                    log.add("nvfp4", state.compressed_kv, None)
                if mod.indexer is not None and mod.indexer.owns_keys:
                    log.add("mxfp4_keys", state.index_keys, None)
                if mod.indexer is not None:
                    log.add("topk", state.topk_indices, log.rows)

            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(mod.register_forward_hook(post, with_kwargs=True))
        elif name.endswith("ffn.gate"):

            def gate(mod: Any, args: Any, out: Any) -> None:
                log.add("router", out[1].unsqueeze(0), log.rows)

            handles.append(mod.register_forward_hook(gate))
    attention.quantize_cache = quantization.quantize_cache = quantize
    try:
        yield log
    finally:
        attention.quantize_cache = quantization.quantize_cache = original
        for h in handles:
            h.remove()


def _by_rows(parts: list[tuple[Any, Any]], want: Any) -> tuple[Any, Any]:
    """``want``'s rows that ranks' ``(rows, value)`` cover, and those values in the same
    order (rows past ``want``'s: padding, dropped)."""
    import torch

    rows = torch.cat([r for r, _ in parts])
    values = torch.cat([v for _, v in parts], dim=1)
    keep = rows < want.shape[1]
    return want[:, rows[keep]], values[:, keep]


def _set_diff(a: Any, b: Any) -> tuple[int, int]:
    """(pairs in ``a`` not in ``b``, pairs in ``a``) over rows of index sets (-1: none)."""
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    hit = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1) | (a < 0)
    return int((~hit).sum()), int((a >= 0).sum())


def compare_logs(ref: ChoiceLog, ranks: list[ChoiceLog]) -> dict[str, Any]:
    """Per site of the reference: ``(kind, flipped, made)`` in forward order."""
    out: dict[str, Any] = {}
    for site in ref.order:
        kind, _, want = ref.sites[site]
        got = [log.sites[site] for log in ranks if site in log.sites]
        if kind in ("nvfp4", "mxfp4_keys"):  # slot buffers: each rank's visible prefix
            flagged = set()
            for _, _, value in got:
                n = min(value.shape[1], want.shape[1])
                diff = (value[:, :n] != want[:, :n]).reshape(value.shape[0], n, -1)
                for s, c in (diff.any(0)).nonzero().tolist():
                    flagged.add((s, c))
            out[site] = [kind, len(flagged), int(want[0].numel())]
            continue
        want, value = _by_rows([(r, v) for _, r, v in got], want)
        if kind in ("topk", "router"):
            flipped, made = _set_diff(want, value)
        else:
            flipped, made = int((value != want).sum()), int(want.numel())
        out[site] = [kind, flipped, made]
    return out


# --------------------------------------------------------------------------- NeMo V4.1


def build_v41(seed: int, dtype: str) -> Any:
    """The tests' tiny NeMo V4.1 (``nemo_v41_cases``) in ``dtype``: fp32 as the tests build
    it; bf16 built by NeMo in bf16 (NeMo keeps sinks, mHC and the compressor in fp32)."""
    import nemo_v41_cases as cases
    import torch

    if dtype == "fp32":
        return cases.build_model(seed)
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from nemo_automodel.components.models.qwen3_8_flash_next.engram import (
        Qwen3_8_FlashNextEngramTableConfig,
    )

    dt = torch.bfloat16
    config = DeepseekV41Config(
        text_config=cases.text_config(dtype="bfloat16"),
        vision_config={"num_hidden_layers": 0},
        dtype="bfloat16",
    )
    backend = BackendConfig(
        attn="sdpa", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch"
    )
    torch.manual_seed(seed)
    model = DeepseekV41ForCausalLM(config, backend=backend, tokenizer=cases.tokenizer())
    for layer in model.model.layers.values():
        if layer.engram is not None:
            layer.engram.embed = Qwen3_8_FlashNextEngramTableConfig(
                num_embeddings=layer.engram.num_embeddings,
                embedding_dim=layer.engram.embed.embedding_dim,
                initializer_range=layer.engram.initializer_range,
            ).build(process_group=None, dtype=dt)
    torch.manual_seed(seed)
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=dt)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks_param.weight"):
                p.normal_(0.0, 0.5)
            if ".engram.embed" in name:
                p.normal_(0.0, 1.0)
    return model.train()


def _v41_run(rank: int, group: Any, seed: int, dtype: str, layout: str) -> dict[str, Any] | None:
    import nemo_v41_cases as cases
    import torch.distributed as dist

    from hp_cp_core import enable_cp

    model = build_v41(seed, dtype)
    ids = cases.make_ids(cases.SEQ, seed)
    ref_log = ChoiceLog()
    ref = None
    if rank == 0:
        with recording_v41(model, ref_log):
            ref = cases.reference(model, ids)

    def enable(m: Any, g: Any, config: Any) -> Any:
        return enable_cp(m, g, replace(config, single_rank_bypass=False))

    log = ChoiceLog()
    with recording_v41(model, log):  # the copy cp_run makes keeps the hooks
        got = cases.cp_run(model, ids, group, layout, enable=enable)
    logs: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(logs, log, group=group)
    if rank != 0:
        return None
    errs = cases.compare(ref, got)
    sites = compare_logs(ref_log, logs)
    return {
        "seed": seed,
        "layout": layout,
        "logits": errs["logits"],
        "loss": errs["loss"],
        "grads": errs["grads"],
        "worst_grad": errs["worst"][0][0] if errs["worst"] else "",
        "sites": sites,
    }


def v41_job(rank: int, world: int, seeds: list[int], dtypes: list[str]) -> list[dict]:
    """Every (dtype, seed) at cp = ``world`` (layouts alternate by seed)."""
    import torch.distributed as dist

    out = []
    for dtype in dtypes:
        for seed in seeds:
            layout = "contiguous" if seed % 2 else "load_balanced"
            res = _v41_run(rank, dist.group.WORLD, seed, dtype, layout)
            if res is not None:
                out.append(_log_run({**res, "cp": world, "dtype": dtype, "model": "nemo_v41"}))
    return out


# --------------------------------------------------------------------------- HF V4


@contextlib.contextmanager
def recording_hf_v4(model: Any, log: ChoiceLog) -> Any:
    """Record transformers' DeepSeek V4's choices into ``log`` while inside: the CSA
    indexer's top-k (HF's ``DeepseekV4Indexer`` on one process; under CP the picks hp_cp's
    runner makes, read where it calls ``select_topk_chunked``) and the score routers'
    top-k (the hash router is a table: no choice)."""
    from hp_cp_torch import runner as integration

    original = integration.select_topk_chunked
    handles = []

    def rows_of(mod: Any, args: Any, kwargs: dict) -> None:
        log.rows = kwargs["position_ids"][0].reshape(-1)

    handles.append(model.register_forward_pre_hook(rows_of, with_kwargs=True))
    for name, mod in model.named_modules():
        layer = name.replace("model.layers.", "L").split(".")[0]
        kind = type(mod).__name__
        if kind == "DeepseekV4Indexer":

            def ix(mod: Any, args: Any, kwargs: dict, out: Any, layer: str = layer) -> None:
                log.layer = layer
                log.add("topk", out, log.rows)

            handles.append(mod.register_forward_hook(ix, with_kwargs=True))
        elif kind == "DeepseekV4Attention":

            def at(mod: Any, args: Any, layer: str = layer) -> None:
                log.layer = layer

            handles.append(mod.register_forward_pre_hook(at))
        elif kind == "DeepseekV4TopKRouter":

            def router(mod: Any, args: Any, out: Any, layer: str = layer) -> None:
                log.layer = layer
                picks = out[2].reshape(args[0].shape[0], args[0].shape[1], -1)
                log.add("router", picks, log.rows)

            handles.append(mod.register_forward_hook(router))

    def select(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        log.add("topk", out, log.rows)
        return out

    integration.select_topk_chunked = select
    try:
        yield log
    finally:
        integration.select_topk_chunked = original
        for h in handles:
            h.remove()


def hf_v4_job(rank: int, world: int, seeds: list[int], dtypes: list[str]) -> list[dict]:
    """transformers' tiny DeepSeek V4 (:func:`~hp_cp_torch.cli.parity.
    build_tiny_model`: sliding, CSA r = 4 with top-k 4, HCA; a hash-routed and two
    score-routed MoE layers), batch 2, S = 264, every (dtype, seed) at cp = ``world``."""
    import torch
    import torch.distributed as dist

    from hp_cp_core import CPConfig
    from hp_cp_torch.cli import parity as demo

    out = []
    for dtype in dtypes:
        for seed in seeds:
            layout = "contiguous" if seed % 2 else "load_balanced"
            model = demo.build_tiny_model(seed)
            if dtype == "bf16":
                model = model.to(torch.bfloat16)
            ids = demo.make_inputs(model.config.vocab_size, 2, 264, seed)
            ref_log, log = ChoiceLog(), ChoiceLog()
            with recording_hf_v4(model, ref_log):
                ref = demo.reference_run(model, ids)
            config = CPConfig(layout=layout, single_rank_bypass=False)
            with recording_hf_v4(model, log):
                got = demo.cp_parity(model, ids, ref, dist.group.WORLD, layout, config=config)
            logs: list[Any] = [None] * world
            dist.all_gather_object(logs, log)
            if rank == 0:
                out.append(
                    _log_run(
                        {
                            "model": "hf_v4",
                            "cp": world,
                            "dtype": dtype,
                            "seed": seed,
                            "layout": layout,
                            "logits": got["logits_rel_err"],
                            "loss": got["loss_rel_err"],
                            "grads": got["grad_rel_err_max"],
                            "worst_grad": got["grad_rel_err_worst_param"],
                            "sites": compare_logs(ref_log, logs),
                        }
                    )
                )
    return out


FAMILIES = {"nemo_v41": v41_job, "hf_v4": hf_v4_job}


# --------------------------------------------------------------------------- summary


def summarise(runs: list[dict]) -> dict[str, Any]:
    """``flips_<model>_<kind>_<dtype>_*`` (see Note [Counting a flip])."""
    res: dict[str, Any] = {}
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["model"], run["dtype"]), []).append(run)
    for (model, dtype), group in groups.items():
        n = len(group)
        causes = []
        for run in group:
            flipped = [(site, k) for site, (k, f, _) in run["sites"].items() if f]
            causes.append(flipped[0][1] if flipped else "none")
        res[f"flips_{model}_{dtype}_runs"] = n
        for kind in (*KINDS, "none"):
            caused = [r for r, c in zip(group, causes) if c == kind]
            prefix = f"flips_{model}_{kind}_{dtype}"
            if kind != "none":
                made = [(f, m) for r in group for k, f, m in r["sites"].values() if k == kind]
                if not made:
                    continue
                hit = sum(any(f for k, f, _ in r["sites"].values() if k == kind) for r in group)
                res[f"{prefix}_rate"] = hit / n
                res[f"{prefix}_first_rate"] = len(caused) / n
                res[f"{prefix}_per_choice"] = sum(f for f, _ in made) / max(
                    sum(m for _, m in made), 1
                )
            else:
                res[f"{prefix}_rate"] = len(caused) / n
            if caused:
                for err in ("logits", "loss", "grads"):
                    res[f"{prefix}_cost_{err}"] = statistics.median(r[err] for r in caused)
                res[f"{prefix}_cost_logits_max"] = max(r["logits"] for r in caused)
        moved = [
            r for r in group if any(f for k, f, _ in r["sites"].values() if k in ("topk", "router"))
        ]
        res[f"flips_{model}_picks_moved_{dtype}_rate"] = len(moved) / n
        if moved:
            for err in ("logits", "loss", "grads"):
                res[f"flips_{model}_picks_moved_{dtype}_cost_{err}"] = statistics.median(
                    r[err] for r in moved
                )
            res[f"flips_{model}_picks_moved_{dtype}_cost_logits_max"] = max(
                r["logits"] for r in moved
            )
        quiet = [r for r, c in zip(group, causes) if c != "none" and r not in moved]
        if quiet:  # flipped, but no pick moved
            res[f"flips_{model}_picks_kept_{dtype}_cost_logits_max"] = max(
                r["logits"] for r in quiet
            )
        for cp in sorted({r["cp"] for r in group}):
            at = [c for r, c in zip(group, causes) if r["cp"] == cp]
            res[f"flips_{model}_{dtype}_cp{cp}_any_rate"] = sum(c != "none" for c in at) / len(at)
    return res


def markdown_table(res: dict[str, Any]) -> str:
    """The summary as the table of docs/semantics.md ("Discrete choices")."""

    def num(key: str) -> str:
        v = res.get(key)
        return "" if v is None else f"{v:.2g}"

    lines = [
        "| model, dtype (runs) | choice | share of runs it flipped in | share of runs it "
        "flipped first in | flipped / made | cost when first: logits / loss / grads (median) |",
        "|---|---|---|---|---|---|",
    ]
    for key in sorted(k for k in res if k.endswith("_runs") and isinstance(res[k], int)):
        model, dtype = key[len("flips_") : -len("_runs")].rsplit("_", 1)
        base = f"flips_{model}"
        label = f"{model} {dtype} ({res[key]})"
        for kind in (*KINDS, "picks_moved", "none"):
            p = f"{base}_{kind}_{dtype}"
            if f"{p}_rate" not in res:
                continue
            cost = " / ".join(num(f"{p}_cost_{e}") for e in ("logits", "loss", "grads"))
            cost = "" if cost == " /  / " else cost
            if kind == "none":
                lines.append(f"| {label} | no flip | {num(p + '_rate')} of runs | | | {cost} |")
            elif kind == "picks_moved":
                every = f"{cost} (median of every such run)" if cost else ""
                lines.append(
                    f"| {label} | any top-k or router pick moved | {num(p + '_rate')} | | | "
                    f"{every} |"
                )
            else:
                lines.append(
                    f"| {label} | {kind} | {num(p + '_rate')} | {num(p + '_first_rate')} | "
                    f"{num(p + '_per_choice')} | {cost} |"
                )
    return "\n".join(lines)


def flip_measures(
    families: list[str], seeds: list[int], cps: list[int], dtypes: list[str]
) -> list[dict]:
    """Every family at every cp (one gloo job each): the runs (:func:`summarise` them)."""
    from hp_cp_torch.cli.launch import run_ranks

    runs: list[dict] = []
    for family in families:
        for cp in cps:
            ranks = run_ranks(cp, FAMILIES[family], seeds, dtypes, timeout=3600)
            runs.extend(ranks[0])
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hp_cp_torch.bench.flips", description=__doc__)
    p.add_argument("--families", default="nemo_v41", help=f"of {sorted(FAMILIES)}")
    p.add_argument("--seeds", type=int, default=8, help="how many seeds (weights and ids); 0: none")
    p.add_argument("--first-seed", type=int, default=0, help="the seeds start here")
    p.add_argument("--cps", default="1,2,4")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--root", default=os.getcwd(), help="the checkout (its tests/ has the models)")
    p.add_argument("--out", default="bench-flips.json")
    p.add_argument("--table", action="store_true", help="print the docs' markdown table")
    p.add_argument(
        "--combine",
        default="",
        help="earlier runs to summarise with: JSON files this wrote (their flips_runs) or "
        "$HP_CP_FLIPS_LOG's JSON lines (.jsonl), comma-separated",
    )
    args = p.parse_args(argv)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    _cases_path(os.path.abspath(args.root))
    start = time.time()
    runs: list[dict] = []
    commands = []
    for path in [c for c in args.combine.split(",") if c]:
        with open(path) as f:
            if path.endswith(".jsonl"):
                runs.extend(json.loads(line) for line in f if line.strip())
                continue
            old = json.load(f)
        runs.extend(old["flips_runs"])
        commands.append(old["flips_command"])
    if args.seeds > 0:
        runs.extend(
            flip_measures(
                args.families.split(","),
                list(range(args.first_seed, args.first_seed + args.seeds)),
                [int(c) for c in args.cps.split(",")],
                args.dtypes.split(","),
            )
        )
        commands.append(
            "TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=1 python -m "
            + " ".join(["hp_cp_torch.bench.flips", *(argv if argv is not None else sys.argv[1:])])
        )
    res = summarise(runs)
    res["flips_command"] = " && ".join(commands)
    res["flips_seconds"] = round(time.time() - start, 1)
    res["flips_runs"] = runs
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
    if args.table:
        print(markdown_table(res))
        return 0
    for key, value in sorted(res.items()):
        if key != "flips_runs":
            print(key, value)
    return 0


if __name__ == "__main__":
    sys.exit(main())

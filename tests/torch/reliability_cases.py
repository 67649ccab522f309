"""Rank-side cases of the reliability tests: determinism and "nothing lost".

Run through the job machinery of ``cases.py`` as the suite
``"reliability_cases:reliability_suite:<part>"`` on 4 ranks: part ``a`` runs every
determinism case three times (fresh ``enable_cp``, the same handle again, a fresh model and
handle) plus the lifecycle cases; part ``b`` is a second, separate job running each
determinism case once, so the test can compare bitwise across processes.

One 4-rank job covers cp = 1, 2, 3 and 4: the world is split into blocks of ``cp``
consecutive ranks, each block its own process group (cp = 2 runs the same case on ranks
{0, 1} and {2, 3} at once; cp = 3 leaves rank 3 idle). Ranks return local tensors only;
every assertion runs in the pytest process.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from cases import (
    AdapterCase,
    Case,
    SeqMajorCSA,
    _loss,
    _or_zeros,
    adapter_inputs,
    build_layer,
    make_inputs,
    parity_case,
    rel_err,
)
from torch import nn

from hp_cp_core import DeepSeekV4CPConfig, disable_cp, enable_cp
from hp_cp_torch.reference import DeepSeekV4Attention

WORLD = 4
DETERMINISM_CPS = (1, 2, 3, 4)
R_LAYOUTS = [(r, layout) for r in (0, 4, 128) for layout in ("contiguous", "load_balanced")]


def determinism_cases() -> list[Case]:
    """Every cp of :data:`DETERMINISM_CPS` with every ratio and layout, padded and packed
    alternating (so each (r, layout, packed) appears for some cp), plus the efficient
    kernel, ``loss.backward()``, bf16 and several intra-op threads per rank."""
    out = [
        parity_case(cp, r, layout, packed=bool((i + cp) % 2))
        for cp in DETERMINISM_CPS
        for i, (r, layout) in enumerate(R_LAYOUTS)
    ]
    out += [
        parity_case(4, 4, "load_balanced", packed=True, kernel="efficient", seed=1),
        parity_case(2, 4, "contiguous", packed=False, kernel="efficient", seed=1),
        parity_case(3, 128, "contiguous", packed=True, backward="backward", seed=2),
        parity_case(4, 4, "contiguous", packed=False, backward="backward", seed=2),
        parity_case(2, 4, "load_balanced", packed=True, dtype="bfloat16", seed=3),
        *THREADED,
    ]
    return out


THREADED = {
    parity_case(2, 4, "contiguous", packed=False, chunk=64, window=64, seed=6): 4,
    parity_case(4, 0, "contiguous", packed=False, chunk=64, window=64, seed=7): 4,
}
"""Cases run with several intra-op threads per rank (parallel CPU kernels), and how many:
large enough that the gathers' backward runs in parallel."""


def case_id(case: Case) -> str:
    """Unique within :func:`determinism_cases` (the name plus what the name leaves out)."""
    threads = THREADED.get(case, 1)
    return f"{case.name}-s{case.seed}" + (f"-threads{threads}" if threads > 1 else "")


# ------------------------------------------------------------------------------ groups

_GROUPS: dict[int, Any] = {}


def block_group(cp: int) -> Any:
    """This rank's group of ``cp`` consecutive ranks, or ``None`` for a leftover rank.

    Every rank creates every block's group, in the same order (``new_group`` is collective).
    """
    if cp not in _GROUPS:
        world, rank = dist.get_world_size(), dist.get_rank()
        mine = None
        for start in range(0, world - cp + 1, cp):
            ranks = list(range(start, start + cp))
            pg = dist.group.WORLD if cp == world else dist.new_group(ranks)
            if rank in ranks:
                mine = pg
        _GROUPS[cp] = mine
    return _GROUPS[cp]


# ------------------------------------------------------------------------------ one step


def cp_step(layer: nn.Module, handle: Any, case: Case) -> dict[str, torch.Tensor]:
    """Forward and backward of ``case`` under ``handle``; this rank's output and gradients."""
    x, cu, g = make_inputs(case)
    dim = 0 if case.packed else 1
    xl = handle.shard(x, dim).requires_grad_(True)
    kwargs: dict[str, Any] = {"cu_seqlens": cu}
    if not case.packed and case.positions:
        kwargs["position_ids"] = handle.shard(torch.arange(case.total), 0)
    out = layer(xl, **kwargs)
    named = list(layer.named_parameters())
    loss = _loss(out, handle.shard(g, dim))
    if case.backward == "grad":
        grads = torch.autograd.grad(loss, [xl, *(p for _, p in named)], allow_unused=True)
    else:
        layer.zero_grad(set_to_none=True)
        loss.backward()
        grads = [xl.grad, *(p.grad for _, p in named)]
    res = {"out": out.detach(), "gx": grads[0].detach()}
    res.update({f"grad:{n}": _or_zeros(gr, p).clone() for (n, p), gr in zip(named, grads[1:])})
    return res


def plain_step(layer: nn.Module, case: Case) -> dict[str, torch.Tensor]:
    """The same on one device, never CP-enabled (the layer's own forward)."""
    x, cu, g = make_inputs(case)
    x.requires_grad_(True)
    out = layer(x, cu_seqlens=cu)
    named = list(layer.named_parameters())
    grads = torch.autograd.grad(_loss(out, g), [x, *(p for _, p in named)], allow_unused=True)
    res = {"out": out.detach(), "gx": grads[0].detach()}
    res.update({f"grad:{n}": _or_zeros(gr, p).clone() for (n, p), gr in zip(named, grads[1:])})
    return res


def determinism_case(case: Case, repeats: int) -> dict:
    """``repeats`` CP steps: a fresh ``enable_cp``, the same handle again (plan cache hit),
    then a fresh model and handle; for cp = 1 also the never-enabled layer."""
    pg = block_group(case.cp)
    if pg is None:
        return {"member": False}
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADED.get(case, 1))
    try:
        return _determinism_runs(case, repeats, pg)
    finally:
        torch.set_num_threads(threads)


def _determinism_runs(case: Case, repeats: int, pg: Any) -> dict:
    config = DeepSeekV4CPConfig(
        layout=case.layout,
        attention_kernel=case.kernel,
        query_chunk=case.query_chunk,
        single_rank_bypass=False,  # cp = 1 runs the CP path too
    )
    runs = []
    layer = build_layer(case)
    handle = enable_cp(layer, pg, config)
    try:
        runs.append(cp_step(layer, handle, case))
        if repeats > 1:
            runs.append(cp_step(layer, handle, case))
    finally:
        disable_cp(handle)
    for _ in range(max(0, repeats - 2)):
        layer = build_layer(case)
        handle = enable_cp(layer, pg, config)
        try:
            runs.append(cp_step(layer, handle, case))
        finally:
            disable_cp(handle)
    res: dict[str, Any] = {
        "member": True,
        "cp_rank": handle.cp_rank,
        "block": dist.get_rank() // case.cp,
        "runs": runs,
    }
    if case.cp == 1:  # the default bypass keeps the module's own forward: bitwise plain
        res["plain"] = plain_step(build_layer(case), case)
        layer = build_layer(case)
        handle = enable_cp(layer, pg, DeepSeekV4CPConfig(layout=case.layout))
        try:
            res["bypass"] = cp_step(layer, handle, case)
        finally:
            disable_cp(handle)
    return res


# ------------------------------------------------------------------------------ nothing lost


def _snapshot(module: nn.Module) -> dict[str, Any]:
    """What enable / disable must leave alone: state_dict (keys in order, values, storage),
    parameters, buffers, sub-modules, hooks and the instance attributes."""
    sd = module.state_dict()
    return {
        "keys": list(sd),
        "values": {k: v.detach().clone() for k, v in sd.items()},
        "ptrs": {k: v.data_ptr() for k, v in sd.items()},
        "params": [(n, id(p)) for n, p in module.named_parameters()],
        "buffers": [(n, id(b)) for n, b in module.named_buffers()],
        "modules": [(n, id(m)) for n, m in module.named_modules()],
        "hooks": sum(
            len(getattr(m, h))
            for m in module.modules()
            for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks")
        ),
        "attrs": {id(m): sorted(m.__dict__) for m in module.modules()},
    }


def _diff(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Names of the snapshot entries that changed (empty when nothing did)."""
    kinds = ("keys", "ptrs", "params", "buffers", "modules", "hooks")
    out = [k for k in kinds if before[k] != now[k]]
    if before["attrs"] != now["attrs"]:
        for key, names in now["attrs"].items():
            extra = sorted(set(names) ^ set(before["attrs"].get(key, [])))
            if extra:
                out.append(f"attrs {extra}")
    for k, v in before["values"].items():
        if k in now["values"] and not torch.equal(v, now["values"][k]):
            out.append(f"value {k}")
    return out


def _error_of(fn: Callable[[], Any]) -> str:
    """``"ok"``, or the type and message of what ``fn`` raised."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys of two step results that are not bitwise equal."""
    return [k for k in a if k not in b or not torch.equal(a[k], b[k])] + sorted(set(b) - set(a))


class Block(nn.Module):
    """A whole "model" holding one attention layer (``enable_cp`` finds it)."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(attn.config.hidden_size)
        self.attn = attn

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.attn(self.norm(x), **kwargs)


def state_case(case: Case) -> dict:
    """state_dict untouched; save / load (state_dict while enabled; whole module after
    disable); whole-module pickle / copy under CP is a clear ``HpCpError``; disable gives
    back the exact original forward and output."""
    config = DeepSeekV4CPConfig(layout=case.layout)
    x, cu, _ = make_inputs(case)
    with torch.no_grad():
        never = build_layer(case)(x, cu_seqlens=cu)
    layer = build_layer(case)
    with torch.no_grad():
        layer(x, cu_seqlens=cu)  # attributes a forward sets exist before the snapshot
    before = _snapshot(layer)
    out: dict[str, Any] = {}
    handle = enable_cp(layer, None, config)
    try:
        out["enabled_diff"] = _diff(before, _snapshot(layer))
        step = cp_step(layer, handle, case)
        out["after_step_diff"] = _diff(before, _snapshot(layer))
        buf = io.BytesIO()
        out["save_state_dict"] = _error_of(lambda: torch.save(layer.state_dict(), buf))
        out["torch_save_module"] = _error_of(lambda: torch.save(layer, io.BytesIO()))
        out["deepcopy_module"] = _error_of(lambda: copy.deepcopy(layer))
        out["pickle_handle"] = _error_of(lambda: pickle.dumps(handle))
        # load into a model with other weights, enable CP there: the same step, bitwise
        fresh = build_layer(dataclasses.replace(case, seed=case.seed + 1))
        buf.seek(0)
        fresh.load_state_dict(torch.load(buf))
        h2 = enable_cp(fresh, None, config)
        try:
            out["loaded_step_diff"] = _same(step, cp_step(fresh, h2, case))
        finally:
            disable_cp(h2)
    finally:
        disable_cp(handle)
    out["disabled_diff"] = _diff(before, _snapshot(layer))
    out["forward_is_class_forward"] = (
        "forward" not in layer.__dict__ and layer.forward.__func__ is DeepSeekV4Attention.forward
    )
    with torch.no_grad():
        out["plain_bitwise"] = bool(torch.equal(layer(x, cu_seqlens=cu), never))
    # after disable the whole module saves; the loaded copy runs under CP like the original
    buf = io.BytesIO()
    out["torch_save_after_disable"] = _error_of(lambda: torch.save(layer, buf))
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with torch.no_grad():
        out["loaded_plain_bitwise"] = bool(torch.equal(loaded(x, cu_seqlens=cu), never))
    h3 = enable_cp(loaded, None, config)
    try:
        out["loaded_module_step_diff"] = _same(step, cp_step(loaded, h3, case))
    finally:
        disable_cp(h3)
    # a whole model: the error names the layer, and everything comes back after disable
    model = Block(build_layer(case))
    model_before = _snapshot(model)
    hm = enable_cp(model, None, config)
    out["model_layers"] = len(hm.layers)
    out["torch_save_model"] = _error_of(lambda: torch.save(model, io.BytesIO()))
    disable_cp(hm)
    out["model_disabled_diff"] = _diff(model_before, _snapshot(model))
    out["torch_save_model_after"] = _error_of(lambda: torch.save(model, io.BytesIO()))
    return out


def adapter_state_case(r: int) -> dict:
    """``patch_torch_deepseek_v4_csa_forward`` leaves no attribute (no adapter) behind."""
    from hp_cp_torch import patch_torch_deepseek_v4_csa_forward

    module = SeqMajorCSA(r, 16)
    before = _snapshot(module)
    handle = patch_torch_deepseek_v4_csa_forward(module, cp_mesh=None)
    try:
        enabled = _diff(before, _snapshot(module))
        inputs, _ = adapter_inputs(AdapterCase(WORLD, r, chunk=7))
        with torch.no_grad():
            module(*[handle.shard(t, 0) for t in inputs])
        saving = _error_of(lambda: torch.save(module, io.BytesIO()))
    finally:
        disable_cp(handle)
    return {
        "enabled_diff": enabled,
        "torch_save_module": saving,
        "disabled_diff": _diff(before, _snapshot(module)),
        "torch_save_after_disable": _error_of(lambda: torch.save(module, io.BytesIO())),
    }


def two_models_case() -> dict:
    """Model A under CP on all 4 ranks, model B on a 2-rank "cp" dim of a (2, 2) mesh.

    Each first runs a step alone; then both forwards, B's backward, A's backward
    interleaved. The interleaved results must equal the lone ones bitwise, and each handle
    count only its own traffic and plans.
    """
    from torch.distributed.device_mesh import init_device_mesh

    case_a = parity_case(4, 4, "load_balanced", packed=True, seed=4)
    case_b = parity_case(2, 128, "contiguous", packed=False, seed=5)
    mesh_b = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))["cp"]
    layer_a, layer_b = build_layer(case_a), build_layer(case_b)
    ha = enable_cp(layer_a, None, DeepSeekV4CPConfig(layout=case_a.layout))
    hb = enable_cp(layer_b, mesh_b, DeepSeekV4CPConfig(layout=case_b.layout))
    try:
        alone_a = cp_step(layer_a, ha, case_a)
        stats_a1 = ha.stats()
        alone_b = cp_step(layer_b, hb, case_b)
        stats_b1 = hb.stats()
        # interleaved: forward A, forward B, backward B, backward A
        got = {}
        xa, cua, ga = make_inputs(case_a)
        xb, _, gb = make_inputs(case_b)
        xla = ha.shard(xa, 0).requires_grad_(True)
        xlb = hb.shard(xb, 1).requires_grad_(True)
        oa = layer_a(xla, cu_seqlens=cua)
        ob = layer_b(xlb, position_ids=hb.shard(torch.arange(case_b.total), 0))
        pb = list(layer_b.parameters())
        gb_all = torch.autograd.grad(_loss(ob, hb.shard(gb, 1)), [xlb, *pb], allow_unused=True)
        pa = list(layer_a.parameters())
        ga_all = torch.autograd.grad(_loss(oa, ha.shard(ga, 0)), [xla, *pa], allow_unused=True)
        names_a = [n for n, _ in layer_a.named_parameters()]
        names_b = [n for n, _ in layer_b.named_parameters()]
        got["a"] = {"out": oa.detach(), "gx": ga_all[0]}
        got["a"].update({f"grad:{n}": _or_zeros(g, p) for n, g, p in zip(names_a, ga_all[1:], pa)})
        got["b"] = {"out": ob.detach(), "gx": gb_all[0]}
        got["b"].update({f"grad:{n}": _or_zeros(g, p) for n, g, p in zip(names_b, gb_all[1:], pb)})
        stats_a2, stats_b2 = ha.stats(), hb.stats()
        full_b = hb.unshard(ob.detach(), 1)
    finally:
        disable_cp(hb)
        disable_cp(ha)
    return {
        "cp_sizes": (ha.cp_size, hb.cp_size),
        "b_group_ranks": hb.group.global_ranks,
        "a_diff": _same(alone_a, got["a"]),
        "b_diff": _same(alone_b, got["b"]),
        "stats_a": (stats_a1, stats_a2),
        "stats_b": (stats_b1, stats_b2),
        "b_out": full_b,
        "b_case": case_b,
        "restored": "forward" not in layer_a.__dict__ and "forward" not in layer_b.__dict__,
    }


def plan_cache_case() -> dict:
    """Feed more distinct shapes than the cache holds: it stays bounded, drops the least
    recently used plan first, and ``handle.stats()["plan_cache"]`` reports it."""
    hidden = 32
    seen: dict[str, Any] = {}
    # a small cache: LRU order is visible
    layer = build_layer(Case(WORLD, 0))
    handle = enable_cp(layer, None, DeepSeekV4CPConfig(plan_cache_size=4))
    trace = []
    try:

        def run(rows_per_rank: int) -> None:
            with torch.no_grad():
                layer(torch.randn(1, rows_per_rank, hidden))
            trace.append(dict(handle.stats()["plan_cache"]))

        for n in range(1, 8):  # seven shapes: 1..7 local rows
            run(n)
        run(4)  # oldest kept -> hit, becomes most recent
        run(8)  # new -> evicts 5 (least recently used), not 4
        run(4)  # still cached
        run(5)  # was evicted -> miss
    finally:
        disable_cp(handle)
    seen["small"] = trace
    # the default capacity, with more shapes than it holds
    layer = build_layer(Case(WORLD, 0))
    handle = enable_cp(layer, None)
    try:
        default = handle.stats()["plan_cache"]["capacity"]
        for n in range(1, default + 7):
            with torch.no_grad():
                layer(torch.randn(1, n, hidden))
        seen["default"] = handle.stats()["plan_cache"]
        seen["default_held"] = len(handle.cache._plans)
    finally:
        disable_cp(handle)
    return seen


# ------------------------------------------------------------------------------ the suite


def reliability_suite(world: int, part: str) -> dict[str, tuple[Callable, tuple]]:
    """Part ``a``: determinism x3 and the lifecycle cases; part ``b``: determinism x1."""
    if world != WORLD:
        return {}
    repeats = 3 if part == "a" else 1
    suite: dict[str, tuple[Callable, tuple]] = {
        f"det:{case_id(c)}": (determinism_case, (c, repeats)) for c in determinism_cases()
    }
    if part == "a":
        suite.update(
            {
                "state:r4-lb-packed": (state_case, (parity_case(4, 4, "load_balanced", True),)),
                "state:r128-contig-padded": (state_case, (parity_case(4, 128),)),
                "adapter_state:r4": (adapter_state_case, (4,)),
                "two_models": (two_models_case, ()),
                "plan_cache": (plan_cache_case, ()),
            }
        )
    return suite


__all__ = ["THREADED", "determinism_cases", "reliability_suite", "rel_err"]

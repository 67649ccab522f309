"""Reliability on real gloo ranks: bad input, ranks that disagree, and failing ranks give
every rank a clear ``HpCpError`` instead of a hang or a wrong answer (issue 7).

* Validation before communication: wrong dims, batch / heads / head_dim mismatch, dtype,
  device, DTensor inputs, cu_seqlens not 0 .. S or decreasing, a sequence the layout cannot
  shard, an unsupported layer spec, a module already under CP, a mesh or group this rank is
  not in or whose size differs from its group's. The bad input is on the *last* rank only
  (unless every rank's is bad), yet every rank raises the same message, and no data
  collective has run.
* Cross-rank agreement: each rank's input valid on its own, but rows, cu_seqlens, batch,
  dtype, layout, kernel, ratio or window differ on one rank: every rank raises the same
  ``PlanError`` listing the values per rank.
* No hangs: a rank that fails inside the layer (or skips it) leaves the others failing
  within the group timeout with an error naming the collective and saying a peer failed.
  Backward runs the same collectives on every rank when gradients are zero or a rank's rows
  are not in the loss (ranks with empty halos and no slots included), and gradients match
  one device.

The rank-side cases are in ``errors_cases.py`` (one job per world size).
"""

from __future__ import annotations

import pytest
import torch
from cases import build_layer, make_inputs, rel_err, result
from errors_cases import FAULT_TIMEOUT_S, zero_grad_cases, zero_grad_name

from hp_cp_core import DeepSeekV4CPConfig
from hp_cp_core.layout import SequenceLayout

pytestmark = pytest.mark.slow

SUITE = "errors_cases:errors_suite"
WORLDS = (2, 3)


def _case_result(world: int, name: str) -> list:
    return result(SUITE, world, name)


def _one_outcome(per_rank: list[dict], variant: str) -> tuple[str, str, str | None]:
    """The outcome every rank saw for ``variant`` (asserted identical), no data moved."""
    outcomes = [r[variant]["outcome"] for r in per_rank]
    assert outcomes[0] is not None, f"{variant}: no error was raised"
    assert all(o == outcomes[0] for o in outcomes), f"{variant}: ranks differ: {outcomes}"
    moved = [r[variant]["data_collectives"] for r in per_rank]
    assert not any(moved), f"{variant}: a data collective ran before the error on {moved}"
    return outcomes[0]


def _on_last_rank(world: int) -> str:
    return f"CP input check failed on rank {world - 1} of {world} (every rank raises this error): "


# ------------------------------------------------------------------ validation: reference layer

REF = "DeepSeekV4Attention under CP: "
REFERENCE_VARIANTS = {
    # variant: (error class, raised on the last rank only, substrings: argument, value, fix)
    "x_dims": ("HpCpError", True, [REF + "x has 4 dims", "[1, 2, 8, 32]", "expected 3: [B, L"]),
    "x_hidden": ("HpCpError", True, [REF + "x has hidden size 16", "hidden_size is 32"]),
    "x_dtype": (
        "HpCpError",
        True,
        [REF + "dtype mismatch: x torch.float64", "x.to(torch.float32)"],
    ),
    "x_int": ("HpCpError", True, [REF + "x has dtype torch.int64", "floating-point", "x.to("]),
    "x_device": ("HpCpError", True, [REF + "x is on meta", "on cpu", "x.to('cpu')"]),
    "x_dtensor": (
        "HpCpError",
        True,
        [REF + "x is a DTensor", "Replicate()", "x.full_tensor()", "x.to_local()"],
    ),
    "position_ids": (
        "HpCpError",
        True,
        [REF + "position_ids has shape [7]", "8 local rows", "handle.shard(position_ids"],
    ),
    "cu_not_zero": (
        "PlanError",
        True,
        ["cu_seqlens must start at 0", "cu_seqlens[0] = 3 in [3, ", "[0, len(doc0), "],
    ),
    "cu_2d": ("PlanError", True, ["cu_seqlens must be a 1-D", "shape [1, 3]", "torch.tensor(["]),
    "cu_float": ("PlanError", True, ["cu_seqlens must hold integers", "2.5", "integer bound"]),
    "cu_decreasing": (
        "PlanError",
        False,
        ["cu_seqlens must be non-decreasing; got cu_seqlens[2] = 6 < cu_seqlens[1] = 10", "cumsum"],
    ),
    "cu_end": (
        "PlanError",
        False,
        ["cu_seqlens ends at 8 but the ranks hold 8 x", "Pass the global cu_seqlens"],
    ),
    "lb_odd": (
        "PlanError",
        False,
        ["a load_balanced layout over cp=", "got {3w} rows", "pad_value=...", "3 local rows"],
    ),
}


@pytest.mark.parametrize("variant", list(REFERENCE_VARIANTS))
@pytest.mark.parametrize("world", WORLDS)
def test_reference_layer_rejects_bad_input_on_every_rank(world: int, variant: str) -> None:
    per_rank = _case_result(world, "reference_bad_inputs")
    cls, last_only, parts = REFERENCE_VARIANTS[variant]
    got_cls, msg, _ = _one_outcome(per_rank, variant)
    assert got_cls == cls, msg
    if last_only:
        assert msg.startswith(_on_last_rank(world)), msg
    else:
        assert not msg.startswith("CP input check failed"), msg
    for part in parts:
        assert part.replace("{3w}", str(3 * world)) in msg, (part, msg)
    assert all(r["after"] == (2, 8, 32) for r in per_rank), "the group broke after the errors"


def test_cu_seqlens_end_names_the_global_row_count() -> None:
    for world in WORLDS:
        _, msg, _ = _one_outcome(_case_result(world, "reference_bad_inputs"), "cu_end")
        assert msg == (
            f"cu_seqlens ends at 8 but the ranks hold 8 x {world} = {8 * world} rows. Pass the "
            "global cu_seqlens (the same on every rank) and each rank's local rows from "
            "handle.shard(x, 0)."
        )


# ------------------------------------------------------------------ validation: generic adapter

CSA = "patched module under CP: "
CSA_VARIANTS = {
    "query_dims": [CSA + "query has 3 dims (shape [14, 2, 16])", "expected 4: [L, B, heads"],
    "batch": [CSA + "batch differs between the inputs", "key 3 (dim 1 of [14, 3, 1, 16])"],
    "kv_heads": [CSA + "key has 2 heads (dim 2 of [14, 2, 2, 16])", "[L, B, 1, head_dim]"],
    "head_dim": [CSA + "head_dim differs", "key 8 (dim 3 of [14, 2, 1, 8])", "K == V"],
    "rows": [CSA + "local rows differs", "x 13 (dim 0 of [13, 2, 32])", "handle.shard(tensor, 0)"],
    "dtype": [CSA + "dtype mismatch: qr torch.float64, expected torch.float32", "Cast"],
    "extra_args": [CSA + "a module patched by", "got extra arguments (1,)", "those four only"],
}


@pytest.mark.parametrize("variant", list(CSA_VARIANTS))
def test_patched_module_rejects_bad_tensors_on_every_rank(variant: str) -> None:
    per_rank = _case_result(2, "csa_bad_inputs")
    cls, msg, _ = _one_outcome(per_rank, variant)
    assert cls == "HpCpError" and msg.startswith(_on_last_rank(2)), msg
    for part in CSA_VARIANTS[variant]:
        assert part in msg, (part, msg)
    assert all(r["after"] == (14, 2, 2, 16) for r in per_rank)


CU_VARIANTS = {
    # variant: (raised as a failed check on the last rank, substrings)
    "cu_decreasing": (True, ["cu_seqlens must be non-decreasing", "cu_seqlens[2] = 5 <"]),
    "cu_end": (True, ["cu_seqlens ends at 30 but the ranks hold 14 x 2 = 28 rows"]),
    "cu_dims": (True, ["cu_seqlens must be a 1-D sequence", "got shape [1, 3]"]),
    "cu_disagree": (False, ["cu_seqlens per rank [[0, 5, 28], [0, 7, 28]]", "same global"]),
}


@pytest.mark.parametrize("variant", list(CU_VARIANTS))
def test_patched_module_rejects_bad_cu_seqlens_on_every_rank(variant: str) -> None:
    """Packed input through the adapter API: a bad (or another rank's) ``cu_seqlens`` on
    the last rank raises the same PlanError on every rank before any data moves."""
    per_rank = _case_result(2, "csa_bad_inputs")
    cls, msg, _ = _one_outcome(per_rank, variant)
    on_last, parts = CU_VARIANTS[variant]
    assert cls == "PlanError", (cls, msg)
    if on_last:
        assert msg.startswith(_on_last_rank(2)), msg
    else:
        assert msg.startswith("CP ranks were given inconsistent inputs: "), msg
    for part in parts:
        assert part in msg, (part, msg)


# ------------------------------------------------------------------ cross-rank agreement


DEFAULT_KERNEL = DeepSeekV4CPConfig().attention_kernel


def _per_rank(world: int, good: str, odd: str) -> str:
    return "[" + ", ".join([good] * (world - 1) + [odd]) + "]"


def disagreement_parts(world: int, variant: str) -> list[str]:
    total = 8 * world
    cfg = "CPConfig(layout={!r}, attention_kernel={!r}, query_chunk=1024)"
    return {
        "rows": [f"local rows per rank {_per_rank(world, '8', '9')}", "handle.shard(tensor"],
        "batch": [
            "tensor shapes (row dim left out) and dtypes per rank "
            + _per_rank(world, "x [*, 2, 32] torch.float32", "x [*, 3, 32] torch.float32"),
            "same batch size",
        ],
        "dtype": [
            _per_rank(world, "x [*, 2, 32] torch.float32", "x [*, 2, 32] torch.float64"),
            "and dtype",
        ],
        "cu_seqlens": [
            "cu_seqlens per rank " + _per_rank(world, f"[0, 5, {total}]", f"[0, 6, {total}]"),
            "the same global cu_seqlens",
        ],
        "packed_vs_padded": [
            "cu_seqlens per rank " + _per_rank(world, "None", f"[0, 5, {total}]"),
            "or None on every rank",
        ],
        "layout": [
            "CPConfig per rank "
            + _per_rank(
                world,
                cfg.format("contiguous", DEFAULT_KERNEL),
                cfg.format("load_balanced", DEFAULT_KERNEL),
            ),
            "the same CPConfig on every rank",
        ],
        "kernel": [
            "CPConfig per rank "
            + _per_rank(
                world, cfg.format("contiguous", "smallop"), cfg.format("contiguous", "efficient")
            ),
        ],
        "ratio": [
            "layer spec per rank [LayerSpec(compress_ratio=4, ",
            "LayerSpec(compress_ratio=128, window_size=16, has_indexer=False",
            "build the model identically on every rank",
        ],
        "window": ["LayerSpec(compress_ratio=4, window_size=8, ", "window_size"],
    }[variant]


DISAGREEMENTS = [
    "rows",
    "batch",
    "dtype",
    "cu_seqlens",
    "packed_vs_padded",
    "layout",
    "kernel",
    "ratio",
    "window",
]


@pytest.mark.parametrize("variant", DISAGREEMENTS)
@pytest.mark.parametrize("world", WORLDS)
def test_ranks_that_disagree_all_raise_the_same_error(world: int, variant: str) -> None:
    per_rank = _case_result(world, "disagreeing_ranks")
    outcomes = [r[variant]["outcome"] for r in per_rank]
    assert outcomes[0] is not None, "the disagreement went unnoticed"
    assert all(o == outcomes[0] for o in outcomes), outcomes
    assert not any(r[variant]["data_collectives"] for r in per_rank), "data moved first"
    cls, msg, _ = outcomes[0]
    assert cls == "PlanError", msg
    assert msg.startswith("CP ranks were given inconsistent inputs: "), msg
    assert msg.count(" per rank ") == 1, f"only the differing field is listed: {msg}"
    for part in disagreement_parts(world, variant):
        assert part in msg, (part, msg)


# ------------------------------------------------------------------ enable_cp


def test_enable_cp_rejects_meshes_specs_and_a_second_enable() -> None:
    r0, r1 = _case_result(2, "enable_checks")
    for r in (r0, r1):
        cls, msg, _ = r["already_enabled"]
        assert cls == "HpCpError" and "`DeepSeekV4Attention` already runs under CP" in msg
        assert "(enabled with mesh None)" in msg and "call disable_cp(handle)" in msg
        cls, msg, _ = r["float_ratio"]
        assert msg == (
            "hp_cp_layer_spec for `DeepSeekV4Attention` returned LayerSpec.compress_ratio=4.0 "
            "(float); expected an int. Convert it with int(...) in the hook."
        )
    for rank, r in enumerate((r0, r1)):
        _, msg, _ = r["mesh_size"]
        assert msg == (
            "enable_cp(mesh=...) got a DeviceMesh of size 2 (global ranks [0, 1]) whose process "
            f"group has size 1 (global ranks [{rank}]); the CP size must be the same for both. "
            "Build the mesh with init_device_mesh (or pass the ProcessGroup itself)."
        )
        _, msg, _ = r["not_in_mesh"]
        assert msg == (
            f"enable_cp(mesh=...) got a DeviceMesh of global ranks [{1 - rank}] that this "
            f"process (global rank {rank}) is not part of. Pass each rank the CP mesh that "
            "contains it (init_device_mesh(...)['cp'] gives every rank its own)."
        )
    assert r0["not_a_member"] is None  # rank 0 is the group's only member: a group of one
    cls, msg, _ = r1["not_a_member"]
    assert msg.startswith(
        "enable_cp(mesh=...) got GroupMember.NON_GROUP_MEMBER on global rank 1: "
        "dist.new_group(ranks) returns it on ranks outside `ranks`"
    ), msg
    assert "keep the one containing this rank" in msg


# ------------------------------------------------------------------ no hangs

WAITS_IN = {
    "skip": "all_gather_meta",
    "extract_ori_kv": "halo_exchange",
    "compress_main": "slot_exchange",
    "run_attention": "slot_exchange backward",
}
FAULTS = [(2, s) for s in WAITS_IN] + [(3, "skip"), (3, "run_attention")]


@pytest.mark.parametrize(("world", "stage"), FAULTS, ids=[f"cp{w}-{s}" for w, s in FAULTS])
def test_a_failing_rank_makes_the_others_fail_not_hang(world: int, stage: str) -> None:
    per_rank = _case_result(world, f"fault:{stage}")
    bad = per_rank[-1]
    assert bad["error"][0] == "RuntimeError" and "injected fault" in bad["error"][1]
    for rank, r in enumerate(per_rank[:-1]):
        assert r["error"] is not None, f"rank {rank} finished although a peer failed"
        cls, msg, cause = r["error"]
        assert cls == "HpCpError" and cause == "RuntimeError", r["error"]
        assert msg.startswith(
            f"CP collective {WAITS_IN[stage]} failed on rank {rank} of {world} (global rank "
            f"{rank}): a peer rank likely failed or skipped it (RuntimeError: "
        ), msg
        assert "Timed out waiting" in msg  # the original gloo error is quoted
        assert "Look for the first error on the other ranks" in msg
        assert "init_process_group(timeout=...)" in msg
        assert FAULT_TIMEOUT_S * 0.9 <= r["elapsed"] < FAULT_TIMEOUT_S + 30, r["elapsed"]


# ------------------------------------------------------------------ zero gradients

ZERO = [(w, c, how) for w in WORLDS for c, how in zero_grad_cases(w)]


def _masked_single_device(case, how: str) -> dict:
    """One device, eval mode, cotangent zero (``zero``) or kept on rank 0's rows only."""
    layer = build_layer(case).eval()
    x, cu, g = make_inputs(case)
    keep = torch.zeros(case.total, dtype=torch.bool)
    if how == "rank0_only":
        keep[torch.as_tensor(SequenceLayout(case.layout, case.cp, case.total).rank_rows(0))] = 1
    g = g * (keep[:, None] if case.packed else keep[None, :, None])
    x.requires_grad_(True)
    out = layer(x, cu_seqlens=cu)
    params = list(layer.parameters())
    loss = (out.float() * g.float()).sum()
    grads = torch.autograd.grad(loss, [x, *params], allow_unused=True)
    names = [n for n, _ in layer.named_parameters()]
    return {"gx": grads[0], "pgrads": dict(zip(names, grads[1:]))}


@pytest.mark.parametrize(
    ("world", "case", "how"), ZERO, ids=[f"{how}-{c.name}" for _, c, how in ZERO]
)
def test_backward_runs_every_collective_when_gradients_are_zero(world, case, how) -> None:
    per_rank = _case_result(world, zero_grad_name(case, how))
    want_bwd = {"halo_exchange": 1, "halo_exchange_bwd": 1}
    if case.r:
        want_bwd.update(slot_exchange=1, slot_exchange_bwd=1)
    for r in per_rank:  # every rank ran forward and backward collectives once
        assert r["stats"]["collectives"] == want_bwd, (r["cp_rank"], r["stats"]["collectives"])
    rank0 = next(r for r in per_rank if r["cp_rank"] == 0)
    want = _masked_single_device(case, how)
    if how == "zero":
        assert not rank0["gx"].abs().any()
        assert all(not g.abs().any() for g in rank0["pgrads"].values())
        return
    assert rank0["gx"].abs().any(), "the loss on rank 0's rows gave no gradient"
    err = rel_err(rank0["gx"], want["gx"])
    assert err <= 1e-4, f"input gradient relative error {err:.3g}"
    for name, ref in want["pgrads"].items():
        got = rank0["pgrads"][name]
        if ref is None:
            assert not got.abs().any(), name
            continue
        err = rel_err(got, ref)
        assert err <= 1e-4, f"gradient of {name}: relative error {err:.3g}"

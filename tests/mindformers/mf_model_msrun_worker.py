"""msrun worker (4 ranks): the REAL mindformers 2.1.0 ``PyNativeDeepseekV4ForCausalLM`` (tiny,
``mf_real_model``, one MTP layer) trains under hp_cp, every case of
``mf_model_cases.model_cases()``; writes ``<outdir>/rank<r>.json`` after each case.

Every rank builds the same model (seeded weights) and first runs it on one device on one of
the inputs (``REFERENCE_OF_RANK``: loss, logits, every parameter gradient); then each CP group
runs ``enable_cp(model, mesh)`` with the case's layout on its rows (``handle.shard``, padded
as the core pads: inputs 0, loss mask 0, the padding its own document) and the rank holding
the case's reference compares: the loss (the ranks' shares summed), the logits
(``handle.unshard``) and every parameter gradient (summed over the ranks with AllReduce).
Usage: ``msrun ... mf_model_msrun_worker.py OUTDIR``; the tests run these cases in the real
cell's job instead (``mf_real_msrun_worker.py OUTDIR --model-cases``: one msrun start, not two).
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
import numpy as np  # noqa: E402
from mf_model_cases import INPUTS, REFERENCE_OF_RANK, ModelCase, checking_rank, model_cases  # noqa: E402
from mindspore import Tensor, ops  # noqa: E402
from mindspore.communication import (  # noqa: E402
    GlobalComm,
    create_group,
    get_group_size,
    get_rank,
    init,
)

from hp_cp_core import DeepSeekV4CPConfig, disable_cp, enable_cp  # noqa: E402
from hp_cp_mindformers.moe import moe_routers  # noqa: E402
from hp_cp_mindformers.mtp import mtp_owners  # noqa: E402
from hp_cp_mindformers.rope import GlobalPositionRotary  # noqa: E402

if not GlobalComm.INITED:  # already when mf_real_msrun_worker runs these cases in its job
    init()
WORLD_RANK, WORLD = get_rank(), get_group_size()
OUT = sys.argv[1]


class HPMesh:
    """A HyperParallel-style 1-D mesh: ``size()``, ``get_local_rank()``, ``get_group()``."""

    ndim = 1

    def __init__(self, group: str) -> None:
        self.group = group

    def size(self) -> int:
        return get_group_size(self.group)

    def get_local_rank(self) -> int:
        return get_rank(self.group)

    def get_group(self) -> str:
        return self.group


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-30))


def data(name: str) -> dict:
    """The global input ``name`` (the same on every rank): ids, labels, loss mask, ends."""
    spec = INPUTS[name]
    ids, labels = mdl.sample(spec["seq"], seed=len(name), batch=spec["batch"])
    ends = None if spec["ends"] is None else np.asarray(spec["ends"], np.int64)
    return {"ids": ids, "labels": labels, "mask": np.ones(ids.shape, np.float32), "ends": ends}


AUX_LOSS = 0.1
"""The MoE sequence-wise aux loss coefficient of every case but ``odd``: the router takes no
padding mask, so with padding to fit the aux loss counts the padding tokens (see Note [MoE aux
loss under CP] in hp_cp_mindformers.moe); ``odd`` runs without it. 0.1, not a usual 1e-3:
with the routers' counts left per rank (measured at cp 2) the router gradients are then off
by 2e-4 to 1e-3 (1e-2 at 1.0), past the 1e-4 tolerance; with them summed over the group,
5e-7 at 1.0."""


def set_aux_loss(model, name: str) -> None:
    for router in moe_routers(model):
        router.moe_aux_loss_coeff = 0.0 if name == "odd" else AUX_LOSS


def one_device(model, name: str) -> dict:
    set_aux_loss(model, name)
    d = data(name)
    loss, grads = mdl.loss_and_grads(
        model,
        d["ids"],
        d["labels"],
        d["mask"],
        total_tokens=d["mask"].sum(),
        actual_seq_len=d["ends"],
    )
    return {
        "loss": loss,
        "grads": grads,
        "logits": mdl.logits(model, d["ids"], d["labels"], d["ends"]),
    }


GROUPS: dict[tuple[int, int], str] = {}


def group_of(case: ModelCase) -> str:
    if case.part < 0:
        return GlobalComm.WORLD_COMM_GROUP
    key = (case.cp, case.part)
    if key not in GROUPS:
        GROUPS[key] = f"hp_cp_model_{case.cp}_{case.part}"
        create_group(GROUPS[key], case.ranks())
    return GROUPS[key]


def all_reduce(values: np.ndarray, group: str) -> np.ndarray:
    return ops.AllReduce(ops.ReduceOp.SUM, group=group)(Tensor(values)).asnumpy()


def under_cp(model, case: ModelCase, group: str) -> dict:
    """This rank's part of the case under CP; returns the summed loss and gradients and the
    whole logits (on every rank of the group)."""
    d = data(case.data)
    set_aux_loss(model, case.data)
    config = DeepSeekV4CPConfig(layout=case.layout)
    handle = enable_cp(model, HPMesh(group), config)
    res: dict = {"cp_size": handle.cp_size, "cp_rank": handle.cp_rank}
    res["wrapped_mtp"] = sum("construct" in c.__dict__ for c in mtp_owners(model))
    res["routers_cp"] = sorted({r._cp_size for r in moe_routers(model)})  # noqa: SLF001
    res["wrapped_rope"] = sum(
        isinstance(getattr(c, "rotary_pos_emb", None), GlobalPositionRotary)
        for _, c in model.cells_and_names()
    )
    seq = d["ids"].shape[1]
    pad = handle.padding(seq)
    ids = handle.shard(d["ids"], 1, pad_value=0)
    labels = handle.shard(d["labels"], 1, pad_value=0)
    mask = handle.shard(d["mask"], 1, pad_value=0.0)
    ends = None
    if d["ends"] is not None:
        ends = pad.cu_seqlens(np.concatenate([[0], d["ends"]]))[1:]
    elif pad.pad_rows:
        raise AssertionError("a padded batch of a length that needs padding: not a case here")
    t0 = time.time()
    loss, grads = mdl.loss_and_grads(
        model, ids, labels, mask, total_tokens=d["mask"].sum(), actual_seq_len=ends
    )
    res["step_s"] = round(time.time() - t0, 2)
    local_logits = mdl.logits(model, ids, labels, ends)  # [b * L, V]
    b = ids.shape[0]
    logits = handle.unshard(
        Tensor(local_logits.reshape(b, -1, local_logits.shape[-1])), 1, rows=seq
    ).asnumpy()
    res["stats"] = {k: handle.stats()[k] for k in ("bytes_sent", "bytes_recv")}
    disable_cp(handle)
    res["restored_rope"] = not any(
        isinstance(getattr(c, "rotary_pos_emb", None), GlobalPositionRotary)
        for _, c in model.cells_and_names()
    )
    res["restored_mtp"] = not any("construct" in c.__dict__ for c in mtp_owners(model))
    res["routers_cp_after"] = sorted({r._cp_size for r in moe_routers(model)})  # noqa: SLF001
    names = sorted(grads)
    flat = np.concatenate([grads[k].reshape(-1) for k in names] + [np.array([loss])])
    total = all_reduce(flat.astype(np.float32), group)
    res["loss"] = float(total[-1])
    at, res["grads"] = 0, {}
    for k in names:
        n = grads[k].size
        res["grads"][k] = total[at : at + n].reshape(grads[k].shape)
        at += n
    res["logits"] = logits.reshape(-1, logits.shape[-1])
    return res


def run_case(model, case: ModelCase, refs: dict) -> dict:
    group = group_of(case)
    got = under_cp(model, case, group)
    keys = ("cp_size", "cp_rank", "wrapped_rope", "restored_rope", "wrapped_mtp", "restored_mtp")
    keys += ("routers_cp", "routers_cp_after")
    out = {k: got[k] for k in (*keys, "step_s")}
    out["stats"] = got["stats"]
    if WORLD_RANK == checking_rank(case):
        ref = refs[case.data]
        out["loss_ref"], out["loss_cp"] = ref["loss"], got["loss"]
        out["loss_err"] = abs(got["loss"] - ref["loss"]) / abs(ref["loss"])
        out["logits_err"] = rel(got["logits"], ref["logits"])
        out["grad_err"] = {k: rel(got["grads"][k], g) for k, g in ref["grads"].items()}
        scale = max(float(np.abs(g).max()) for g in ref["grads"].values())
        out["grad_err_over_model_scale"] = {
            k: float(np.abs(got["grads"][k] - g).max()) / scale for k, g in ref["grads"].items()
        }
        out["zero_ref_grads"] = [k for k, g in ref["grads"].items() if not np.abs(g).max() > 0]
    return out


def refuse_mean_mtp_loss(model) -> dict:
    """enable_cp at cp 4 on the model with its MTP loss a per-rank mean
    (``calculate_per_token_loss=False``): the error, and whether anything stayed installed."""
    from hp_cp_core import HpCpError

    (owner,) = mtp_owners(model)
    config = owner.config
    before = [n for n, c in model.cells_and_names() if "construct" in c.__dict__]
    config.calculate_per_token_loss = False
    try:
        enable_cp(model, HPMesh(GlobalComm.WORLD_COMM_GROUP))
        out = {"error": None}
    except HpCpError as exc:
        out = {"error": str(exc)}
    finally:
        config.calculate_per_token_loss = True
    out["installed_before"] = before
    out["installed_after"] = [n for n, c in model.cells_and_names() if "construct" in c.__dict__]
    return out


def main(out: str = OUT) -> None:
    """Every case of ``model_cases()`` this rank takes part in; ``<out>/rank<r>.json``."""
    cases = [c for c in model_cases() if WORLD_RANK in c.ranks()]
    report = {"rank": WORLD_RANK, "world": WORLD, "cases": {}}
    path = os.path.join(out, f"rank{WORLD_RANK}.json")
    t0 = time.time()
    model = mdl.tiny_model(mtp=1, seed=5, aux_loss=AUX_LOSS)
    refs = {REFERENCE_OF_RANK[WORLD_RANK]: one_device(model, REFERENCE_OF_RANK[WORLD_RANK])}
    report["reference_s"] = round(time.time() - t0, 2)
    for case in cases:
        try:
            report["cases"][case.name] = run_case(model, case, refs)
        except Exception as exc:  # noqa: BLE001 - reported per case to the pytest side
            report["cases"][case.name] = {
                "error": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": traceback.format_exc()[-4000:],
            }
        with open(path, "w") as fh:
            json.dump(report, fh, indent=1)
    report["mean_mtp_loss_refused"] = refuse_mean_mtp_loss(model)
    report["total_s"] = round(time.time() - t0, 2)
    with open(path, "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()

"""The torch backend's contract driver: the reference layer on real gloo process groups.

One spawned job of 3 ranks runs every case (groups of 1, 2 and 3 ranks side by side); rank 0
of each CP group returns the unsharded output, input gradient and summed parameter gradients,
compared in the pytest process with the single-device layer (``tests/torch/cases.py``).
"""

from __future__ import annotations

import functools
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hp_cp_core.testing.cases import ContractCase

TORCH_TESTS = Path(__file__).resolve().parents[2] / "torch"
WORLD = 3


def _use_torch_tests() -> None:
    if str(TORCH_TESTS) not in sys.path:
        sys.path.insert(0, str(TORCH_TESTS))


def _torch_case(case: ContractCase) -> Any:
    from cases import Case

    return Case(
        case.cp,
        case.r,
        case.layout,
        case.packed,
        window=case.window,
        cu=case.cu_seqlens,
        rows=case.rows,
        seed=case.seed,
        query_chunk=5,
    )


def contract_job(rank: int, world: int, cases: tuple[ContractCase, ...]) -> dict:
    """On ``world`` gloo ranks: CP groups of 1, 2 and 3 ranks, each running its cases."""
    import faulthandler

    import torch.distributed as dist
    from cases import run_reference_layer_cp

    from hp_cp_core import HpCpError

    faulthandler.dump_traceback_later(400, exit=True)
    groups = {cp: dist.new_group(list(range(cp))) for cp in range(1, world)}
    out: dict[str, tuple[str, Any]] = {}
    for case in cases:
        if rank >= case.cp:
            continue
        mesh = groups.get(case.cp)
        try:
            res = run_reference_layer_cp(
                _torch_case(case),
                mesh,
                config=case.config(query_chunk=5),
                cu_override=case.cu_for_rank(rank) if case.bad_rank is not None else None,
            )
            out[case.name] = ("ok", res)
        except HpCpError as exc:
            if case.bad_rank is None:
                out[case.name] = ("error", f"rank {rank}:\n{traceback.format_exc()}")
                break  # peers may wait in this case's collectives: leave
            err = {"error": f"{type(exc).__name__}: {exc}"}
            err["error_types"] = [c.__name__ for c in type(exc).__mro__]
            err["cp_rank"] = dist.get_rank(mesh) if mesh is not None else rank
            out[case.name] = ("ok", err)
        except Exception:  # noqa: BLE001 - reported by the test of this case
            out[case.name] = ("error", f"rank {rank}:\n{traceback.format_exc()}")
            break
    faulthandler.cancel_dump_traceback_later()
    return out


class TorchDriver:
    name = "torch"
    framework = "torch"
    max_cp = WORLD
    rtol = 1e-4  # float32 reductions in another order (the torch suite's own bound)
    differentiable = True

    @functools.cache  # noqa: B019 - one driver object per session
    def _job(self, cases: tuple[ContractCase, ...]) -> Any:
        _use_torch_tests()
        from dist_utils import run_ranks

        return run_ranks(WORLD, contract_job, cases, timeout=420)

    def run(self, cases: Sequence[ContractCase]) -> dict[str, Any]:
        _use_torch_tests()
        from cases import single_device

        per_rank = self._job(tuple(cases))
        results: dict[str, Any] = {}
        for case in cases:
            got = [r[case.name] for r in per_rank if case.name in r]
            errors = [v for s, v in got if s != "ok"]
            if errors:
                results[case.name] = errors[0]
                continue
            if len(got) != case.cp:
                results[case.name] = f"{len(got)} of {case.cp} ranks reported {case.name}"
                continue
            reports = [_report(v) for _, v in got]
            if case.bad_rank is None:
                rank0 = next(v for _, v in got if v["cp_rank"] == 0)
                reports[0]["compare"] = _compare(rank0, single_device(_torch_case(case)))
            results[case.name] = sorted(reports, key=lambda r: r["cp_rank"])
        return results


def _report(res: dict) -> dict:
    if "error" in res:
        return res
    return {
        "cp_rank": res["cp_rank"],
        "stats_forward": res["stats_fwd"],
        "stats": res["stats_bwd"],
        "restored": res["restored"],
        "trace": [_kind(where) for where in res["trace"]],
    }


def _kind(where: str) -> str:
    """A desync-log entry (``"all_gather backward (reduce_scatter) #4 (layer 0)"``) as the
    stats schema's collective kind (``"all_gather_bwd"``), so ranks' traces compare."""
    name = where.split(" #")[0]
    base, _, rest = name.partition(" backward")
    return f"{base}_bwd" if rest or name.endswith(" backward") else base


def _compare(got: dict, want: dict) -> dict:
    import torch

    def arr(t: Any, like: Any) -> Any:
        t = torch.zeros_like(like) if t is None else t
        return t.detach().double().numpy()

    pairs = {
        "out": (arr(got["out"], want["out"]), arr(want["out"], want["out"])),
        "grad x": (arr(got["gx"], want["gx"]), arr(want["gx"], want["gx"])),
    }
    for name, ref in want["pgrads"].items():
        cp = got["pgrads"][name]
        pairs[f"grad {name}"] = (arr(cp, cp), arr(ref, cp))
    return pairs

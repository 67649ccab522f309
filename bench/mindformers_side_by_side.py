"""``nox -s bench_mindformers``: hp_cp and MindFormers' own CSA CP side by side on the real
mindformers 2.1.0 cell (MindSpore CPU, one msrun job of ``--cp`` ranks); writes
``bench-mindformers.json``.

Keys: ``mf_anchor_step_time_over_ours`` (forward + backward wall time of the slowest rank,
summed over the cases, anchor / hp_cp), ``mf_anchor_busiest_bytes_over_ours`` (bytes received by
the busiest rank per step, summed over the cases, anchor / hp_cp), ``mf_anchor_max_rel_err``
and ``mf_ours_max_rel_err`` (largest relative error against the same cell on one device over
outputs, input gradients and parameter gradients, all cases), the same without the indexer's
parameters, per-case numbers under ``cases``, and ``mf_anchor_refuses``: what the anchor
refuses (packed input, local rows not a multiple of r, load-balanced layout), each with the
anchor's own message. The worker is ``tests/mindformers/mf_anchor_worker.py``.

``--model-cp N`` (default 2; 0 skips it) adds the same comparison on the WHOLE model
(``PyNativeDeepseekV4ForCausalLM``, tiny; MindFormers' own CP applied as its
``_apply_cp_to_block`` does), in a second msrun job of N ranks
(``tests/mindformers/mf_model_anchor_worker.py``), under ``model``:
``mf_model_anchor_step_time_over_ours``, ``mf_model_anchor_busiest_bytes_over_ours``, the
loss and gradient errors of each against one device. ``--model-only`` runs just that job
(into the existing file, if any).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests", "mindformers")
sys.path.insert(0, TESTS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--out", default="bench-mindformers.json")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--model-cp", type=int, default=2)
    parser.add_argument("--model-only", action="store_true")
    args = parser.parse_args()
    if args.model_only:
        out = {"command": "nox -s bench_mindformers -- --model-only"}
        if os.path.exists(args.out):
            with open(args.out) as fh:
                out = json.load(fh)
        out.update(model_side_by_side(args.model_cp, args.timeout))
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)
        print(json.dumps({k: v for k, v in out.items() if k.startswith("mf_model")}, indent=1))
        return

    from mf_msrun_job import run_msrun

    job = run_msrun(os.path.join(TESTS, "mf_anchor_worker.py"), args.cp, args.timeout)
    reports = job["reports"]
    if sorted(reports) != list(range(args.cp)):
        raise SystemExit(f"ranks {sorted(reports)} reported (rc {job['rc']}); logs: {job['dir']}")
    cases = {}
    totals = {"ours": [0.0, 0], "anchor": [0.0, 0]}
    for name in reports[0]["cases"]:
        per_rank = [reports[r]["cases"][name] for r in range(args.cp)]
        for rep in per_rank:
            if "error" in rep:
                raise SystemExit(f"{name}: {rep['error']}\n{rep['traceback']}\nlogs: {job['dir']}")
        case = {k: per_rank[0][k] for k in ("r", "seq", "batch", "local_rows")}
        for kind in ("ours", "anchor"):
            seconds = max(rep[kind]["seconds"] for rep in per_rank)
            busiest = max(rep[kind]["bytes_recv"] for rep in per_rank)
            totals[kind][0] += seconds
            totals[kind][1] += busiest
            case[kind] = {
                "step_seconds_slowest_rank": seconds,
                "bytes_recv_busiest_rank": busiest,
                **{
                    k: max(rep[kind][k] for rep in per_rank)
                    for k in ("max_rel_err", "max_rel_err_indexer_params", "max_rel_err_other")
                },
            }
        cases[name] = case

    def worst(kind: str, key: str) -> float:
        return max(c[kind][key] for c in cases.values())

    out = {
        "command": "nox -s bench_mindformers",
        "cp": args.cp,
        "mf_anchor_step_time_over_ours": totals["anchor"][0] / totals["ours"][0],
        "mf_anchor_busiest_bytes_over_ours": totals["anchor"][1] / totals["ours"][1],
        "mf_anchor_max_rel_err": worst("anchor", "max_rel_err"),
        "mf_ours_max_rel_err": worst("ours", "max_rel_err"),
        "mf_anchor_max_rel_err_indexer_params": worst("anchor", "max_rel_err_indexer_params"),
        "mf_ours_max_rel_err_indexer_params": worst("ours", "max_rel_err_indexer_params"),
        "mf_anchor_max_rel_err_other": worst("anchor", "max_rel_err_other"),
        "mf_ours_max_rel_err_other": worst("ours", "max_rel_err_other"),
        "cases": cases,
        "mf_anchor_refuses": reports[0].get("anchor_refuses", {}),
    }
    if args.model_cp:
        out.update(model_side_by_side(args.model_cp, args.timeout))
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k.startswith("mf_")}, indent=1))


def model_side_by_side(cp: int, timeout: int) -> dict:
    """The whole-model job: ``mf_model_*`` keys and the per-rank numbers under ``model``."""
    from mf_msrun_job import run_msrun

    job = run_msrun(os.path.join(TESTS, "mf_model_anchor_worker.py"), cp, timeout)
    reports = job["reports"]
    if sorted(reports) != list(range(cp)):
        raise SystemExit(f"ranks {sorted(reports)} reported (rc {job['rc']}); logs: {job['dir']}")
    for rep in reports.values():
        if "error" in rep:
            raise SystemExit(f"model: {rep['error']}\n{rep['traceback']}\nlogs: {job['dir']}")
    per_rank = [reports[r] for r in range(cp)]
    model = {"cp": cp, "seq": per_rank[0]["seq"], "local_rows": per_rank[0]["local_rows"]}
    model["anchor_blocks"] = per_rank[0]["anchor_blocks"]
    for kind in ("ours", "anchor"):
        model[kind] = {
            "step_seconds_slowest_rank": max(r[kind]["seconds"] for r in per_rank),
            "bytes_recv_busiest_rank": max(r[kind]["bytes_recv"] for r in per_rank),
            **{
                k: per_rank[0][kind][k]
                for k in (
                    "loss_rel_err",
                    "max_grad_rel_err",
                    "max_grad_rel_err_indexer_params",
                    "max_grad_rel_err_other",
                    "worst_param",
                    "max_grad_err_over_model_scale",
                    "max_grad_rel_err_not_tiny",
                    "tiny_grads",
                )
            },
        }
    model["one_device_seconds"] = max(r["one_device_seconds"] for r in per_rank)
    ours, anchor = model["ours"], model["anchor"]
    return {
        "mf_model_anchor_step_time_over_ours": anchor["step_seconds_slowest_rank"]
        / ours["step_seconds_slowest_rank"],
        "mf_model_anchor_busiest_bytes_over_ours": anchor["bytes_recv_busiest_rank"]
        / ours["bytes_recv_busiest_rank"],
        "mf_model_anchor_loss_rel_err": anchor["loss_rel_err"],
        "mf_model_ours_loss_rel_err": ours["loss_rel_err"],
        "mf_model_anchor_max_grad_rel_err": anchor["max_grad_rel_err"],
        "mf_model_ours_max_grad_rel_err": ours["max_grad_rel_err"],
        "mf_model_anchor_max_grad_rel_err_not_tiny": anchor["max_grad_rel_err_not_tiny"],
        "mf_model_ours_max_grad_rel_err_not_tiny": ours["max_grad_rel_err_not_tiny"],
        "mf_model_anchor_max_grad_rel_err_indexer_params": anchor[
            "max_grad_rel_err_indexer_params"
        ],
        "mf_model_ours_max_grad_rel_err_indexer_params": ours["max_grad_rel_err_indexer_params"],
        "model": model,
    }


if __name__ == "__main__":
    main()

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
    args = parser.parse_args()

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
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k.startswith("mf_")}, indent=1))


if __name__ == "__main__":
    main()

"""msrun worker (4 ranks): the REAL mindformers 2.1.0 ``CompressedSparseAttention`` under CP, every
case of ``mf_cases.real_cases()`` (cp = 4 on the world group, cp = 2 on two sub-groups).

Per case, every rank of the CP group builds the same real cell (seeded weights) in training
mode; the group's first rank runs it on one device (once per job for the two layouts of the
same r and inputs; output, the indexer loss it logs in mindformers' indexer-loss tracker,
every input and parameter gradient), then every rank runs it under CP on its rows and
compares (``mf_msrun_worker.run_case``). Usage:
``msrun ... mf_real_msrun_worker.py OUTDIR [--model-cases] [CASE-SUBSTRINGS]``; with
``--model-cases`` the same job then runs the whole-model cases of ``mf_model_msrun_worker`` into
``OUTDIR/model`` (the tests do: one msrun start for both suites).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mf_real_env as env  # noqa: E402  (stubs, CPU stand-ins, the real classes)

if env.SKIP_REASON or env.IMPORT_ERROR:
    raise SystemExit(f"the real mindformers cell cannot run: {env.SKIP_REASON or env.IMPORT_ERROR}")

import mf_cpu_standins  # noqa: E402
import mf_msrun_worker as w  # noqa: E402  (communication init)
import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
from mf_cases import Case, real_cases  # noqa: E402
from mindspore import Tensor  # noqa: E402

LOSS_COEFF = 0.5


def make_real_cell(case: Case):
    env.forget_logged_indexer_losses()  # e.g. the previous case's check that disable_cp restored
    return env.real_cell(case.r, train=case.train, loss_coeff=LOSS_COEFF, seed=7)


def tracked_loss(cell) -> float:
    value = env.logged_indexer_loss(cell.layer_number)
    if value is None:
        raise AssertionError("the real cell logged no indexer loss in mindformers' tracker")
    return value


def check_all_gather_standin() -> dict:
    """The ``comm.all_gather_into_tensor`` stand-in against its formula on the world group:
    forward = every rank's rows, rank-major; backward = the sum over ranks of the gradient of
    this rank's slice."""
    rank, world = w.WORLD_RANK, w.WORLD
    mine = np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * rank
    weight = np.random.default_rng(5).standard_normal((2 * world, 3)).astype(np.float32)

    def loss(t):
        out, _ = mf_cpu_standins.all_gather_into_tensor(None, t)
        return (out * Tensor(weight)).sum(), out

    (_, out), grad = ms.value_and_grad(loss, has_aux=True)(Tensor(mine))
    want = np.concatenate(
        [np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * k for k in range(world)]
    )
    return {
        "forward_err": float(np.abs(out.asnumpy() - want).max()),
        "backward_err": float(
            np.abs(grad.asnumpy() - world * weight[2 * rank : 2 * rank + 2]).max()
        ),
    }


def run_model_cases(out: str) -> None:
    """The whole-model cases (``mf_model_msrun_worker.main``) after the real-cell cases, with
    the indexer-loss log they left forgotten."""
    import mf_model_msrun_worker as model  # noqa: PLC0415 - its module state is for this part

    env.forget_logged_indexer_losses()
    os.makedirs(out, exist_ok=True)
    model.main(out)


MODEL_CASES = "--model-cases"


if __name__ == "__main__":
    with_model = MODEL_CASES in sys.argv
    if with_model:
        sys.argv.remove(MODEL_CASES)  # run_all reads the case substrings from sys.argv[2]
    extra = {"standin_all_gather_into_tensor": check_all_gather_standin()}
    w.run_all(real_cases(), make_real_cell, tracked_loss, extra)
    if with_model:
        run_model_cases(os.path.join(w.OUT, "model"))

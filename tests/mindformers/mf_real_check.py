"""Run in a fresh interpreter by ``test_real_mindformers.py``: the REAL mindformers 2.1.0
``CompressedSparseAttention`` on MindSpore 2.10 CPU (``mf_real_env``: stubs and CPU stand-ins).
Prints one JSON line.

Checks: the adapter maps a real instance's attributes (``compressor``, ``indexer.compressor``,
``window_size``, ``compress_ratio``, ``attn_sink``, ``apply_dsa_kernel_fusion`` in place of
``force_unfused``); the CP stages on a group of one (real compressors, real
``forward_before_topk``, real ``unfused_compressed_sparse_attn``) reproduce the real cell's own
output and gradients, padded and packed, r = 0, 4, 128; the project's copy of the cell
(``tests/mindformers/mf_reference.py``) equals the real cell with the same weights in training mode
(output, logged indexer loss, every gradient); and what MindFormers' own CSA CP refuses.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mf_real_env as env  # noqa: E402  (stubs, CPU stand-ins, the real classes)

REPORT: dict = {}


def emit() -> None:
    print(json.dumps(REPORT))


if env.SKIP_REASON or env.IMPORT_ERROR:
    REPORT["skip" if env.SKIP_REASON else "import_error"] = env.SKIP_REASON or env.IMPORT_ERROR
    emit()
    sys.exit(0)

import mf_reference as ref  # noqa: E402
import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
from mindspore import Tensor  # noqa: E402

from hp_cp_core import DeepSeekV4CPConfig, DeepSeekV4CPForward  # noqa: E402
from hp_cp_core.plugins import PluginHost  # noqa: E402
from hp_cp_mindformers import _plugin  # noqa: E402
from hp_cp_mindformers.adapter import (  # noqa: E402
    MindFormersDeepSeekV4CSAAdapter,
    _primitive,
    adapter_for,
)
from hp_cp_mindformers.backend import (  # noqa: E402
    Capabilities,
    MeshInfo,
    MindSporeBackend,
    MindSporeGroup,
)


def real_cell(r: int):
    return env.real_cell(r, train=False)


def mapping(cell) -> dict:
    a = adapter_for(cell)
    spec = a.layer_spec()
    return {
        "type": f"{type(cell).__module__}.{type(cell).__name__}",
        "is_adapter": isinstance(a, MindFormersDeepSeekV4CSAAdapter),
        "compressor": a.module.compressor is cell.compressor,
        "indexer_compressor": bool(
            cell.indexer is not None and a.module.indexer.compressor is cell.indexer.compressor
        ),
        "has_indexer": a.has_indexer,
        "window_size": [a.window_size, int(cell.window_size)],
        "compress_ratio": [a.compress_ratio, int(cell.compress_ratio)],
        "attn_sink": tuple(cell.attn_sink.shape) == (4,),
        "has_force_unfused_attr": hasattr(cell, "force_unfused"),
        "apply_dsa_kernel_fusion": bool(cell.apply_dsa_kernel_fusion),
        "force_unfused": a.force_unfused,
        "spec": [spec.compress_ratio, spec.window_size, spec.has_indexer, spec.packed_grid],
        "attn_fn": _primitive(cell, "unfused_compressed_sparse_attn").__module__,
    }


def rel(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def parity(cell, seq: int, ends) -> dict:
    host = PluginHost(autoload=False)
    host.add(_plugin, "mindformers")
    rng = np.random.default_rng(seq)
    shapes = [(seq, 1, 4, 32), (seq, 1, 1, 32), (seq, 1, 64), (seq, 1, 48)]
    args = [Tensor(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    cot = Tensor(rng.standard_normal(shapes[0]).astype(np.float32))
    asl = Tensor(np.array(ends, np.int32)) if ends else None
    params = cell.trainable_params()
    group = MindSporeGroup(MeshInfo(None, 0, 1), Capabilities("CPU", True, False, False))
    backend = MindSporeBackend(_plugin.find_layers, _plugin.install)
    fwd = DeepSeekV4CPForward(
        cell,
        host.hooks,
        backend,
        group,
        host.hooks.layer_spec(cell),
        DeepSeekV4CPConfig(query_chunk=6, single_rank_bypass=False),
    )
    cu = MindFormersDeepSeekV4CSAAdapter(cell).cu_seqlens(asl, args[0], 1)
    outs = []

    def own(*a):
        outs.append(cell(*a, asl))
        return (outs[-1] * cot).sum()

    def cp(*a):
        outs.append(fwd(*a, cu_seqlens=cu))
        return (outs[-1] * cot).sum()

    _, (gi0, gp0) = ms.value_and_grad(own, (0, 1, 2, 3), params)(*args)
    _, (gi1, gp1) = ms.value_and_grad(cp, (0, 1, 2, 3), params)(*args)
    grads = [rel(a.asnumpy(), b.asnumpy()) for a, b in [*zip(gi1, gi0), *zip(gp1, gp0)]]
    return {"out": rel(outs[1].asnumpy(), outs[0].asnumpy()), "grad": max(grads)}


def copy_vs_real(r: int, seq: int, ends) -> dict:
    """The project's copy of the cell (``tests/mindformers/mf_reference.py``) against the real cell
    with the same weights, in training mode (indexer KL loss, coefficient 0.5): outputs, the
    logged loss and every gradient."""
    real = env.real_cell(r, train=True, loss_coeff=0.5, seed=11)
    cfg = ref.ReferenceCSAConfig(layernorm_epsilon=1e-5, dsa_indexer_loss_coeff=0.5)
    copy = ref.CompressedSparseAttention(cfg, None, 2, None, real.rotary_pos_emb, r)
    copy.set_train(True)
    want = {p.name: p for p in real.trainable_params()}
    got = {p.name: p for p in copy.trainable_params()}
    res = {"names_equal": sorted(want) == sorted(got)}
    for name, p in got.items():
        if name in want:
            p.set_data(Tensor(want[name].asnumpy()))
    rng = np.random.default_rng(seq + 1)
    b = 1 if ends else 2
    shapes = [(seq, b, 4, 32), (seq, b, 1, 32), (seq, b, 64), (seq, b, 48)]
    args = [Tensor(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    cot = Tensor(rng.standard_normal(shapes[0]).astype(np.float32))
    asl = Tensor(np.array(ends, np.int32)) if ends else None
    runs = []
    for cell in (real, copy):
        params = sorted(cell.trainable_params(), key=lambda p: p.name)
        outs = []

        def f(*a, cell=cell, outs=outs):
            outs.append(cell(*a, asl))
            return (outs[-1] * cot).sum()

        _, (gi, gp) = ms.value_and_grad(f, (0, 1, 2, 3), params)(*args)
        loss = env.logged_indexer_loss(2) if cell is real else copy.last_indexer_loss
        loss = (
            None
            if loss is None
            else float(np.asarray(loss.asnumpy() if hasattr(loss, "asnumpy") else loss))
        )
        runs.append((outs[0].asnumpy(), [g.asnumpy() for g in (*gi, *gp)], loss))
    (o0, g0, l0), (o1, g1, l1) = runs
    res["out"] = rel(o1, o0)
    res["grad"] = max(rel(a, b) for a, b in zip(g1, g0))
    res["loss"] = None if l0 is None or l1 is None else abs(l1 - l0) / max(abs(l0), 1e-30)
    res["loss_real"] = l0
    return res


def main() -> None:
    REPORT["mapping"] = {}
    REPORT["parity"] = {}
    for r, seq, ends in (
        (0, 20, (7, 20)),
        (4, 22, None),
        (4, 24, (6, 13, 24)),
        (128, 300, None),
        (128, 400, (130, 400)),
    ):
        cell = real_cell(r)
        REPORT["mapping"][str(r)] = mapping(cell)
        REPORT["parity"][f"r{r}-S{seq}-{'packed' if ends else 'padded'}"] = parity(cell, seq, ends)
    REPORT["copy_vs_real"] = {}
    for r, seq, ends in (
        (0, 20, None),
        (4, 22, None),
        (4, 24, (6, 13, 24)),
        (128, 300, (130, 300)),
    ):
        name = f"r{r}-S{seq}-{'packed' if ends else 'padded'}"
        REPORT["copy_vs_real"][name] = copy_vs_real(r, seq, ends)
    REPORT["anchor_refuses"] = env.anchor_refusals()
    emit()


if __name__ == "__main__":
    main()

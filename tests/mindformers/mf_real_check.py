"""Run in a fresh interpreter by ``test_real_mindformers.py``: the adapter against the REAL
mindformers 2.1.0 ``CompressedSparseAttention`` on MindSpore 2.10 CPU. Prints one JSON line.

mindformers 2.1.0 is installed with ``--no-deps``: its package ``__init__`` needs ``pyyaml``,
``regex`` and ``deprecated`` (reported as ``skip`` when missing) and imports ``hyper_parallel``
(not on PyPI) and a few heavy packages unused here, which are stubbed when absent. Running the
real cell on CPU needs stand-ins for kernels MindSpore 2.10 CPU lacks (``mint.arange``,
``mint.full``, ``mint.roll``, ``mint.topk``, ``mint.stack``, ``mint.outer``,
``mint.ones_like``, ``ops.rms_norm``) and a slicing ``mint.split`` (its CPU backward is wrong);
they are installed here only, in this process.

Checks: the adapter maps a real instance's attributes (``compressor``, ``indexer.compressor``,
``window_size``, ``compress_ratio``, ``attn_sink``, ``apply_dsa_kernel_fusion`` in place of
``force_unfused``) and the CP stages on a group of one (real compressors, real
``forward_before_topk``, real ``unfused_compressed_sparse_attn``) reproduce the real cell's own
output and gradients, padded and packed, r = 0, 4, 128.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
import types

REPORT: dict = {}


def emit() -> None:
    print(json.dumps(REPORT))


for need in ("yaml", "regex", "deprecated"):
    if importlib.util.find_spec(need) is None:
        REPORT["skip"] = (
            f"mindformers 2.1.0 cannot be imported without `{need}` (install pyyaml, regex and "
            "deprecated next to `mindformers==2.1.0 --no-deps`)"
        )
        emit()
        sys.exit(0)

ALWAYS_STUB = ["hyper_parallel"]
STUB_IF_MISSING = [
    "requests",
    "jieba",
    "rouge_chinese",
    "datasets",
    "tokenizers",
    "tqdm",
    "sentencepiece",
    "tiktoken",
    "mindpet",
    "urllib3",
    "pyarrow",
    "tensorboardX",
]
STUBS = ALWAYS_STUB + [m for m in STUB_IF_MISSING if importlib.util.find_spec(m) is None]


class _Dummy:
    def __init__(self, *a, **k) -> None:
        pass

    def __call__(self, *a, **k):
        return None


class _Any(types.ModuleType):
    def __getattr__(self, k):
        if k.startswith("__") or (
            self.__name__.endswith("custom_ops.experimental") and k.startswith("npu_")
        ):
            raise AttributeError(k)
        return type(k, (_Dummy,), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if any(name == r or name.startswith(r + ".") for r in STUBS):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Any(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, m):
        pass


sys.meta_path.insert(0, _Finder())

import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
from mindspore import Tensor, mint, ops  # noqa: E402
from mindspore import dtype as mstype  # noqa: E402

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")


# ---- CPU stand-ins for kernels the real cell uses (installed before building it) -------------
def _arange(start=0, end=None, step=1, *, dtype=None):
    if end is None:
        start, end = 0, start
    return Tensor(np.arange(start, end, step), dtype or mstype.int64)


def _full(size, fill_value, *, dtype=None):
    return ops.full(tuple(size), fill_value, dtype=dtype or mstype.float32)


def _roll(t, shifts, dims):
    s = shifts % t.shape[0]
    return mint.cat([t[t.shape[0] - s :], t[: t.shape[0] - s]], 0) if s else t


def _topk(x, k, dim=-1, largest=True, sorted=True):
    idx = np.argsort(-x.asnumpy(), axis=-1, kind="stable")[..., :k].astype(np.int64)
    return mint.gather(x, -1, Tensor(idx)), Tensor(idx)


def _split(t, split_size_or_sections, dim=0):
    sizes = split_size_or_sections
    n = t.shape[dim]
    if isinstance(sizes, int):
        sizes = [sizes] * (n // sizes) + ([n % sizes] if n % sizes else [])
    out, o = [], 0
    for s in sizes:
        out.append(ops.narrow(t, dim, o, s))
        o += s
    return tuple(out)


def _rms_norm(x, gamma, epsilon=1e-6):
    x32 = ops.cast(x, mstype.float32)
    r = ops.rsqrt(mint.mean(x32 * x32, dim=-1, keepdim=True) + epsilon)
    return ops.cast(x32 * r * gamma, x.dtype), r


mint.arange, mint.full, mint.roll, mint.topk, mint.split = _arange, _full, _roll, _topk, _split
mint.stack = lambda ts, dim=0: ops.stack(ts, dim)
mint.outer = lambda a, b: mint.unsqueeze(a, 1) * mint.unsqueeze(b, 0)
mint.ones_like = ops.ones_like
if not hasattr(Tensor, "detach"):
    Tensor.detach = lambda self: ops.stop_gradient(self)

try:
    import mindformers.pynative.layers.layer_norm as mf_ln
    from mindformers.parallel_core.transformer_config import MLATransformerConfig
    from mindformers.pynative.base_models.gpt.experimental_attention_variant_module_specs import (
        get_dsv4_hybrid_module_spec,
    )
    from mindformers.pynative.transformers.experimental_attention_variant import csa as mf_csa
except Exception as exc:  # noqa: BLE001 - reported to the test
    REPORT["import_error"] = f"{type(exc).__name__}: {exc}"
    emit()
    sys.exit(0)

mf_ln.rms_norm = _rms_norm
mf_csa.save_to_indexer_losses_tracker = lambda *a, **k: None

from hp_cp_core import DeepSeekV4CPConfig, DeepSeekV4CPForward  # noqa: E402
from hp_cp_core.plugins import PluginHost  # noqa: E402
from hp_cp_mindformers import _plugin  # noqa: E402
from hp_cp_mindformers import reference as ref  # noqa: E402
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

CFG = MLATransformerConfig(
    num_layers=3,
    num_attention_heads=4,
    hidden_size=64,
    multi_latent_attention=True,
    experimental_attention_variant="dsv4_hybrid",
    csa_compress_ratios=[0, 4, 128],
    qk_head_dim=24,
    qk_pos_emb_head_dim=8,
    v_head_dim=32,
    kv_lora_rank=32,
    q_lora_rank=48,
    dsa_indexer_n_heads=4,
    dsa_indexer_head_dim=16,
    dsa_indexer_topk=4,
    csa_window_size=8,
    o_groups=2,
    o_lora_rank=16,
    apply_dsa_kernel_fusion=False,
    params_dtype="float32",
    compute_dtype="float32",
    layernorm_compute_dtype="float32",
    rotary_dtype="float32",
    use_flash_attention=False,
    layernorm_epsilon=1e-5,
)
SUB = get_dsv4_hybrid_module_spec().submodules.core_attention.submodules
ROPE = ref.ReferenceRotaryEmbedding(8, 40000.0)


def real_cell(r: int):
    cell = mf_csa.CompressedSparseAttention(CFG, SUB, 1, None, ROPE, r)
    rng = np.random.default_rng(r)
    for p in cell.trainable_params():  # the real init is empty / zeros
        p.set_data(Tensor((0.3 * rng.standard_normal(p.shape)).astype(np.float32)))
    cell.set_train(False)
    return cell


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
        DeepSeekV4CPConfig(query_chunk=6),
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
    emit()


if __name__ == "__main__":
    main()

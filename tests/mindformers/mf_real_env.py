"""Importing this module makes the REAL mindformers 2.1.0 cells runnable on MindSpore 2.10 CPU in
this process (workers only: it changes module state). Used by ``mf_real_check.py``, the real-cell
msrun worker ``mf_real_msrun_worker.py`` and the side-by-side bench ``mf_anchor_worker.py``.

mindformers 2.1.0 is installed with ``--no-deps``: its package ``__init__`` needs ``pyyaml``,
``regex`` and ``deprecated`` (``MISSING`` names the first one absent) and imports
``hyper_parallel`` (not on PyPI) and a few heavy packages unused here, which are stubbed when
absent. ``mf_cpu_standins.install()`` then puts CPU stand-ins in place for the kernels MindSpore
2.10 CPU lacks. ``real_cell(r, train=...)`` builds a real ``CompressedSparseAttention`` with
seeded weights (the real init is empty / zeros), the same on every rank.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

MISSING = next(
    (m for m in ("yaml", "regex", "deprecated") if importlib.util.find_spec(m) is None), None
)
SKIP_REASON = (
    f"mindformers 2.1.0 cannot be imported without `{MISSING}` (install pyyaml, regex and "
    "deprecated next to `mindformers==2.1.0 --no-deps`)"
    if MISSING
    else None
)
if SKIP_REASON is None and importlib.util.find_spec("mindformers") is None:
    SKIP_REASON = "mindformers is not installed (`pip install --no-deps mindformers==2.1.0`)"

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
    """Any class a stubbed module is asked for (``hyper_parallel.DTensor``, ...)."""

    def __init__(self, *a, **k) -> None:
        pass

    def __call__(self, *a, **k):
        return None


class _Any(types.ModuleType):
    def __getattr__(self, k):
        if k.startswith("__") or (
            self.__name__.endswith("custom_ops.experimental") and k.startswith("npu_")
        ):
            raise AttributeError(k)  # the fused NPU ops: "unavailable" (None) in mindformers
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


IMPORT_ERROR: str | None = None
mf_csa = MLATransformerConfig = SUBMODULES = None

if SKIP_REASON is None:
    sys.meta_path.insert(0, _Finder())
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from mf_cpu_threads import limit_cpu_threads

    limit_cpu_threads()
    if "hyper_parallel" in STUBS:
        import hyper_parallel.platform as _hp_platform

        class _CPUPlatform:
            """hyper_parallel's platform (not on PyPI) for the one call mindformers' MoE router
            makes under CP: the sum of its detached token counts over the CP group."""

            @staticmethod
            def differentiable_all_reduce(tensor, op, group):
                assert op == "sum", op
                return ms.ops.AllReduce(ms.ops.ReduceOp.SUM, group=group)(tensor)

        _hp_platform.get_platform = _CPUPlatform
    try:
        from mindformers.parallel_core.transformer_config import MLATransformerConfig
        from mindformers.pynative.base_models.gpt.experimental_attention_variant_module_specs import (  # noqa: E501
            get_dsv4_hybrid_module_spec,
        )
        from mindformers.pynative.transformers.experimental_attention_variant import csa as mf_csa
    except Exception as exc:  # noqa: BLE001 - reported to the test
        IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import mf_cpu_standins

        mf_cpu_standins.install()
        SUBMODULES = get_dsv4_hybrid_module_spec().submodules.core_attention.submodules


def real_config(loss_coeff: float = 0.0):
    """A small fp32 ``MLATransformerConfig`` (window 8, 4 heads, indexer top-k 4)."""
    return MLATransformerConfig(
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
        dsa_indexer_loss_coeff=loss_coeff,
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


def real_cell(r: int, *, train: bool = False, loss_coeff: float = 0.0, seed: int | None = None):
    """A real ``CompressedSparseAttention`` of ratio ``r`` (layer 2 of 3), seeded weights."""
    import mf_reference as ref

    rope = ref.ReferenceRotaryEmbedding(8, 40000.0)
    cell = mf_csa.CompressedSparseAttention(real_config(loss_coeff), SUBMODULES, 2, None, rope, r)
    rng = np.random.default_rng(r if seed is None else seed)
    for p in cell.trainable_params():
        p.set_data(Tensor((0.3 * rng.standard_normal(p.shape)).astype(np.float32)))
    cell.set_train(train)
    return cell


class TrackerLog:
    """Stands between the real cell (and the adapter, which logs where the cell does) and
    mindformers' ``save_to_indexer_losses_tracker``: records each ``(layer, value)`` it is
    handed, then calls the tracker (which sums what it gets until the trainer reads it). The
    record tells one forward's value apart and shows a layer that logs twice."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.logged: list[tuple[int, float]] = []

    def __call__(self, loss, layer_number, num_layers):
        self.logged.append((int(layer_number), float(np.asarray(loss.asnumpy()))))
        return self.inner(loss, layer_number, num_layers)


TRACKER_LOG = None
if mf_csa is not None:
    TRACKER_LOG = TrackerLog(mf_csa.save_to_indexer_losses_tracker)
    mf_csa.save_to_indexer_losses_tracker = TRACKER_LOG


def forget_logged_indexer_losses() -> None:
    TRACKER_LOG.logged.clear()


def logged_indexer_loss(layer_number: int = 2) -> float | None:
    """The indexer loss logged for ``layer_number`` since the previous call (``None``: nothing
    was logged; more than one value is an error: one forward logs once); forgets the log."""
    values = [v for layer, v in TRACKER_LOG.logged if layer == layer_number]
    TRACKER_LOG.logged.clear()
    if len(values) > 1:
        raise AssertionError(f"layer {layer_number} logged {len(values)} indexer losses: {values}")
    return values[0] if values else None


class FixedMesh:
    """A minimal stand-in for ``hyper_parallel.DeviceMesh`` (1-D): what MindFormers' own CSA CP
    (``CompressedSparseAttentionContextParallel``) reads from its mesh."""

    ndim = 1

    def __init__(self, size: int, rank: int, group: str) -> None:
        self._size, self._rank, self._group = size, rank, group

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank

    def get_group(self) -> str:
        return self._group


def anchor_wrap(cell, mesh):
    """Put MindFormers' own CSA CP (the anchor) on ``cell``, as ``parallelize`` would."""
    from mindformers.pynative.distributed.csa_context_parallel import (
        CompressedSparseAttentionContextParallel,
    )

    return CompressedSparseAttentionContextParallel(mesh)._apply(cell, mesh)


def anchor_refusals() -> dict[str, str]:
    """What the anchor refuses, found by calling it (cp = 2, rank 1; each refusal is raised
    before any communication): packed input, and local rows not a multiple of r."""
    rng = np.random.default_rng(0)

    def inputs(rows: int, b: int):
        shapes = [(rows, b, 4, 32), (rows, b, 1, 32), (rows, b, 64), (rows, b, 48)]
        return [Tensor(rng.standard_normal(s).astype(np.float32)) for s in shapes]

    out = {}
    for name, r, rows, b, ends in (
        ("packed", 4, 12, 1, (5, 24)),
        ("local_rows_not_multiple_of_r", 4, 10, 2, None),
        ("local_rows_not_multiple_of_r128", 128, 160, 2, None),
    ):
        cell = anchor_wrap(real_cell(r, train=True, loss_coeff=0.5), FixedMesh(2, 1, "unused"))
        asl = None if ends is None else Tensor(np.array(ends, np.int32))
        try:
            cell(*inputs(rows, b), asl)
            out[name] = "accepted"
        except Exception as exc:  # noqa: BLE001 - the message is the finding
            out[name] = f"{type(exc).__name__}: {exc}"
    out["load_balanced"] = (
        "no such layout: the anchor takes rank k's rows as [k * L, (k + 1) * L) (pos_offset = "
        "cp_rank * local_seq), contiguous only"
    )
    return out

"""CPU shims that let megatron-core 0.19.2's MLA + DSA layers run forward and backward on CPU
(gloo), for tests only: never shipped in a library, never imported by ``hp_cp_torch``.

Each shim names the exact megatron-core 0.19.2 file and line it replaces (paths relative to
``site-packages/megatron/core``), and the error that file raises on a CPU-only torch without it
(each was run without it: ``torchrun --nproc-per-node 2 tests/megatron/megatron_own_cp_check.py
--show-errors`` at cp 2, ``python tests/megatron/megatron_model.py --show-errors`` at cp 1):

``rotate_activation`` (pure-torch Walsh-Hadamard)
    ``transformer/experimental_attention_variant/dsa.py:253-269`` (``rotate_activation``, called
    by ``DSAIndexer.forward_before_topk`` at ``dsa.py:1312-1313`` when
    ``dsa_indexer_rotate_activation``, the default). It needs the CUDA-only
    ``fast_hadamard_transform`` package (import guarded at ``dsa.py:31-34``) and asserts bf16
    input (``dsa.py:264-266``); without the shim the fp32 indexer fails with
    ``AssertionError: rotate_activation only support bf16 input, but got torch.float32`` at
    ``dsa.py:265`` (a bf16 input fails ``fast_hadamard_transform is not installed``, ``:267``).
    The replacement computes what
    ``fast_hadamard_transform.hadamard_transform(x, scale=d ** -0.5)`` computes
    (``F.linear(x, scipy.linalg.hadamard(d)) * scale``, zero-padded to the next power of two and
    cut back to ``d``), in any dtype.

``torch.cuda.current_device`` -> ``torch.device("cpu")``, for three callers only
    Shims ``current_device_rope``, ``current_device_indexer_loss_tracker`` and
    ``current_device_mappings``: the replacement answers the CPU to calls from those files and
    defers to the real function (which raises on a CPU-only torch) for any other caller;
    ``REDIRECTED`` counts the calls answered, by ``file:line``. The call sites, each seen in
    ``REDIRECTED`` on a cp 2 step (``megatron_own_cp_check.py``, ``--rope-type yarn`` for yarn):
    ``models/common/embeddings/rotary_pos_embedding.py:78`` (``RotaryEmbedding.__init__``; MLA
    and the indexer build it without ``use_cpu_initialization``) and ``:162``
    (``RotaryEmbedding.get_emb``, every forward); ``yarn_rotary_pos_embedding.py:76``, ``:122``,
    ``:126`` (the same for ``rope_type="yarn"``); ``transformer/experimental_attention_variant/
    dsa.py:300`` (``DSAIndexerLossLoggingHelper.save_loss_to_tracker``, every forward with the
    indexer loss on); ``tensor_parallel/mappings.py:145`` (``_gather_along_first_dim``: the CP
    all-gather of the latent key and the indexer key) and ``:185``
    (``_reduce_scatter_along_first_dim``: its backward). Without each:
    ``AssertionError: Torch not compiled with CUDA enabled`` at ``rotary_pos_embedding.py:78``,
    ``dsa.py:300``, ``mappings.py:145`` respectively.

``rope_utils.get_pos_emb_on_this_cp_rank`` (CPU index)
    ``models/common/embeddings/rope_utils.py:48-70``: builds its zigzag index with
    ``torch.tensor(..., device="cpu", pin_memory=True).cuda(non_blocking=True)`` (``:62-64``),
    called at cp > 1 by ``rotary_pos_embedding.py:204`` and ``yarn_rotary_pos_embedding.py:186``
    (both import the name, so the shim rebinds it in all three modules). Without it, at cp 2:
    ``RuntimeError: pin_memory=True requires a CUDA or other accelerator backend`` at
    ``rope_utils.py:62``. The replacement selects the same chunks
    ``[cp_rank, 2 * cp_size - cp_rank - 1]`` of ``2 * cp_size`` on the embedding's own device.

``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` (no CUDA RNG)
    ``tensor_parallel/random.py:104-133`` and ``:135-175``, reached from Megatron's activation
    recomputation: ``CheckpointFunction.forward`` saves ``_get_all_rng_states()``
    (``random.py:604`` -> ``:528``) and its backward restores them (``_fork_rng`` and
    ``_set_all_rng_states``, ``:640-642`` -> ``:538``). Without the getter, a forward with
    ``recompute_granularity="full"`` fails with ``AssertionError: Torch not compiled with CUDA
    enabled`` at ``random.py:118`` (``torch.cuda.random.get_rng_state``); the setter does not
    raise on a CPU-only torch but queues a callback in ``torch.cuda._queued_calls`` per call
    (``_lazy_call``, ``:175``), never run. The replacements: an empty state and a no-op. The CPU
    generator, the only one these fp32 models draw from (dropout 0), is still saved and
    restored by ``random.py:527`` and ``:537``; the tracker's named states
    (``get_cuda_rng_tracker().get_states()``) are an empty dict here (none added).

``FP8GlobalStateManager``, ``activation_recompute_forward``, ``fp8_autocast`` in
``tensor_parallel.random`` (Transformer Engine's, absent: the fp8-off answers)
    ``tensor_parallel/random.py:85-90`` imports them from Transformer Engine under a guard
    (absent here: ``transformer_impl="local"``), but ``CheckpointWithoutOutput`` (selective
    recomputation of the ``layernorm``, ``transformer_layer.py:633-636``) sets ``self.fp8 = fp8
    is not None`` (``random.py:740``), true for its default ``fp8=False``, and so always reads
    them: without them ``NameError: name 'FP8GlobalStateManager' is not defined`` at
    ``random.py:693``. The stand-ins, put in that module only while they are missing, answer as
    Transformer Engine does with fp8 off: ``is_fp8_enabled()`` false, ``get_fp8_recipe()``
    ``None``, and no-op contexts for ``activation_recompute_forward`` (``:696``, ``:788``) and
    ``fp8_autocast(enabled=False)`` (``:791``); the recomputation is then the non-fp8 one.

Use::

    from megatron_shims import megatron_cpu_shims
    with megatron_cpu_shims():
        ...build and run the megatron model...

or, in pytest, the ``megatron_cpu`` fixture (import it into a test module or a conftest).
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from collections.abc import Iterator

import pytest
import torch

CURRENT_DEVICE_CALLERS = {
    "current_device_rope": (
        "megatron/core/models/common/embeddings/rotary_pos_embedding.py",
        "megatron/core/models/common/embeddings/yarn_rotary_pos_embedding.py",
    ),
    "current_device_indexer_loss_tracker": (
        "megatron/core/transformer/experimental_attention_variant/dsa.py",
    ),
    "current_device_mappings": ("megatron/core/tensor_parallel/mappings.py",),
}
"""The files whose ``torch.cuda.current_device()`` calls get the CPU, by shim name (every other
caller still gets the real ``torch.cuda.current_device``, which raises on a CPU-only torch)."""

REDIRECTED: collections.Counter = collections.Counter()
"""``file:line`` -> how many ``torch.cuda.current_device()`` calls the shim answered there."""

SHIMS = ("rotate_activation", *CURRENT_DEVICE_CALLERS, "rope_cp", "cuda_rng", "te_fp8_off")
"""The shim names ``megatron_cpu_shims(skip=...)`` accepts."""


def walsh_hadamard(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``fast_hadamard_transform.hadamard_transform(x, scale)`` in pure torch: each row of ``x``
    (last dim ``d``) times the Sylvester Hadamard matrix of order ``n = 2**ceil(log2 d)`` (``x``
    zero-padded to ``n``), cut back to ``d`` columns, times ``scale``; differentiable."""
    d = x.size(-1)
    n = 1 << max(d - 1, 0).bit_length()
    y = torch.nn.functional.pad(x, (0, n - d)) if n != d else x
    lead = y.shape[:-1]
    y = y.reshape(-1, n)
    h = 1
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(*lead, n)[..., :d] * scale).to(x.dtype)


def rotate_activation_cpu(x: torch.Tensor) -> torch.Tensor:
    """Replacement for ``dsa.rotate_activation`` (``dsa.py:253-269``) without the bf16 assert."""
    return walsh_hadamard(x, x.size(-1) ** -0.5)


def get_pos_emb_on_this_cp_rank_cpu(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """``rope_utils.get_pos_emb_on_this_cp_rank`` (``rope_utils.py:48-70``) with its index built
    on ``pos_emb.device`` instead of pinned memory moved to CUDA; otherwise line for line."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size = cp_group.size()
    cp_rank = cp_group.rank()
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(
        *pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[(seq_dim + 1) :]
    )
    pos_emb = pos_emb.index_select(seq_dim, cp_idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[(seq_dim + 2) :])


def get_cuda_rng_state_cpu(*args, **kwargs) -> torch.Tensor:
    """``tensor_parallel.random._get_cuda_rng_state`` (``random.py:104-133``) without CUDA:
    an empty state."""
    return torch.empty(0, dtype=torch.uint8)


def set_cuda_rng_state_cpu(*args, **kwargs) -> None:
    """``tensor_parallel.random._set_cuda_rng_state`` (``random.py:135-175``) without CUDA:
    nothing to set."""


class FP8OffStateManager:
    """Transformer Engine's ``FP8GlobalStateManager`` as it answers with fp8 off."""

    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe() -> None:
        return None


def no_op_context(*args, **kwargs) -> contextlib.AbstractContextManager:
    """``activation_recompute_forward(...)`` / ``fp8_autocast(enabled=False, ...)`` with fp8
    off: nothing to enter."""
    return contextlib.nullcontext()


TE_FP8_NAMES = {
    "FP8GlobalStateManager": FP8OffStateManager,
    "activation_recompute_forward": no_op_context,
    "fp8_autocast": no_op_context,
}
"""The Transformer Engine names ``tensor_parallel/random.py`` reads without Transformer Engine."""


def _current_device_for(callers: tuple[str, ...], original):
    """A ``torch.cuda.current_device`` that answers ``torch.device("cpu")`` to the files in
    ``callers`` and defers to ``original`` for everyone else."""

    def current_device():
        frame = sys._getframe(1)
        caller = frame.f_code.co_filename.replace(os.sep, "/")
        if caller.endswith(callers):
            REDIRECTED[f"{caller.split('site-packages/')[-1]}:{frame.f_lineno}"] += 1
            return torch.device("cpu")
        return original()

    return current_device


@contextlib.contextmanager
def megatron_cpu_shims(skip: tuple[str, ...] = ()) -> Iterator[None]:
    """Install the shims (all but those named in ``skip``), restore the originals on exit.

    Imports megatron-core lazily, so this module imports without it."""
    unknown = set(skip) - set(SHIMS)
    if unknown:
        raise ValueError(f"unknown shims {sorted(unknown)}; known: {SHIMS}")
    from megatron.core.models.common.embeddings import (
        rope_utils,
        rotary_pos_embedding,
        yarn_rotary_pos_embedding,
    )
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.experimental_attention_variant import dsa

    patches: list[tuple[object, str, object]] = []
    if "rotate_activation" not in skip:
        patches.append((dsa, "rotate_activation", rotate_activation_cpu))
    callers = tuple(
        path for name, paths in CURRENT_DEVICE_CALLERS.items() if name not in skip for path in paths
    )
    if callers:
        patches.append(
            (torch.cuda, "current_device", _current_device_for(callers, torch.cuda.current_device))
        )
    if "cuda_rng" not in skip:
        patches.append((tp_random, "_get_cuda_rng_state", get_cuda_rng_state_cpu))
        patches.append((tp_random, "_set_cuda_rng_state", set_cuda_rng_state_cpu))
    added = []
    if "te_fp8_off" not in skip:
        added = [name for name in TE_FP8_NAMES if not hasattr(tp_random, name)]
    if "rope_cp" not in skip:
        for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
            patches.append((module, "get_pos_emb_on_this_cp_rank", get_pos_emb_on_this_cp_rank_cpu))

    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        for name in added:
            setattr(tp_random, name, TE_FP8_NAMES[name])
        yield
    finally:
        for name in added:
            delattr(tp_random, name)
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


@contextlib.contextmanager
def forward_backward_func_on_cpu() -> Iterator[None]:
    """Opt-in, not part of ``megatron_cpu_shims``: lets ``get_forward_backward_func()`` (no
    pipelining) run on CPU. The one line that stops it is ``pipeline_parallel/schedules.py:749``
    (``forward_backward_no_pipelining``: ``total_num_tokens = torch.zeros([], dtype=torch.int,
    device="cuda")``, ``AssertionError: Torch not compiled with CUDA enabled``); with it
    redirected the schedule runs to the end (``finalize_model_grads_func`` unset) and gives the
    same gradients as ``schedules.forward_step`` + ``schedules.backward_step``
    (``megatron_own_cp_check.py`` compares them). The shim gives ``schedules`` a ``torch`` whose
    ``zeros(..., device="cuda")`` allocates on the CPU; nothing else changes."""
    import types

    from megatron.core.pipeline_parallel import schedules

    real = schedules.torch
    proxy = types.ModuleType("torch")
    proxy.__dict__.update(real.__dict__)

    def zeros(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return real.zeros(*args, **kwargs)

    proxy.zeros = zeros
    schedules.torch = proxy
    try:
        yield
    finally:
        schedules.torch = real


PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"


def stub_paged_stash_ops_without_triton() -> bool:
    """Where triton is not installed: put a stub of ``transformer/moe/ops/paged_stash.py`` in
    ``sys.modules`` before ``import megatron.core`` (that file's unconditional ``import triton``,
    line 4, is reached from ``import megatron.core`` through ``transformer/moe/paged_stash.py:12``,
    which imports ``GLOBAL_BLOCK_SIZE``, ``paged_stash_copy_kernel``, ``paged_stash_pop_kernel``).
    The stub's kernels raise when called (paged stash is a CUDA MoE feature). Returns whether
    it stubbed (``False`` when triton imports). Verified: with ``triton`` hidden, ``import
    megatron.core`` raises ``ImportError``; with this stub it imports and the MLA + DSA model runs
    forward and backward (the same loss as with triton installed)."""
    import importlib.util
    import types

    if importlib.util.find_spec("triton") is not None:
        return False
    if "megatron.core" in sys.modules:
        raise RuntimeError("stub_paged_stash_ops_without_triton must run before megatron.core")

    def unavailable(*args, **kwargs):
        raise RuntimeError("megatron paged stash needs triton (stubbed for CPU tests)")

    stub = types.ModuleType(PAGED_STASH_OPS)
    stub.GLOBAL_BLOCK_SIZE = None
    stub.paged_stash_copy_kernel = unavailable
    stub.paged_stash_pop_kernel = unavailable
    sys.modules[PAGED_STASH_OPS] = stub
    return True


@pytest.fixture
def megatron_cpu():
    """The CPU shims for one test (``pytest.importorskip`` megatron-core 0.19.2 first)."""
    pytest.importorskip("megatron.core")
    with megatron_cpu_shims():
        yield


def _self_check() -> None:
    """The Walsh-Hadamard equals multiplication by the Sylvester matrix (d a power of two, and
    zero-padded otherwise)."""
    for d in (1, 2, 8, 32, 24):
        n = 1 << max(d - 1, 0).bit_length()
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.size(0) < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        x = torch.randn(3, 5, d, dtype=torch.float64)
        want = (torch.nn.functional.pad(x, (0, n - d)) @ h.T)[..., :d] * 0.5
        got = walsh_hadamard(x, 0.5)
        assert torch.allclose(got, want, atol=1e-12), d
    print("walsh_hadamard == Sylvester Hadamard matrix: ok")


if __name__ == "__main__":
    _self_check()

"""The dispatch from a module to its adapter, the install of a layer's CP forward, and the two
adapters hp_cp_torch defines itself.

:func:`adapter_for` has no per-model code: a module's adapter class comes from the
``hp_cp.torch_models`` entry points (:mod:`hp_cp_torch.model.registry`); hp_cp_torch's own
integrations register there as any package would, and :func:`runner_for` gives the torch
plugin the layer's :class:`~hp_cp_torch.model.runner.LayerRunner`. Two adapters live here besides,
both implementations of the spec (:class:`~hp_cp_torch.model.spec.ModelAdapter`):

* :class:`ReferenceLayerAdapter` for :class:`hp_cp_torch.reference.DeepSeekV4Attention`.
* :class:`TorchDeepSeekV4CSAAdapter` for any module whose forward is
  ``module(query, key, x, qr[, cu_seqlens=])``, given its compressor(s) and attention
  function (the design note's torch adapter), installed with
  :func:`patch_torch_deepseek_v4_csa_forward`.

An adapter never plans: the runner runs the plan in ``call`` (see :mod:`hp_cp_core.plan`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hp_cp_core import CPConfig, HpCpError, LayerSpec, enable_cp
from hp_cp_core.api import cp_state_not_copyable
from hp_cp_torch._removed import deprecated
from hp_cp_torch.backend import TorchBackend
from hp_cp_torch.model.registry import adapter_class_for
from hp_cp_torch.model.runner import LayerRunner, check_model_group, model_handle, runner_of
from hp_cp_torch.model.spec import (
    AttentionParams,
    ForwardState,
    IndexerParams,
    LayerInputs,
    ModelAdapter,
    Projection,
    Traits,
    check_layer_hooks,
)
from hp_cp_torch.model.validation import TensorChecks

ADAPTER_ATTR = "_hp_cp_adapter"


def __getattr__(name: str) -> Any:
    if name == "CPForward":  # 0.4's name, beside the core's CPForward of another concept
        deprecated(f"{__name__}.CPForward", f"{__name__}.InstalledForward")
        return InstalledForward
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class InstalledForward:
    """The forward ``enable_cp`` sets on a layer: calls ``fn``, refuses to be pickled or copied.

    Not the core's :class:`hp_cp_core.CPForward` (the stage sequence of one layer's CP
    forward, which ``fn`` calls); ``hp_cp_torch.adapter.CPForward`` is this class's 0.4 name,
    deprecated.

    A plain closure would make ``torch.save(model)`` fail with "Can't pickle local object" and
    ``copy.deepcopy(model)`` hand the copy a forward still bound to the original's weights;
    this raises :func:`hp_cp_core.api.cp_state_not_copyable` for both instead.
    """

    def __init__(self, fn: Callable[..., Any], layer: nn.Module) -> None:
        functools.update_wrapper(self, fn)  # name, docstring, signature of ``fn``
        self.fn = fn
        self.layer_type = type(layer).__name__
        self.scope: Any = None
        """The layer's :class:`~hp_cp_torch.distributed.forward_scope.CallScope` (set by the torch
        backend's install): which forward's record each call reads."""

    @torch.compiler.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # torch.compile: the CP layer (host-side planning, collectives) runs eagerly, one
        # graph break; the rest of the model compiles.
        if self.scope is None:
            return self.fn(*args, **kwargs)
        return self.scope.run(self.fn, args, kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise cp_state_not_copyable(self.layer_type)


def install_forward(layer: nn.Module, forward: Callable[..., Any]) -> Callable[[], None]:
    """Set ``layer.forward`` to ``forward``; the returned undo restores exactly what was there."""
    had_own = "forward" in layer.__dict__
    previous = layer.__dict__.get("forward")
    layer.forward = InstalledForward(forward, layer)

    def undo() -> None:
        if had_own:
            layer.forward = previous
        else:
            del layer.forward

    return undo


class ReferenceLayerAdapter(ModelAdapter):
    """The model adapter of :class:`hp_cp_torch.reference.DeepSeekV4Attention` (batch-major),
    registered by the entry point ``"hp_cp_torch.reference.DeepSeekV4Attention"``. The layer
    is called as ``layer(x, position_ids=None, cu_seqlens=None, loss_mask=None)``; its indexer
    sees detached inputs and is trained by its loss (Megatron's semantics, the default
    ``traits.indexer_grad``)."""

    def layer_spec(self) -> LayerSpec:
        m = self.module
        return LayerSpec(
            compress_ratio=m.compress_ratio,
            window_size=m.window_size,
            has_indexer=m.indexer is not None,
        )

    def read_inputs(
        self, x: Any, position_ids: Any = None, cu_seqlens: Any = None, loss_mask: Any = None
    ) -> LayerInputs:
        return LayerInputs(x, position_ids, cu_seqlens, loss_mask)

    def project(self, state: ForwardState) -> Projection:
        q, kv, qr = self.module.project(state.hidden, state.positions)
        return Projection(q, kv, index_input=qr)

    def compress(self, rows: torch.Tensor, start: int, state: ForwardState) -> torch.Tensor:
        return self.module.compressor(rows, start)

    def compress_index_keys(
        self, rows: torch.Tensor, start: int, state: ForwardState
    ) -> torch.Tensor:
        return self.module.indexer.compressor(rows, start)

    def index_queries(self, state: ForwardState) -> tuple[torch.Tensor, torch.Tensor]:
        ix, qr = self.module.indexer, state.projection.index_input
        return ix.queries(qr.detach(), state.positions), ix.weights(state.hidden.detach())

    def index_scores(self, state: ForwardState, lo: int, hi: int, keys: torch.Tensor) -> Any:
        q_idx, weights = state.index_queries
        return self.module.indexer.scores(q_idx[:, lo:hi], weights[:, lo:hi], keys)

    def indexer_params(self) -> IndexerParams | None:
        m = self.module
        if m.indexer is None:
            return None
        coeff = m.config.indexer_loss_coeff if m.computes_indexer_loss else None
        return IndexerParams(int(m.config.index_topk), int(m.indexer.n_heads), coeff)

    def attention_params(self) -> AttentionParams:
        return AttentionParams(self.module.softmax_scale, self.module.attn_sink)

    def output(self, o: torch.Tensor, state: ForwardState) -> torch.Tensor:
        return self.module.output(o, state.positions)


@dataclass
class CSACallInputs(LayerInputs):
    """A patched module's call ``module(query, key, x, qr, cu_seqlens=None)``: ``hidden`` is
    ``x`` (made batch-major by hp_cp), the rest as given (sequence-major)."""

    query: Any = None
    key: Any = None
    x: Any = None
    qr: Any = None
    extra: tuple[Any, Any] = ((), {})


class TorchDeepSeekV4CSAAdapter(ModelAdapter):
    """The design note's torch adapter: functions in place of module attributes.

    The patched ``module(query, key, x, qr, cu_seqlens=None)`` receives sequence-major local
    rows (``query [L, B, N, D]``, ``key [L, B, 1, D]`` or ``[L, B, D]``, ``x [L, B, hidden]``,
    ``qr [L, B, q_lora]``); packed input is the same tensors (``B`` = 1: one packed
    stream) with ``cu_seqlens``, the global document boundaries ``[0, ..., S]`` (the same
    on every rank), checked and agreed on every rank before any exchange. The callables
    see one document at a time, exactly what they would see running the module on that
    document alone on one process:

    * ``compressor(x, rope_pos_offset=int)`` gets the rows of one document starting on one
      of its block boundaries (maybe one block early, for r = 4's predecessor; that slot is
      dropped), ``rope_pos_offset`` the document-relative position of that first row; and
      once with 0 rows (``rope_pos_offset=0``) on a rank that owns no slot.
    * ``attention_fn(query=, ori_kv=, x=, qr=, pos_offset=, cmp_kv_global=, ori_halo_len=,
      cmp_idx_global=)`` is called once per contiguous run of local rows inside one document
      (:class:`hp_cp_core.plan.DocumentRun`): ``query``, ``x``, ``qr`` the run's rows;
      ``pos_offset`` the document-relative position of its first row (the global row when
      padded); ``ori_kv`` the run's keys with ``ori_halo_len`` earlier rows of the same
      document in front (``ori_kv[ori_halo_len + i]`` is query ``i``'s own key);
      ``cmp_kv_global`` / ``cmp_idx_global`` the document's compressed slots, row j its
      slot j (RoPE position ``j*r`` in the document), of which the query at position ``t``
      sees the first ``(t + 1) // r`` (rows past the last query's horizon may be absent or
      zero); ``None`` when r = 0 / without an indexer. The outputs are concatenated in
      local row order.

    A spec implementation like any model's: sequence-major, its compressors the ``compress``
    hooks, ``attention_fn`` its own attention (``kind="own"``: it picks its slots itself).
    ``compress_ratio`` is 0, 4 or 128 (a compressor for r > 0, an indexer compressor at 4),
    ``window_size`` W; ``force_unfused`` is recorded in the layer spec.
    """

    traits = Traits(sequence_dim=0, indexer_grad="full")

    def __init__(
        self,
        module: nn.Module,
        *,
        compressor: Callable[..., Any] | None,
        indexer_compressor: Callable[..., Any] | None = None,
        attention_fn: Callable[..., Any],
        compress_ratio: int,
        window_size: int,
        force_unfused: bool = True,
    ) -> None:
        if compress_ratio > 0 and compressor is None:
            raise HpCpError(
                f"compress_ratio={compress_ratio} needs a compressor; pass compressor=... "
                "(a callable compressor(x, rope_pos_offset=int))."
            )
        if attention_fn is None or not callable(attention_fn):
            raise HpCpError(
                "attention_fn must be a callable taking the keyword arguments "
                "query, ori_kv, x, qr, pos_offset, cmp_kv_global, ori_halo_len, "
                "cmp_idx_global."
            )
        super().__init__(module)
        self.compressor, self.indexer_compressor = compressor, indexer_compressor
        self.attention_fn = attention_fn
        self.spec = LayerSpec(
            compress_ratio=int(compress_ratio),
            window_size=int(window_size),
            has_indexer=indexer_compressor is not None and compress_ratio == 4,
            force_unfused=bool(force_unfused),
        )

    def layer_spec(self) -> LayerSpec:
        return self.spec

    def layer_name(self) -> str:
        return "patched module"

    def read_inputs(
        self, query: Any, key: Any, x: Any, qr: Any = None, *args: Any, cu_seqlens: Any = None,
        **kwargs: Any,
    ) -> CSACallInputs:  # fmt: skip
        return CSACallInputs(
            x, cu_seqlens=cu_seqlens, query=query, key=key, x=x, qr=qr, extra=(args, kwargs)
        )

    def check_inputs(self, inputs: CSACallInputs, checks: TensorChecks) -> None:
        checks.csa_inputs(inputs.query, inputs.key, inputs.x, inputs.qr)
        args, kwargs = inputs.extra
        if args or kwargs:
            checks.fail(
                "a module patched by patch_torch_deepseek_v4_csa_forward takes "
                f"(query, key, x, qr, cu_seqlens=None) under CP; got extra arguments "
                f"{list(kwargs) or args}. Call it with those four only (and cu_seqlens= "
                "for packed input)."
            )

    def project(self, state: ForwardState) -> Projection:
        query, key = state.inputs.query, state.inputs.key
        key = key if key.dim() == 3 else key.squeeze(2)
        return Projection(query.transpose(0, 1), key.transpose(0, 1))  # batch-major views

    def compress(self, rows: torch.Tensor, start: int, state: ForwardState) -> torch.Tensor:
        return self.compressor(rows.transpose(0, 1), rope_pos_offset=start).transpose(0, 1)

    def compress_index_keys(
        self, rows: torch.Tensor, start: int, state: ForwardState
    ) -> torch.Tensor:
        return self.indexer_compressor(rows.transpose(0, 1), rope_pos_offset=start).transpose(0, 1)

    def attention_params(self) -> AttentionParams:
        return AttentionParams(kind="own")

    def attention(self, request: Any, state: ForwardState) -> torch.Tensor:
        """``attention_fn`` once per document run of the local rows (sequence-major)."""
        inputs = state.inputs
        query, ori_ext = inputs.query, request.ori_ext.transpose(0, 1)  # as called: [L, B, ...]
        cmp_kv = None if state.slots is None else state.slots.transpose(0, 1)
        cmp_idx = None if state.keys is None else state.keys.transpose(0, 1)

        def slots(t: Any, run: Any) -> Any:
            return None if t is None else t[run.cmp_start : run.cmp_stop]

        outs = []
        for run in request.plan.document_runs:
            rows = slice(run.local_start, run.local_stop)
            outs.append(
                self.attention_fn(
                    query=query[rows],
                    ori_kv=ori_ext[run.ext_start : run.ext_stop],
                    x=inputs.x[rows],
                    qr=None if inputs.qr is None else inputs.qr[rows],
                    pos_offset=run.pos_offset,
                    cmp_kv_global=slots(cmp_kv, run),
                    ori_halo_len=run.halo_len,
                    cmp_idx_global=slots(cmp_idx, run),
                )
            )
        return (outs[0] if len(outs) == 1 else torch.cat(outs)).transpose(0, 1)

    def output(self, o: torch.Tensor, state: ForwardState) -> torch.Tensor:
        return o


def patch_torch_deepseek_v4_csa_forward(
    module: nn.Module,
    *,
    cp_mesh: Any,
    config: CPConfig | None = None,
    compressor: Callable[..., Any] | None = None,
    indexer_compressor: Callable[..., Any] | None = None,
    attention_fn: Callable[..., Any] | None = None,
    compress_ratio: int | None = None,
    window_size: int | None = None,
) -> Any:
    """Run ``module(query, key, x, qr)`` under CP through :class:`TorchDeepSeekV4CSAAdapter`.

    The patched module also takes packed input, ``module(query, key, x, qr,
    cu_seqlens=cu)`` with the global document boundaries; what the compressors and
    ``attention_fn`` then see (one document at a time) is in the adapter's docstring::

        handle = patch_torch_deepseek_v4_csa_forward(module, cp_mesh=mesh)
        cu = torch.tensor([0, 5, 32])  # two documents of one packed stream of S = 32 rows
        q, k, x, qr = (handle.shard(t, 0) for t in (query, key, x_full, qr_full))
        out = module(q, k, x, qr, cu_seqlens=cu)  # [S / cp, 1, heads, head_dim]
        full = handle.unshard(out, 0)  # == the module on each document alone, concatenated

    Missing arguments are read from the module (``compressor``, ``indexer.compressor`` or
    ``indexer_compressor``, ``attention_fn``, ``compress_ratio``, ``window_size``).

    Returns:
        The ``enable_cp`` handle; ``disable_cp(handle)`` restores the module.
    """

    def given(value: Any, name: str, default: Any = None) -> Any:
        return value if value is not None else getattr(module, name, default)

    ratio, window = given(compress_ratio, "compress_ratio"), given(window_size, "window_size")
    if ratio is None or window is None:
        raise HpCpError(
            f"patch_torch_deepseek_v4_csa_forward could not find compress_ratio / window_size "
            f"on a `{type(module).__name__}`; pass compress_ratio=... and window_size=...."
        )
    indexer = getattr(getattr(module, "indexer", None), "compressor", None)
    adapter = TorchDeepSeekV4CSAAdapter(
        module,
        compressor=given(compressor, "compressor"),
        indexer_compressor=given(indexer_compressor, "indexer_compressor", indexer),
        attention_fn=given(attention_fn, "attention_fn"),
        compress_ratio=int(ratio),
        window_size=int(window),
    )
    setattr(module, ADAPTER_ATTR, adapter)
    try:
        handle = enable_cp(module, cp_mesh, config, backend="torch")
    except BaseException:
        delattr(module, ADAPTER_ATTR)
        raise
    handle.on_disable(lambda: module.__dict__.pop(ADAPTER_ATTR, None))
    return handle


def prepare_module(module: nn.Module, layers: list[nn.Module], handle: Any) -> None:
    """Refuse a layer whose adapter lacks a hook it needs (:func:`check_layer_hooks`), a
    model whose own CP group is not the handle's (:func:`check_model_group`) and
    ``attention_precision="model"`` where an adapter has no ``attention`` of its own, then
    run each adapter class's ``prepare_model(module, layers, handle)`` once, with its own
    layers: the model-level pieces an integration needs under CP (NeMo's guards, V4.1's
    Engram hash, GLM-5's positions), whichever ``enable_cp`` the user called."""
    by_class: dict[type, list[nn.Module]] = {}
    for layer in layers:
        adapter = adapter_for(layer)
        if adapter is not None:
            check_layer_hooks(adapter)
            check_model_group(adapter, handle)
            by_class.setdefault(type(adapter), []).append(layer)
    if handle.config.attention_precision == "model":
        lacking = {
            type(layer).__name__
            for cls, own in by_class.items()
            if cls.attention is ModelAdapter.attention
            for layer in own
        }
        if lacking:
            raise HpCpError(
                f"CPConfig(attention_precision='model'): hp_cp has no copy of the model's own "
                f"attention ops for {sorted(lacking)}; its kernels compute the attention in fp32 "
                "(hp_cp_torch.kernels.precision.KERNEL_PRECISION). "
                "Use attention_precision='fp32'."
            )
    for cls, own in by_class.items():
        cls.prepare_model(module, own, model_handle(handle))


def adapter_for(module: Any) -> Any:
    """The adapter of ``module``, or ``None`` when no model adapter claims it.

    The one a layer got at install (kept until ``disable_cp``), one set explicitly (the
    ``_hp_cp_adapter`` attribute, :func:`patch_torch_deepseek_v4_csa_forward`), else a new
    one of the class the ``hp_cp.torch_models`` entry points register for the module's class
    (:mod:`hp_cp_torch.model.registry`; no per-model code here).
    """
    if not isinstance(module, nn.Module):
        return None
    explicit = module.__dict__.get(ADAPTER_ATTR)
    if explicit is not None:
        return explicit
    cls = adapter_class_for(module)
    return None if cls is None else cls(module)


def runner_for(module: Any) -> LayerRunner | None:
    """The :class:`~hp_cp_torch.model.runner.LayerRunner` of ``module``'s adapter (what the torch
    plugin's hooks call), or ``None`` when no adapter claims it."""
    return runner_of(adapter_for(module))


def pin_adapter(layer: nn.Module) -> Callable[[], None]:
    """Build ``layer``'s adapter now and keep it on the layer (one adapter per layer, for
    every hook call of every forward); the returned undo drops it."""
    if layer.__dict__.get(ADAPTER_ATTR) is not None:
        return lambda: None  # set explicitly: its owner removes it
    layer.__dict__[ADAPTER_ATTR] = adapter_for(layer)
    return lambda: layer.__dict__.pop(ADAPTER_ATTR, None)


def make_backend(find: Callable[..., Any], install: Callable[..., Any]) -> TorchBackend:
    """The torch backend (:class:`hp_cp_torch.backend.TorchBackend`) whose install builds
    each layer's adapter once (:func:`pin_adapter`) and whose ``prepare_module`` runs the
    adapters' ``prepare_model``."""

    def install_pinned(layer: nn.Module, cp_forward: Any, group: Any) -> Callable[[], None]:
        unpin = pin_adapter(layer)
        try:
            undo = install(layer, cp_forward, group)
        except BaseException:
            unpin()
            raise

        def restore() -> None:
            undo()
            unpin()

        return restore

    return TorchBackend(find, install_pinned, prepare=prepare_module)

"""The hp_cp plugin contract: every hook a backend may implement, documented hook by hook.

A backend is a module (registered under the ``hp_cp`` entry-point group) holding functions
marked with :data:`hp_cp_core.hookimpl`. Every hook takes the wrapped ``module`` first and
returns ``None`` for a module the plugin does not own, so several backends coexist in one
process.

``hp_cp_backend`` is called on *every* plugin and the answers are collected, so two plugins
claiming one module is a :class:`~hp_cp_core.errors.BackendConflictError`, never "first wins".
``hp_cp_layer_spec`` and the four stage hooks are ``firstresult``: the first non-``None``
answer wins, so a narrower plugin marked ``tryfirst`` (a fused kernel, say) can take over one
stage for the modules it knows and leave the rest to the generic backend.

``hp_cp_backend_api`` is read from each plugin on its own: the backend API version it
implements (:mod:`hp_cp_core.versions`; a plugin without it is a 0.1 plugin).

The stages run from :class:`hp_cp_core.forward.CPForward` in this order on every forward:
extract KV, compress main, compress indexer (r = 4 with an indexer), run attention. Tensors
are *sequence-major*: dim 0 is the row (token) dimension. A backend whose runner hands the
core its stage object (:class:`~hp_cp_core.runners.RunnerHooks`' runners, ``stages=``) has
its stages called on it directly; the hook runs while a plugin that implements no
``hp_cp_backend`` (an override) implements the stage (Note [A direct runtime path] in
:mod:`hp_cp_core.plugins`).
"""

from __future__ import annotations

from typing import Any

import pluggy

_hookspec = pluggy.HookspecMarker("hp_cp")


@_hookspec
def hp_cp_backend(module: Any) -> Any:
    """Return the :class:`~hp_cp_core.backend.Backend` that runs ``module`` under CP.

    Called once per module in :func:`hp_cp_core.enable_cp` (for a whole model: on the model,
    then the backend's ``find_layers`` walks it).

    Args:
        module: the attention layer or model passed to ``enable_cp``.

    Returns:
        A ``Backend`` for this module, or ``None`` when this plugin does not own the module.

    All implementations are called; the non-``None`` answers are collected. More than one is
    a :class:`~hp_cp_core.errors.BackendConflictError` unless ``enable_cp(backend=...)`` picks.

    .. versionadded:: 0.1
    """


@_hookspec(firstresult=True)
def hp_cp_layer_spec(module: Any) -> Any:
    """Describe ``module`` as a :class:`~hp_cp_core.config.LayerSpec`.

    Called once per layer, in :func:`hp_cp_core.enable_cp`, after the backend is chosen.

    Args:
        module: the attention layer.

    Returns:
        A ``LayerSpec`` (compress_ratio, window_size, force_unfused, has_indexer, packed
        grid convention), or ``None`` when this plugin does not know the module.

    The first non-``None`` answer wins (``firstresult``).

    .. versionadded:: 0.1
    """


@_hookspec(firstresult=True)
def hp_cp_extract_ori_kv(module: Any, key: Any) -> Any:
    """Return the original (uncompressed) KV rows from the module's key tensor.

    Called on every CP forward, first.

    Args:
        module: the attention layer.
        key: the module's key tensor for the local rows, sequence-major.

    Returns:
        ``[rows, (batch,) D]`` original KV, or ``None`` when this plugin does not own the module.

    The first non-``None`` answer wins (``firstresult``).

    .. versionadded:: 0.1
    """


@_hookspec(firstresult=True)
def hp_cp_compress_main(module: Any, x: Any, halo_x: Any, call: Any) -> Any:
    """Return this rank's owned compressed slots of the main compressor.

    Called on every CP forward of a layer with ``compress_ratio > 0``, after the halo
    exchange. :func:`hp_cp_core.compression.stage1_compress_with_halo` does the work for any
    compressor callable ``compress(x_rows, rope_pos_offset)``.

    Args:
        module: the attention layer.
        x: the local compressor input rows, ``[L, (batch,) hidden]``.
        halo_x: the rows of ``x`` from earlier ranks this rank's slots read, ascending.
        call: the :class:`~hp_cp_core.config.CPContext` of this forward.

    Returns:
        ``[n_owned, (batch,) D]`` slots in global slot order (``call.plan.owned_slots``),
        or ``None`` when this plugin does not own the module.

    The first non-``None`` answer wins (``firstresult``).

    .. versionadded:: 0.1
    """


@_hookspec(firstresult=True)
def hp_cp_compress_indexer(module: Any, x: Any, halo_x: Any, call: Any) -> Any:
    """Return this rank's owned slots of the indexer compressor (r = 4 with an indexer).

    Called on every CP forward of a layer whose spec has ``has_indexer``, right after
    ``hp_cp_compress_main``; both results travel in one collective.

    Args:
        module: the attention layer.
        x: the local compressor input rows, ``[L, (batch,) hidden]``.
        halo_x: the rows of ``x`` from earlier ranks this rank's slots read, ascending.
        call: the :class:`~hp_cp_core.config.CPContext` of this forward.

    Returns:
        ``[n_owned, (batch,) Di]`` indexer keys in global slot order, or ``None`` when this
        plugin does not own the module.

    The first non-``None`` answer wins (``firstresult``).

    .. versionadded:: 0.1
    """


@_hookspec(firstresult=True)
def hp_cp_run_attention(module: Any, query: Any, ori_ext: Any, x: Any, qr: Any, call: Any) -> Any:
    """Run the layer's attention for the local queries and return its output.

    Called on every CP forward, last. ``call`` carries the gathered compressed KV
    (``call.slots``) and indexer keys (``call.keys``) in global slot order,
    and the plan's local-frame index arrays (window ranges into ``ori_ext``, visible slot
    ranges into the global slots), so the backend only executes.

    In training, a CSA layer's indexer KL loss is computed here too: its teacher's window +
    sink mass reads only the query's window, which ``ori_ext`` already holds, and its mean is
    global: multiply the local per-row KL sum by
    :func:`hp_cp_core.indexer_loss.indexer_loss_weight` (``1 / call.loss_rows``); the logged
    value is the sum of the ranks' shares, on every rank
    (:func:`hp_cp_core.indexer_loss.global_indexer_loss`, or the framework's all-reduce to
    avoid a host sync; Note [Indexer loss under CP]). The loss must stay attached (zero
    gradients) when its coefficient is 0, so that every rank runs the same backward
    collectives.

    Args:
        module: the attention layer.
        query: the local queries, sequence-major.
        ori_ext: original KV rows ``[halo ; local]`` in ascending global order
            (``call.ori_halo_len`` halo rows for a contiguous layout).
        x: the local layer input rows (the indexer's weight input).
        qr: the local query low-rank rows (the indexer's query input), or ``None``.
        call: the :class:`~hp_cp_core.config.CPContext` of this forward.

    Returns:
        The local attention output, or ``None`` when this plugin does not own the module.

    The first non-``None`` answer wins (``firstresult``).

    .. versionadded:: 0.1
    """


@_hookspec
def hp_cp_backend_api() -> Any:
    """Return the version of the backend API (the ``Backend`` and ``Group`` protocols of
    :mod:`hp_cp_core.backend` and these hooks) this plugin implements, as ``"MAJOR.MINOR"``.

    Called once per plugin, without arguments: by :func:`hp_cp_core.enable_cp` on the plugin
    whose backend was chosen, before its group runs any collective, and by
    ``python -m hp_cp_core`` for the "backend API" column. A plugin implements it as::

        @hookimpl
        def hp_cp_backend_api() -> str:
            return hp_cp_core.BACKEND_API  # "0.2" with hp-cp-core 0.2

    It takes no arguments: the answer describes the plugin, not a module.

    Returns:
        ``"0.2"`` (current: groups thread order tokens), ``"0.1"`` (the protocol without
        tokens: the core adapts its groups with placeholder tokens and a
        ``DeprecationWarning`` where that is correct, else refuses them), or another version
        (unusable with this core: ``enable_cp`` raises :class:`~hp_cp_core.errors.HpCpError`).
        A plugin that does not implement the hook, or answers ``None``, was written against
        0.1, before the hook existed, and is treated as ``"0.1"``.

    Only this plugin's own implementation is read (not a collected or first result), so one
    plugin's answer never stands for another's. See :mod:`hp_cp_core.versions` and the
    migration section of ``docs/writing-a-backend.md``.

    .. versionadded:: 0.2
    """

"""The ``Backend`` and ``Group`` protocols a plugin implements (pure typing, no framework).

A backend gives the core a handful of tensor ops (so core code such as
:func:`~hp_cp_core.compression.stage1_compress_with_halo` runs on any framework), a
:class:`Group` of collectives over the user's mesh, and the install / uninstall of the CP
forward on a module. Index arrays handed to the ops are numpy ``int64`` arrays; the backend
moves them to its device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

Tensor = Any


@runtime_checkable
class Group(Protocol):
    """Collectives over one CP group. Every exchange is differentiable in the framework.

    Every exchange takes the layer's *order token* and returns the next one, so that backward
    runs the exchanges in exactly the reverse forward order on every rank; see
    Note [Backward order] in :mod:`hp_cp_core.collectives`. A token is ``None`` when the
    framework records no backward (grad disabled); then the ops pass it through.

    A group whose ``exchange_rows`` moves only the rows asked for (real point-to-point
    messages) declares the class attribute ``point_to_point = True``; the core then sends the
    compressed slots through it too, each rank receiving only the slots its queries see.
    Without it (an ``exchange_rows`` built on an all-gather, say) the slots travel by
    ``all_gather_rows``. ``handle.stats()["compressed_slot_exchange"]`` says which ran.

    Optional: ``regather_scope(buffers, owned, rebuild)`` (what
    ``CPConfig(regather_compressed_kv=True)`` uses; Note [Re-gathered slots] in
    :mod:`hp_cp_core.compression`) returns a context manager that the core runs the attention
    hook in, and whose ``end_order(output, token)`` it calls in place of the group's: inside
    it, what autograd saves from ``buffers`` (the global compressed KV and indexer keys) is
    kept as a reference, not as the tensor; the backward of ``end_order`` calls
    ``rebuild(owned)`` (the same exchange, no autograd; ``owned``: this rank's slots, main
    then indexer) and hands its result to those references. A group without it keeps the
    buffers.
    """

    rank: int
    size: int

    def begin_order(self, anchor: Tensor) -> Any:
        """The first token of one layer forward, tied to the layer input ``anchor``.

        Backward of the token gives ``anchor`` a zero gradient, so nothing upstream of the
        layer runs its backward before the layer's first exchange did. Returns ``None`` when
        no backward is recorded.
        """

    def exchange_rows(
        self, items: Sequence[tuple[Tensor, Any]], token: Any
    ) -> tuple[list[Tensor], Any]:
        """Point-to-point exchange of rows of several tensors in one message per peer.

        ``items`` are ``(tensor, plan)`` pairs (a tensor may have 0 rows), ``plan`` a
        :class:`~hp_cp_core.plan.HaloPlan` (window KV and x halos) or a
        :class:`~hp_cp_core.slot_exchange.SlotExchangePlan` (compressed slots); both give
        ``send_rows``, ``recv_counts``, ``n_halo`` (rows received) and ``exchange_name`` (for
        counters and error messages). For each item, rank ``r`` sends
        ``tensor[plan.send_rows[d]]`` to rank ``d`` and receives ``plan.recv_counts[s]`` rows
        from each rank ``s``. Returns, per item, ``[received rows in source-rank order ;
        tensor]``, and the next token. Backward sends the gradient of the received rows back
        to their owners and adds it to the gradient of the rows they sent; it runs after the
        backward of every later exchange of the layer (it needs the returned token's
        gradient), also on a rank that sent and received nothing.
        """

    def all_gather_rows(self, tensor: Tensor, token: Any) -> tuple[Tensor, Any]:
        """All-gather ``[cap, F]`` from every rank into ``[size * cap, F]`` (rank-major), and
        the next token.

        Backward reduce-scatters (or all-reduces and slices) the gradient, after the backward
        of every later exchange (the returned token's gradient).
        """

    def end_order(self, output: Any, token: Any) -> Any:
        """``output`` (the layer output: a tensor, or a tuple whose first tensor is it),
        unchanged in value, with the last token attached so that its gradient starts the
        chain of backward exchanges. ``token`` ``None``: ``output`` itself."""

    def all_gather_dim(self, tensor: Tensor, dim: int) -> Tensor:
        """All-gather along ``dim`` (rank-major); used by ``handle.unshard`` (no token: it is
        a single collective outside the layers)."""

    def all_gather_meta(self, values: np.ndarray) -> np.ndarray:
        """All-gather a small int64 vector (no autograd): ``[n]`` -> ``[size, n]``.

        A group whose backend defers device-side checks (``LocalCheck.deferred``) also takes
        ``device_flags=[0-dim tensors]``, appended to the vector before the gather (one
        device-to-host read in all): ``[n]`` -> ``[size, n + len(device_flags)]``."""

    def stats(self) -> dict[str, Any]:
        """Bytes sent / received and calls per collective kind since the group was made, in the
        one schema of :mod:`hp_cp_core.stats` (``GroupStats``; ``check_stats`` validates it)."""


@runtime_checkable
class Backend(Protocol):
    """What ``hp_cp_backend(module)`` returns."""

    name: str

    def group(self, mesh: Any) -> Group:
        """Make the CP :class:`Group` for ``mesh``; raise ``HpCpError`` for a mesh it can't use."""

    def find_layers(self, module: Any) -> list[Any]:
        """The attention layers under ``module`` this backend runs under CP (maybe itself)."""

    def install(self, layer: Any, cp_forward: Callable[..., Any], group: Group) -> Any:
        """Route ``layer``'s forward through ``cp_forward``; return a token for ``uninstall``."""

    def uninstall(self, layer: Any, token: Any) -> None:
        """Restore exactly the forward ``install`` replaced."""

    # Optional, not part of the protocol's checks: ``prepare_module(module, layers, handle)``,
    # what the model needs beyond its layers, called by ``enable_cp`` before any install.

    # Tensor ops the core's helpers use (dim 0 is always the row dimension).
    def cat(self, tensors: Sequence[Tensor]) -> Tensor: ...
    def narrow(self, tensor: Tensor, start: int, length: int) -> Tensor: ...
    def index_rows(self, tensor: Tensor, index: np.ndarray) -> Tensor: ...
    def num_rows(self, tensor: Tensor) -> int: ...
    def flatten_rows(self, tensor: Tensor) -> Tensor: ...
    def unflatten_rows(self, tensor: Tensor, like_shape: tuple[int, ...]) -> Tensor: ...
    def cat_features(self, tensors: Sequence[Tensor]) -> Tensor: ...
    def split_features(self, tensor: Tensor, sizes: Sequence[int]) -> list[Tensor]: ...
    def pad_rows(self, tensor: Tensor, rows: int) -> Tensor: ...
    def shape(self, tensor: Tensor) -> tuple[int, ...]: ...
    def take(self, tensor: Tensor, index: np.ndarray, dim: int) -> Tensor: ...
    def pad_dim(self, tensor: Tensor, dim: int, size: int, value: Any) -> Tensor:
        """``tensor`` extended along ``dim`` to ``size`` entries filled with ``value``
        (``handle.shard(..., pad_value=...)``)."""

    # Optional, for ``handle.batch`` (Note [One batch path] in :mod:`hp_cp_core.batch`):
    # ``as_tensor(values: np.ndarray, like: Tensor | None) -> Tensor`` (on ``like``'s device,
    # the host for ``None``) and ``to_numpy(tensor) -> np.ndarray``.

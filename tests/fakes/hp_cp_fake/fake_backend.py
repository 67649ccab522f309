"""An in-process N-rank numpy backend: ranks are threads, collectives log their bytes.

It is the worked example of ``docs/writing-a-backend.md``: a toy attention layer
(``ToyAttention``) with a block-local compressor and an index-set attention, the hooks that
run it under CP, and ``single_device`` reference math written from the per-token definitions
(no core code), so a CP run that equals it proves the core's data movement.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hp_cp_core import HpCpError, LayerSpec, hookimpl, stage1_compress_with_halo
from hp_cp_core.indices import compressed_index_dense, window_index_dense
from hp_cp_core.stats import ALL_GATHER, HALO_EXCHANGE
from hp_cp_core.testing import ThreadGroup, ThreadMesh
from hp_cp_core.versions import BACKEND_API

# --------------------------------------------------------------------------------------------
# the world: N ranks in one process


class FakeWorld:
    """Shared state of N thread-ranks: a mailbox, a barrier and a communication log.

    ``point_to_point=False`` makes its groups declare no point-to-point, so the core sends
    compressed slots by all-gather (the path of a backend without send / receive).
    """

    def __init__(self, size: int, point_to_point: bool = True) -> None:
        self.size = size
        self.point_to_point = point_to_point
        self.barrier = threading.Barrier(size, timeout=60)
        self.box: dict[tuple, Any] = {}
        self.lock = threading.Lock()
        self.log: list[dict[str, Any]] = []

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """Run ``fn(rank)`` on every rank (one thread each); re-raise the first error."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def target(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001
                errors[rank] = exc
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(k,)) for k in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for exc in errors:
            if exc is not None and not isinstance(exc, threading.BrokenBarrierError):
                raise exc
        for exc in errors:
            if exc is not None:
                raise exc
        return results


STATS_KIND = {"exchange_rows": HALO_EXCHANGE, "all_gather_rows": ALL_GATHER}
"""The stats name (:mod:`hp_cp_core.stats`) of each collective in the world's log."""


class FakeGroup:
    """One rank's view of the world; implements the core's ``Group`` protocol."""

    def __init__(self, world: FakeWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.size = world.size
        self.point_to_point = world.point_to_point
        self.bytes_sent = 0
        self.bytes_recv = 0
        self.calls: dict[str, int] = {}

    def _count(self, kind: str, sent: int, recv: int, name: str = "") -> None:
        """Log one call; ``name`` (default: the stats name of ``kind``) is what it moved:
        ``halo_exchange`` / ``slot_exchange`` for ``exchange_rows``, the stats kind."""
        name = name or STATS_KIND.get(kind, kind)
        self.bytes_sent += sent
        self.bytes_recv += recv
        self.calls[name] = self.calls.get(name, 0) + 1
        entry = {"rank": self.rank, "kind": kind, "sent": sent, "recv": recv, "name": name}
        with self.world.lock:
            self.world.log.append(entry)

    # numpy records no backward, so order tokens are placeholders passed through
    # (Note [Backward order] in hp_cp_core.collectives)
    def begin_order(self, anchor: np.ndarray) -> Any:
        return None

    def end_order(self, output: Any, token: Any) -> Any:
        return output

    def exchange_rows(
        self, items: Sequence[tuple[np.ndarray, Any]], token: Any
    ) -> tuple[list[np.ndarray], Any]:
        sent = recv = 0
        for dst in range(self.size):  # one message per peer, all items packed together
            msg = [t[plan.send_rows[dst]] for t, plan in items]
            if any(m.shape[0] for m in msg):
                self.world.box[("p2p", self.rank, dst)] = msg
                sent += sum(m.nbytes for m in msg)
        self.world.barrier.wait()
        outs = []
        received = {}
        for src in range(self.size):
            if any(plan.recv_counts[src] for _, plan in items):
                received[src] = self.world.box[("p2p", src, self.rank)]
                recv += sum(m.nbytes for m in received[src])
        for i, (t, plan) in enumerate(items):
            parts = [received[s][i] for s in range(self.size) if plan.recv_counts[s]]
            outs.append(np.concatenate([*parts, t]) if parts else t)
        self.world.barrier.wait()
        self.world.box.pop(("p2p", self.rank, self.rank), None)
        name = getattr(items[0][1], "exchange_name", "") if items else ""
        self._count("exchange_rows", sent, recv, name)
        return outs, token

    def all_gather_rows(self, tensor: np.ndarray, token: Any) -> tuple[np.ndarray, Any]:
        self.world.box[("ag", self.rank)] = tensor
        self.world.barrier.wait()
        parts = [self.world.box[("ag", k)] for k in range(self.size)]
        self.world.barrier.wait()
        self._count("all_gather_rows", tensor.nbytes, tensor.nbytes * (self.size - 1))
        return np.concatenate(parts), token

    def all_gather_dim(self, tensor: np.ndarray, dim: int) -> np.ndarray:
        self.world.box[("agd", self.rank)] = tensor
        self.world.barrier.wait()
        parts = [self.world.box[("agd", k)] for k in range(self.size)]
        self.world.barrier.wait()
        return np.concatenate(parts, axis=dim)

    def all_gather_meta(self, values: np.ndarray) -> np.ndarray:
        self.world.box[("meta", self.rank)] = np.asarray(values)
        self.world.barrier.wait()
        out = np.stack([self.world.box[("meta", k)] for k in range(self.size)])
        self.world.barrier.wait()
        return out

    def stats(self) -> dict[str, Any]:
        """The one schema of :mod:`hp_cp_core.stats`."""
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_recv": self.bytes_recv,
            "collectives": dict(self.calls),
        }


class FakeMesh:
    """What a user passes to ``enable_cp``: the world and this thread's rank."""

    def __init__(self, world: FakeWorld, rank: int) -> None:
        self.world = world
        self.rank = rank


# --------------------------------------------------------------------------------------------
# the toy layer


class ToyAttention:
    """A DeepSeek-V4-shaped toy: window + compressed slots (+ indexer top-k for r = 4).

    ``forward(x, cu_seqlens=None)`` takes ``x [rows, hidden]`` (sequence-major, packed when
    ``cu_seqlens`` is given) and returns ``[rows, d]``.
    """

    def __init__(
        self,
        hidden: int = 6,
        d: int = 5,
        *,
        compress_ratio: int = 4,
        window_size: int = 8,
        index_topk: int = 3,
        packed_grid: str = "per_document",
        seed: int = 0,
        has_indexer: bool | None = None,
        reuses: tuple[str, ...] = (),
    ) -> None:
        rng = np.random.default_rng(seed)
        self.r, self.W, self.topk, self.grid = compress_ratio, window_size, index_topk, packed_grid
        # r = 4 has an indexer by default; r = 1, W = 0 is DSA (an indexer over tokens)
        self.has_indexer = compress_ratio == 4 if has_indexer is None else has_indexer
        self.reuses = tuple(reuses)
        self.hidden, self.d = hidden, d
        self.wq, self.wk, self.wqi = (rng.normal(size=(hidden, d)) for _ in range(3))
        self.wc, self.wp, self.wci = (rng.normal(size=(hidden, d)) for _ in range(3))
        self.cp_forward: Callable[..., Any] | None = None

    # token-local projections
    def project(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return x @ self.wq, x @ self.wk, x @ self.wqi

    def compress(self, rows: np.ndarray, rope_pos_offset: int, w: np.ndarray) -> np.ndarray:
        """Every complete block of r rows -> one slot; r = 4 also reads the previous block."""
        r = self.r
        n = rows.shape[0] // r
        blocks = rows[: n * r].reshape(n, r, rows.shape[1])
        weights = np.arange(1, r + 1)[None, :, None]
        own = np.tanh(((blocks @ w) * weights).sum(1))
        if r == 4 and n:
            prev = np.concatenate([np.zeros_like(blocks[:1]), blocks[:-1]])
            own = own + 0.5 * np.tanh((prev @ self.wp).sum(1)) * (np.arange(n) > 0)[:, None]
        pos = rope_pos_offset + r * np.arange(n)
        return own + 0.01 * np.cos(pos)[:, None]

    def forward(self, x: np.ndarray, cu_seqlens: Any = None) -> np.ndarray:
        q, k, qi = self.project(x)
        if self.cp_forward is not None:
            return self.cp_forward(q, k, x, qi, cu_seqlens=cu_seqlens)
        return single_device(self, x, cu_seqlens)

    __call__ = forward


def attend(q: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Softmax attention of one query over its key rows (K = V)."""
    s = keys @ q
    p = np.exp(s - s.max())
    return (p / p.sum()) @ keys


def topk_lower_first(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores, ties broken by lower index."""
    return np.argsort(-scores, kind="stable")[:k]


def single_device(
    layer: ToyAttention, x: np.ndarray, cu_seqlens: Any = None, source: Any = None
) -> np.ndarray:
    """The toy layer on one device, from the per-token definitions (no core code).

    ``source``: the layer whose artifacts ``layer.reuses`` names (its compressed KV, index
    keys, selection stand in for ``layer``'s own)."""
    if source is not None:
        return _single_device_shared(layer, source, x, cu_seqlens)
    return _single_device(layer, x, cu_seqlens)[0]


def _single_device_shared(layer: Any, source: Any, x: np.ndarray, cu: Any) -> np.ndarray:
    """A reader's single-device output: the owner's selection (and slots when reused)."""
    _, picks = _single_device(source, x, cu)
    kv = source if "compressed_kv" in layer.reuses else layer
    out, _ = _single_device(layer, x, cu, picks_from=picks, kv_layer=kv)
    return out


def _single_device(
    layer: Any, x: np.ndarray, cu_seqlens: Any = None, picks_from: Any = None, kv_layer: Any = None
) -> tuple[np.ndarray, list[list[int]]]:
    kv_layer = layer if kv_layer is None else kv_layer
    q, k, qi = layer.project(x)
    n, r, W = x.shape[0], layer.r, layer.W
    cu = [0, n] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    docs = [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    doc_of = np.zeros(n, dtype=int)
    for i, (a, b) in enumerate(docs):
        doc_of[a:b] = i
    slots = []  # (block_start, main, indexer key)
    if r > 0 and (layer.grid == "global" and cu_seqlens is not None):
        for j, (main, ik) in enumerate(
            zip(kv_layer.compress(x, 0, kv_layer.wc), layer.compress(x, 0, layer.wci))
        ):
            a = j * r
            valid = doc_of[a] == doc_of[a + r - 1]
            slots.append((a, main, ik, doc_of[a] if valid else -1))
    elif r > 0:
        for i, (a, b) in enumerate(docs):
            mains = kv_layer.compress(x[a:b], 0, kv_layer.wc)
            iks = layer.compress(x[a:b], 0, layer.wci)
            for j in range(mains.shape[0]):
                slots.append((a + j * r, mains[j], iks[j], i))
    out = np.zeros((n, layer.d))
    picked: list[list[int]] = []  # per query: the picks, as positions in its visible list
    for t in range(n):
        a = cu[doc_of[t]]
        keys = [k[s] for s in range(max(a, t - W + 1), t + 1)]
        vis = [(m, ik) for (s0, m, ik, d) in slots if d == doc_of[t] and s0 + r - 1 <= t]
        if r > 0 and not layer.has_indexer:
            keys += [m for m, _ in vis]
            picked.append([])
        elif r > 0 and vis:
            if picks_from is not None:
                pick = picks_from[t]
            else:
                scores = np.maximum(np.stack([ik for _, ik in vis]) @ qi[t], 0.0)
                pick = list(topk_lower_first(scores, layer.topk))
            picked.append(pick)
            keys += [vis[j][0] for j in pick]
        else:
            picked.append([])
        out[t] = attend(q[t], np.stack(keys))
    return out, picked


# --------------------------------------------------------------------------------------------
# the backend and its hooks


class FakeBackend:
    """Tensor ops on numpy plus install/uninstall on ``ToyAttention``."""

    name = "fake"

    def group(self, mesh: Any) -> Any:
        if isinstance(mesh, ThreadMesh):  # the kit's world (the contract driver)
            return ThreadGroup(mesh)
        if not isinstance(mesh, FakeMesh):
            raise HpCpError(f"the fake backend needs a FakeMesh, got {type(mesh).__name__}.")
        return FakeGroup(mesh.world, mesh.rank)

    def find_layers(self, module: Any) -> list[Any]:
        return [module] if isinstance(module, ToyAttention) else list(getattr(module, "layers", []))

    def install(self, layer: ToyAttention, cp_forward: Callable[..., Any], group: Any) -> Any:
        previous = layer.cp_forward
        if group.size > 1 or not cp_forward.config.single_rank_bypass:
            layer.cp_forward = cp_forward
        return previous

    def uninstall(self, layer: ToyAttention, token: Any) -> None:
        layer.cp_forward = token

    # ops (dim 0 = rows)
    def cat(self, tensors):
        return np.concatenate(list(tensors))

    def narrow(self, t, start, length):
        return t[start : start + length]

    def index_rows(self, t, index):
        return t[np.asarray(index)]

    def num_rows(self, t):
        return int(t.shape[0])

    def flatten_rows(self, t):
        return t.reshape(t.shape[0], int(np.prod(t.shape[1:])))

    def unflatten_rows(self, t, like_shape):
        return t.reshape(like_shape)

    def cat_features(self, tensors):
        return np.concatenate(list(tensors), axis=1)

    def split_features(self, t, sizes):
        return np.split(t, np.cumsum(sizes)[:-1], axis=1)

    def pad_rows(self, t, rows):
        return np.concatenate([t, np.zeros((rows - t.shape[0], *t.shape[1:]), t.dtype)])

    def shape(self, t):
        return tuple(t.shape)

    def take(self, t, index, dim):
        return np.take(t, np.asarray(index), axis=dim)

    def as_tensor(self, values, like):
        return np.asarray(values)

    def to_numpy(self, t):
        return np.asarray(t)

    def pad_dim(self, t, dim, size, value):
        widths = [(0, 0)] * t.ndim
        widths[dim] = (0, max(int(size) - t.shape[dim], 0))
        return np.pad(t, widths, constant_values=value)


BACKEND = FakeBackend()


@hookimpl
def hp_cp_backend_api() -> str:
    return BACKEND_API  # the version this fake implements: the core's current one


@hookimpl
def hp_cp_backend(module: Any) -> Any:
    """The fake backend claims a toy layer, or a stack of them (``module.layers``)."""
    layers = getattr(module, "layers", None)
    stack = isinstance(layers, list) and bool(layers)
    stack = stack and all(isinstance(lay, ToyAttention) for lay in layers)
    return BACKEND if isinstance(module, ToyAttention) or stack else None


@hookimpl
def hp_cp_layer_spec(module: Any) -> Any:
    if not isinstance(module, ToyAttention):
        return None
    return LayerSpec(
        compress_ratio=module.r,
        window_size=module.W,
        has_indexer=module.has_indexer,
        packed_grid=module.grid,
        reuses=module.reuses,
    )


@hookimpl
def hp_cp_extract_ori_kv(module: Any, key: Any) -> Any:
    return key if isinstance(module, ToyAttention) else None


@hookimpl
def hp_cp_compress_main(module: Any, x: Any, halo_x: Any, call: Any) -> Any:
    if not isinstance(module, ToyAttention):
        return None
    return stage1_compress_with_halo(
        lambda rows, off: module.compress(rows, off, module.wc), x, halo_x, call
    )


@hookimpl
def hp_cp_compress_indexer(module: Any, x: Any, halo_x: Any, call: Any) -> Any:
    if not isinstance(module, ToyAttention):
        return None
    return stage1_compress_with_halo(
        lambda rows, off: module.compress(rows, off, module.wci), x, halo_x, call
    )


@hookimpl
def hp_cp_run_attention(module: Any, query: Any, ori_ext: Any, x: Any, qr: Any, call: Any) -> Any:
    if not isinstance(module, ToyAttention):
        return None
    plan = call.plan
    win = window_index_dense(plan.window_start, plan.window_len, module.W)
    width = int(plan.cmp_count.max()) if plan.cmp_count.size else 0
    cmp_idx = compressed_index_dense(plan.cmp_start, plan.cmp_count, width)
    out = np.zeros((query.shape[0], module.d))
    reused = call.reused.get("selection")
    picks = []  # per local query: global slot ids of its picks (what a reader reuses)
    for i in range(query.shape[0]):
        keys = [ori_ext[j] for j in win[i] if j >= 0]
        vis = [j for j in cmp_idx[i] if j >= 0]
        if module.has_indexer and reused is not None:
            vis = list(reused[i])
        elif module.has_indexer and vis:
            scores = np.maximum(call.cmp_idx_global[vis] @ qr[i], 0.0)
            vis = [vis[j] for j in topk_lower_first(scores, module.topk)]
        picks.append(vis)
        keys += [call.cmp_kv_global[j] for j in vis]
        out[i] = attend(query[i], np.stack(keys))
    if call.roles is not None and call.roles.publishes("selection"):
        call.outputs["selection"] = picks
    return out

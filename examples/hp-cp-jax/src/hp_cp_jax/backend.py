"""The JAX ``Backend`` (tensor ops) and ``Group`` (differentiable collectives) for hp_cp.

The group runs on the kit's in-process world (:class:`hp_cp_core.testing.ThreadGroup`): its
numpy forward and backward of each layer exchange become one ``jax.custom_vjp`` op. JAX runs
backward as the forward program transposed, so the collectives' backward order is fixed
already; the order token is still a real (scalar, zero) JAX value threaded through every
exchange, because it keeps each exchange *connected*: a rank whose compressor returned a
fresh 0-row array would otherwise feed the all-gather a constant, JAX would record no
backward for it there, and that rank would skip a backward collective its peers run.

Eager mode only (the exchanges call the world from Python); do not ``jax.jit`` a CP forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hp_cp_core import HpCpError
from hp_cp_core.testing import ThreadGroup, ThreadMesh


class JaxGroup:
    """The core's ``Group`` protocol on a thread world, differentiable in JAX."""

    def __init__(self, mesh: ThreadMesh) -> None:
        self.kit = ThreadGroup(mesh)
        self.rank, self.size = self.kit.rank, self.kit.size

    def begin_order(self, anchor: jax.Array) -> jax.Array:
        """A zero scalar computed from the layer input (so it is in the graph)."""
        return jnp.sum(anchor[:0])

    def exchange_rows(
        self, items: Sequence[tuple[jax.Array, Any]], token: jax.Array
    ) -> tuple[list[jax.Array], jax.Array]:
        kit, plans = self.kit, [p for _, p in items]

        @jax.custom_vjp
        def exchange(arrays: list[jax.Array], token: jax.Array):
            outs = kit.exchange_rows_np([np.asarray(a) for a in arrays], plans)
            return [jnp.asarray(o) for o in outs], token

        def forward(arrays, token):
            return exchange(arrays, token), None

        def backward(_, cotangents):
            douts, dtoken = cotangents
            grads = kit.exchange_rows_backward_np([np.asarray(g) for g in douts], plans)
            return [jnp.asarray(g) for g in grads], dtoken

        exchange.defvjp(forward, backward)
        return exchange([t for t, _ in items], token)

    def all_gather_rows(self, tensor: jax.Array, token: jax.Array) -> tuple[jax.Array, Any]:
        kit = self.kit

        @jax.custom_vjp
        def gather(tensor: jax.Array, token: jax.Array):
            return jnp.asarray(kit.all_gather_rows_np(np.asarray(tensor))), token

        def forward(tensor, token):
            return gather(tensor, token), None

        def backward(_, cotangents):
            dgathered, dtoken = cotangents
            return jnp.asarray(kit.all_gather_rows_backward_np(np.asarray(dgathered))), dtoken

        gather.defvjp(forward, backward)
        return gather(tensor, token)

    def end_order(self, output: jax.Array, token: jax.Array) -> jax.Array:
        """``output + token``: the same values (the token is 0), and backward starts the
        chain of exchange backwards from the output's cotangent."""
        return output + token

    def all_gather_dim(self, tensor: Any, dim: int) -> jax.Array:
        return jnp.asarray(self.kit.all_gather_dim(np.asarray(tensor), dim))

    def all_gather_meta(self, values: np.ndarray) -> np.ndarray:
        return self.kit.all_gather_meta(values)

    def stats(self) -> dict[str, Any]:
        return self.kit.stats()


class JaxBackend:
    """Tensor ops on ``jax.Array`` (dim 0 = rows) and the install on ``SparseAttention``."""

    name = "jax"

    def group(self, mesh: Any) -> JaxGroup:
        if not isinstance(mesh, ThreadMesh):
            raise HpCpError(
                f"the jax example backend runs on the kit's thread world: pass "
                f"world.mesh(rank) (a hp_cp_core.testing.ThreadMesh), got {type(mesh).__name__}."
            )
        return JaxGroup(mesh)

    def find_layers(self, module: Any) -> list[Any]:
        return [module]

    def install(self, layer: Any, cp_forward: Any, group: Any) -> Any:
        previous = layer.cp_forward
        if group.size > 1 or not cp_forward.config.single_rank_bypass:
            layer.cp_forward = cp_forward
        return previous

    def uninstall(self, layer: Any, token: Any) -> None:
        layer.cp_forward = token

    def cat(self, tensors: Sequence[jax.Array]) -> jax.Array:
        return jnp.concatenate(list(tensors))

    def narrow(self, t: jax.Array, start: int, length: int) -> jax.Array:
        return t[start : start + length]

    def index_rows(self, t: jax.Array, index: np.ndarray) -> jax.Array:
        return t[jnp.asarray(index, dtype=jnp.int32)]

    def num_rows(self, t: jax.Array) -> int:
        return int(t.shape[0])

    def flatten_rows(self, t: jax.Array) -> jax.Array:
        return t.reshape(t.shape[0], int(np.prod(t.shape[1:], dtype=np.int64)))

    def unflatten_rows(self, t: jax.Array, like_shape: tuple[int, ...]) -> jax.Array:
        return t.reshape(like_shape)

    def cat_features(self, tensors: Sequence[jax.Array]) -> jax.Array:
        return jnp.concatenate(list(tensors), axis=1)

    def split_features(self, t: jax.Array, sizes: Sequence[int]) -> list[jax.Array]:
        bounds = np.cumsum([0, *sizes])
        return [t[:, int(a) : int(b)] for a, b in zip(bounds[:-1], bounds[1:])]

    def pad_rows(self, t: jax.Array, rows: int) -> jax.Array:
        return jnp.pad(t, [(0, rows - t.shape[0])] + [(0, 0)] * (t.ndim - 1))

    def shape(self, t: Any) -> tuple[int, ...]:
        return tuple(int(s) for s in t.shape)

    def take(self, t: Any, index: np.ndarray, dim: int) -> jax.Array:
        return jnp.take(jnp.asarray(t), jnp.asarray(index, dtype=jnp.int32), axis=dim)

    def pad_dim(self, t: Any, dim: int, size: int, value: Any) -> jax.Array:
        t = jnp.asarray(t)
        widths = [(0, 0)] * t.ndim
        widths[dim] = (0, max(int(size) - int(t.shape[dim]), 0))
        return jnp.pad(t, widths, constant_values=value)

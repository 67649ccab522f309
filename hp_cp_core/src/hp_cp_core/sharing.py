"""Cross-layer sharing: which layer makes (owns) each compressed KV, index-key set,
selection and candidate-block set, which later layers reuse it, and the per-handle store that
hands it on.

Note [The sparse-attention family]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
One :class:`~hp_cp_core.spec.LayerSpec` describes every layer of the DeepSeek
sparse-attention family; the plan (slots, visibility, exchanges) is the same code for all:

* **DSA** (DeepSeek V3.2, GLM-5): ``compress_ratio = 1`` (every token is its own slot, the
  compressor is the identity: the slot of token j is its own KV row), ``window_size = 0``
  and an indexer over tokens: query t picks its top-k among tokens ``0 .. t`` of its
  document (itself included). No row of an earlier rank is read except through the slots,
  so the layer runs no halo exchange; the slots (KV latents and index keys) travel once, as
  the causal-prefix slot exchange (Note [Causal-prefix slot exchange] in
  :mod:`hp_cp_core.slot_exchange`).
* **V4** SWA / CSA / HCA: ratios 0 / 4 / 128 with a window of 128.
* **V4.1 CSA2**: a ratio per layer (0, 1 or r >= 2, pooled without overlap:
  ``overlapping=False``), a window, an indexer whose two levels sit in different layers
  (below), and state handed from one layer to the next (below).

Note [Layers that share their indexer]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A layer may reuse an earlier layer's artifacts (``LayerSpec.reuses``, out of
:data:`~hp_cp_core.spec.ARTIFACTS`): the gathered main compressed KV, the gathered indexer
keys, the per-query selection, or the per-query candidate blocks of a two-level indexer. The
layer that made an artifact is its *owner*; it gathers it once, and every layer of its group
reads it with no collective of its own. DeepSeek V4.1's schedule (Full, Reindex and Reuse
layers; the two-level indexer's candidate source is a Full layer) and GLM-5's (DSA layers
whose indexer is ``"full"`` or ``"shared"``)::

    V4.1 layer       0 Full     1 Reindex   2 Reuse     3 Full+cand  4 Reindex   5 Reuse
    reuses           -          kv, keys    kv, keys,   -            kv, keys,   kv, keys,
                                            selection                candidates  selection
    compressed_kv    makes      <- 0        <- 0        makes        <- 3        <- 3
    index_keys       makes      <- 0        <- 0        makes        <- 3        <- 3
    selection        makes      makes       <- 1        makes        makes       <- 4
    candidates       -          -           -           makes        <- 3        -
    exchanges        halo slots halo        halo        halo slots   halo        halo

    GLM-5 layer      0 full     1 shared    2 shared    3 full
    reuses           -          selection   selection   -
    compressed_kv    makes      makes       makes       makes
    index_keys       makes      -           -           makes
    selection        makes      <- 0        <- 0        makes
    exchanges        slots      slots       slots       slots

* a layer that makes no slot of its own (``LayerSpec.makes_slots`` false: it reuses the
  compressed KV and, with an indexer, the keys or the selection) has no compressor: its plan
  has the owner's slot visibility (same ratio, layout and documents give the same slot
  table) but no x halo and no slot exchange; it exchanges its window halo, nothing else;
* selections and candidate blocks are per local query: they never travel, the owner's
  ``hp_cp_run_attention`` puts them in ``call.outputs`` and the reader finds them in
  ``call.reused``;
* the gathered slots reach the reader in ``call.slots`` / ``call.keys``,
  as if it had gathered them itself.

:func:`plan_sharing` resolves the owners (``share_from``, else the nearest earlier layer
that makes the artifact), checks that owner and reader agree on the slot grid (ratio and
packed grid; candidate blocks also need the same ``index_block``), and raises
:class:`~hp_cp_core.errors.HpCpError` in ``enable_cp``, on every rank alike (the specs are
the same everywhere), before any collective. :meth:`SharingPlan.describe` is the table
above as data ("which layer owns what").

At run time the owner's forward publishes into the handle's :class:`SharedState` (the
gathered slot buffers; the selection and candidates its backend put in ``call.outputs``) and
a reader takes them, checked to come from the same sequence (rows and document boundaries).
A reader whose owner has not published for its sequence (a model that skips or reorders
layers, a layer called alone) fails in its input check, on every rank, before any exchange.
The store keeps one entry per owner, replaced by the owner's next forward (activation
checkpointing re-runs a reader in backward, which must find it) and emptied by
``disable_cp``.

Backward order still holds by construction (Note [Backward order] in
:mod:`hp_cp_core.collectives`): a reader's use of a gathered buffer adds a gradient to the
owner's exchange output, and autograd runs that exchange's backward only once every
gradient of its output is in, i.e. after the readers' backward, on every rank alike; a
reader that runs no collective threads no token, and one that runs its own halo exchange
threads its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hp_cp_core.errors import HpCpError
from hp_cp_core.spec import ARTIFACTS, LayerSpec

__all__ = ["LayerRoles", "SharedState", "SharingPlan", "plan_sharing"]


@dataclass(frozen=True)
class LayerRoles:
    """One layer's part in the sharing plan.

    Attributes:
        layer: the layer's index (``enable_cp``'s order).
        makes: the artifacts it computes itself (subset of
            :data:`~hp_cp_core.spec.ARTIFACTS`).
        owners: ``(artifact, owner layer)`` for every artifact the layer uses: itself for
            what it makes, the owner for what it reuses.
        readers: ``(artifact, later layers reusing it)`` for what it makes and someone reuses.
        exchanges: the collectives of its forward: ``"halo"`` (window / compressor rows)
            and ``"slots"`` (its own compressed KV and index keys); empty for a layer that
            only reads what others gathered.
    """

    layer: int
    makes: tuple[str, ...]
    owners: tuple[tuple[str, int], ...]
    readers: tuple[tuple[str, tuple[int, ...]], ...]
    exchanges: tuple[str, ...]

    def owner(self, artifact: str) -> int | None:
        """The layer that makes ``artifact`` for this one (itself if it makes it)."""
        return dict(self.owners).get(artifact)

    def reuses(self, artifact: str) -> bool:
        """Whether this layer receives ``artifact`` from another layer."""
        owner = self.owner(artifact)
        return owner is not None and owner != self.layer

    def publishes(self, artifact: str) -> bool:
        """Whether a later layer reuses this layer's ``artifact``."""
        return bool(dict(self.readers).get(artifact))


@dataclass(frozen=True)
class SharingPlan:
    """Who owns what across the layers of one ``enable_cp`` call.

    Attributes:
        layers: one :class:`LayerRoles` per layer, in order.
    """

    layers: tuple[LayerRoles, ...]

    def roles(self, layer: int) -> LayerRoles:
        """The roles of layer ``layer``."""
        return self.layers[layer]

    def describe(self) -> list[dict[str, Any]]:
        """Per layer, as plain data: what it makes, the owner of each artifact it uses, who
        reads what it makes, and its collectives (see Note [Layers that share their
        indexer])."""
        return [
            {
                "layer": r.layer,
                "makes": list(r.makes),
                "owners": dict(r.owners),
                "readers": {a: list(v) for a, v in r.readers},
                "exchanges": list(r.exchanges),
            }
            for r in self.layers
        ]


def _uses(spec: LayerSpec) -> tuple[str, ...]:
    """The artifacts a layer's attention reads (made or reused)."""
    out = []
    if int(spec.compress_ratio) > 0:
        out.append("compressed_kv")
    if spec.has_indexer:
        if spec.makes_index_keys or "index_keys" in spec.reuses:
            out.append("index_keys")
        out.append("selection")
        if spec.makes_candidates or "candidates" in spec.reuses:
            out.append("candidates")
    return tuple(out)


def _makes(spec: LayerSpec) -> tuple[str, ...]:
    flags = (
        spec.makes_compressed_kv,
        spec.makes_index_keys,
        spec.makes_selection,
        spec.makes_candidates,
    )
    return tuple(a for a, on in zip(ARTIFACTS, flags) if on)


def plan_sharing(specs: Sequence[LayerSpec]) -> SharingPlan:
    """Resolve which layer owns each artifact every layer uses (Note [Layers that share
    their indexer]).

    Args:
        specs: the layers' specs, in the order ``enable_cp`` found them (the forward order).

    Returns:
        The :class:`SharingPlan`.

    Raises:
        HpCpError: a layer reuses an artifact no earlier layer makes, names a ``share_from``
            layer that does not make it, or reuses it from a layer on another slot grid
            (compress ratio, packed grid) or, for candidate blocks, of another block size
            (``index_block``).
    """
    made: dict[str, list[int]] = {a: [] for a in ARTIFACTS}
    owners: list[dict[str, int]] = []
    for i, spec in enumerate(specs):
        own: dict[str, int] = {}
        mine = _makes(spec)
        for artifact in _uses(spec):
            if artifact in mine:
                own[artifact] = i
                continue
            src = spec.share_from
            if src is None:
                if not made[artifact]:
                    raise HpCpError(
                        f"layer {i} reuses {artifact!r} (LayerSpec.reuses={spec.reuses!r}) but "
                        f"no earlier layer makes it; the first layer of a group must compute "
                        "it (reuses=()), or pass share_from= the layer that does."
                    )
                src = made[artifact][-1]
            src = int(src)
            if src >= i or src not in made[artifact]:
                raise HpCpError(
                    f"layer {i} reuses {artifact!r} from layer {src} (share_from), which "
                    f"{'is not an earlier layer' if src >= i else 'does not make it'}; layers "
                    f"that make {artifact!r}: {made[artifact]}."
                )
            _check_compatible(i, spec, src, specs[src], artifact)
            own[artifact] = src
        for artifact in mine:
            made[artifact].append(i)
        owners.append(own)
    readers: list[dict[str, list[int]]] = [{} for _ in specs]
    for i, own in enumerate(owners):
        for artifact, src in own.items():
            if src != i:
                readers[src].setdefault(artifact, []).append(i)
    roles = []
    for i, spec in enumerate(specs):
        exchanges = []
        if spec.needs_halo:
            exchanges.append("halo")
        if spec.makes_slots:
            exchanges.append("slots")
        roles.append(
            LayerRoles(
                layer=i,
                makes=_makes(spec),
                owners=tuple(sorted(owners[i].items(), key=lambda kv: ARTIFACTS.index(kv[0]))),
                readers=tuple((a, tuple(v)) for a, v in sorted(readers[i].items())),
                exchanges=tuple(exchanges),
            )
        )
    return SharingPlan(tuple(roles))


def _check_compatible(i: int, spec: LayerSpec, src: int, owner: LayerSpec, artifact: str) -> None:
    same_grid = (int(spec.compress_ratio), spec.packed_grid) == (
        int(owner.compress_ratio),
        owner.packed_grid,
    )
    if not same_grid:
        raise HpCpError(
            f"layer {i} (compress_ratio={spec.compress_ratio}, packed_grid="
            f"{spec.packed_grid!r}) reuses {artifact!r} from layer {src} (compress_ratio="
            f"{owner.compress_ratio}, packed_grid={owner.packed_grid!r}); slots and selections "
            "are numbered on the slot grid, so both layers need the same ratio and grid."
        )
    if artifact == "candidates" and int(spec.index_block) != int(owner.index_block):
        raise HpCpError(
            f"layer {i} (index_block={spec.index_block}) reuses the candidate blocks of layer "
            f"{src} (index_block={owner.index_block}); a candidate block is index_block slots, "
            "so give both layers the same index_block."
        )


@dataclass
class SharedState:
    """The artifacts owners published in the current forward, for the layers that reuse
    them (one per ``enable_cp`` handle; see Note [Layers that share their indexer]).

    Attributes:
        entries: ``owner layer -> (sequence key, {artifact: value})``.
    """

    entries: dict[int, tuple[Any, dict[str, Any]]] = field(default_factory=dict)

    def publish(self, owner: int, key: Any, artifacts: dict[str, Any]) -> None:
        """Record ``artifacts`` of layer ``owner`` for the sequence ``key`` (replacing its
        previous forward's)."""
        prev = self.entries.get(owner)
        if prev is not None and prev[0] == key:
            prev[1].update(artifacts)
        else:
            self.entries[owner] = (key, dict(artifacts))

    def take(self, reader: int, owner: int, key: Any, artifact: str) -> Any:
        """``artifact`` of layer ``owner`` for the sequence ``key``, read by layer ``reader``.

        Raises:
            HpCpError: the owner did not run on this sequence before the reader (a model that
                skips or reorders layers, or a layer called on its own); the same on every rank,
                since the ranks agreed on the sequence.
        """
        entry = self.entries.get(owner)
        if not self.has(owner, key, artifact):
            have = "nothing" if entry is None else f"sequence {entry[0]!r}"
            raise HpCpError(
                f"layer {reader} reuses {artifact!r} of layer {owner}, but layer {owner} has not "
                f"published it for this sequence {key!r} (it holds {have}). Run the layers in "
                "the model's order in one forward; a layer that reuses another's state cannot "
                "run on its own under CP."
            )
        return entry[1][artifact]

    def clear(self) -> None:
        """Forget every entry (``disable_cp``)."""
        self.entries.clear()

    def has(self, owner: int, key: Any, artifact: str) -> bool:
        """Whether layer ``owner`` published ``artifact`` for the sequence ``key``."""
        entry = self.entries.get(owner)
        return entry is not None and entry[0] == key and artifact in entry[1]

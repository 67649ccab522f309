"""Which layer of a model owns the compressed slots, indexer keys and selection the others
read (DeepSeek V4.1's CSA2 schedule); pure data, checked once at ``enable_cp``.

Note [Shared slots]
~~~~~~~~~~~~~~~~~~~
In DeepSeek V4.1 only some compressed layers compress. The model's schedule names them::

    layer     0    1     2      3        4     5        6
    ratio     0    2     2      2        1     1        1
    role      SWA  Full  Reuse  Reindex  Full  Reindex  Reuse
    slots     -    own   <- 1   <- 1     own   <- 4     <- 4
    keys      -    own   -      <- 1     own   <- 4     -
    picks     -    own   <- 1   own      own   own      <- 5

* a **Full** layer (a KV source) compresses its slots and its indexer keys and selects;
* a **Reindex** layer (an index source that is no KV source) scores the last Full layer's
  keys with its own indexer queries: a new selection, nothing compressed;
* a **Reuse** layer attends the last Full layer's slots at the last selection;
* the two-level indexer's *candidate* blocks come from one Full layer and narrow every later
  layer's selection.

Under CP a Full layer exchanges its window halo, the x halo of the slots straddling a rank
boundary and its slots (main KV and indexer keys, one exchange: Note [Causal-prefix slot
exchange] in :mod:`hp_cp_core.slot_exchange`), and hands the received slots on in global slot
order. A shared layer (``LayerSpec(shares_slots=True)``) has the same slot visibility in its
plan (same ratio, layout and documents give the same slot table), so it reads that buffer
directly: it exchanges its own window halo and nothing else. Selections and candidates are
per local query and never travel. The slots of a group of layers are gathered once, by the
layer :func:`plan_sharing` names as their owner; a shared layer adds no byte.

Backward order still holds by construction (Note [Backward order] in
:mod:`hp_cp_core.collectives`): a shared layer's gradient reaches the owner's slot exchange
directly, and that exchange's backward waits for its order token, which only the owner's
output gradient releases, so it runs after every later layer's exchanges on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hp_cp_core.errors import HpCpError

__all__ = ["ROLES", "LayerShare", "plan_sharing"]

ROLES = ("window", "full", "reindex", "reuse")


@dataclass(frozen=True)
class LayerShare:
    """One layer's part in the schedule (layer ids are positions in the model's stack).

    Attributes:
        layer: this layer.
        role: ``"window"`` (r = 0), ``"full"``, ``"reindex"`` or ``"reuse"``.
        compress_ratio: the layer's ratio.
        slots_from: the layer whose compressed slots this one attends (itself when Full).
        keys_from: the layer whose indexer keys this one scores (Full / Reindex).
        picks_from: the layer whose selection this one attends (itself when it selects).
        candidates_from: the layer whose candidate blocks narrow this one's selection, or
            ``None``.
        makes_candidates: this layer chooses the candidate blocks.
    """

    layer: int
    role: str
    compress_ratio: int
    slots_from: int | None = None
    keys_from: int | None = None
    picks_from: int | None = None
    candidates_from: int | None = None
    makes_candidates: bool = False

    @property
    def exchanges_slots(self) -> bool:
        """Whether this layer's forward exchanges compressed slots (only a Full layer)."""
        return self.role == "full"


def plan_sharing(
    compress_ratios: Sequence[int],
    kv_sources: Sequence[int],
    index_sources: Sequence[int],
    candidate_source: int = -1,
) -> tuple[LayerShare, ...]:
    """The role and sources of every layer of a CSA2 stack (see Note [Shared slots]).

    Args:
        compress_ratios: one ratio per layer (0, 1 or >= 2).
        kv_sources: layers that compress (Full layers).
        index_sources: layers that select (Full and Reindex layers); includes ``kv_sources``.
        candidate_source: the Full layer choosing the candidate blocks, -1 for none; every
            later selecting layer selects among them.

    Raises:
        HpCpError: a shared layer with no earlier Full layer of its ratio, a Reuse layer with
            no earlier selection, or candidates that a later Full layer would drop.
    """
    ratios = [int(r) for r in compress_ratios]
    kv, ix = {int(i) for i in kv_sources}, {int(i) for i in index_sources}
    cand = int(candidate_source)
    if not kv <= ix:
        raise HpCpError(
            f"every KV source layer must also select (be an index source); layers "
            f"{sorted(kv - ix)} compress but do not select."
        )
    out: list[LayerShare] = []
    full: int | None = None
    picks: int | None = None
    cand_live = False
    for layer, r in enumerate(ratios):
        if r == 0:
            if layer in kv or layer in ix:
                raise HpCpError(
                    f"layer {layer} is sliding-window only (ratio 0) but listed as a KV or "
                    "index source; only compressed layers can be sources."
                )
            out.append(LayerShare(layer, "window", 0))
            continue
        if layer in kv:
            full, picks = layer, layer
            if cand_live and layer != cand:
                raise HpCpError(
                    f"Full layer {layer} comes after candidate source {cand}: its new state "
                    "drops the candidate blocks the later layers select among. Make the "
                    "candidate source the last KV source, or set candidate_source_layer_id -1."
                )
            makes = layer == cand
            cand_live = cand_live or makes
            out.append(
                LayerShare(layer, "full", r, layer, layer, layer, None, makes_candidates=makes)
            )
            continue
        if full is None or ratios[full] != r:
            raise HpCpError(
                f"compressed layer {layer} (ratio {r}) shares the slots of an earlier Full "
                f"layer of the same ratio, but the last Full layer before it is "
                f"{'none' if full is None else f'{full} (ratio {ratios[full]})'}."
            )
        candidates = cand if cand_live else None
        if layer in ix:
            picks = layer
            out.append(LayerShare(layer, "reindex", r, full, full, layer, candidates))
        else:
            out.append(LayerShare(layer, "reuse", r, full, None, picks))
    if cand >= 0 and not any(s.makes_candidates for s in out):
        raise HpCpError(
            f"candidate_source_layer_id {cand} is not a KV source layer of this stack "
            f"(KV sources: {sorted(kv)})."
        )
    return tuple(out)

"""Traffic of CP, exact from the plan: bytes each rank receives in one layer forward, against
that rank's own lower bound and against two peers' strategies (the ``comm_*``,
``mindformers_*`` and ``ulysses_*`` keys of ``hp-cp bench``).

Backward moves the same bytes the other way (every exchange's backward returns the gradient
of what it delivered; an all-to-all's is an all-to-all, an all-gather's a reduce-scatter of
the same size), so every ratio here holds for forward + backward too.

Note [Communication lower bound]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The least any correct CP scheme must deliver to rank k, counting each value once and every
value at its cheapest representation, whatever rank computes what:

* **window halo**: every remote row inside the window of one of k's queries
  (``max(doc_start, t-W+1) .. t``) as one KV row of ``D`` values. A KV row is a token-local
  projection of a ``hidden``-wide x row (hidden > D), so shipping KV is the cheapest.
* **compressed slots**: every slot visible to one of k's queries whose inputs
  (``dep_start .. last_row``: its block, and for r = 4 the previous block) are not all local
  to k, as the finished slot: ``D`` values, plus ``Di`` for the indexer key when r = 4. A
  straddling slot also counts once, as a finished slot: that is cheaper than any of its
  inputs (x rows of ``hidden``, or ``2 * r`` projected rows of ``2 * (D + Di)``), so the
  x halo costs nothing in the bound.
* nothing else: the rest of the layer is token-local.

For r = 4 this takes every visible slot's main KV as needed, although a query reads only
its top-k: it bounds every scheme that moves the main KV before the indexer has picked. A
scheme with a data-dependent second exchange (fetch only the picked slots) could move less
when the picks of a rank's queries overlap a lot; with 16384 queries picking 512 slots each
out of at most 32768, that needs strongly correlated picks.

Ours receives the window halo (exactly the bound's rows), the x halo of the slots it owns
whose inputs straddle ranks (``hidden``-wide rows: the one place it exceeds the bound), and,
point to point, exactly the remote slots its queries see (Note [Causal-prefix slot exchange]
in ``hp_cp_core.slot_exchange``)::

    cp = 4, contiguous, r = 128      rank 0   rank 1   rank 2   rank 3
    slots its queries see (x L/r)      1        2        3        4
    received, p2p        (x L/r)       0        1        2        3    = the bound
    received, all-gather (x L/r)       3        3        3        3    (the fallback)

``comm_max_rank_over_own_lower_bound_<layout>_r<r>`` is ``max_k ours_k / bound_k`` over the
ranks whose bound is not 0 (every rank against its own bound), and what the ranks with a
zero bound receive anyway is ``comm_bytes_unneeded_<layout>_r<r>`` (0 for ours);
``comm_total_over_sum_lower_bounds_<layout>_r<r>`` is ``sum_k ours_k / sum_k bound_k``.
``comm_max_rank_bytes_over_lower_bound_r<r>`` (contiguous) compares the busiest ranks,
``max_k ours_k / max_k bound_k``: a collective step lasts as long as its busiest rank. The
``comm_allgather_fallback_*`` keys give the same measures for the all-gather path of a group
without point-to-point (MindSpore on CPU).

Note [Peer strategies]
~~~~~~~~~~~~~~~~~~~~~~
Forward bytes one rank receives, ``c`` ranks, ``L = S / c`` rows each, ``b`` bytes per
element (Flash: hidden 4096, H = 64 heads of D = 512, Di = 128, q_lora_rank 1024, W = 128):

* **MindFormers** (all-gather every tail, contiguous): ``(c-1) * min(W-1, L) * D`` window
  tails; for r = 4 also ``(c-1) * r * hidden`` compressor tails and
  ``(c-1) * (L/r + 1) * (D + Di)`` compressed slots (one overlap slot each); for r = 128
  ``(c-1) * (L/r) * D``.
* **Ulysses** (DeepSpeed-Ulysses as VeOmni applies it to DeepSeek V4): an all-to-all turns the
  queries from sequence- to head-sharded, ``(c-1)/c * L * H * D``, and one turns the outputs
  back, as much again; the single KV head cannot be split by heads, so it is all-gathered,
  ``(c-1) * L * D``; the compressors read the whole sequence, so their hidden input x is
  all-gathered, ``(c-1) * L * hidden`` (r > 0; the indexer's compressor and weights read the
  same x); the indexer scores every query of the sequence, so its query input, the query
  residual, is all-gathered, ``(c-1) * L * q_lora_rank`` (r = 4)::

      ulysses_k = b * ( 2 * (c-1)/c * L*H*D  +  (c-1)*L*D
                        + [r > 0] (c-1)*L*hidden  +  [r = 4] (c-1)*L*q_lora_rank )

``ulysses_bytes_over_ours_r<r>`` and ``mindformers_allgather_bytes_over_ours_r<r>`` are the
peer's busiest rank over ours (contiguous, point to point).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hp_cp_core import LayerSpec, build_rank_plan
from hp_cp_core.indices import build_slot_table, compressed_visibility, window_start_rows
from hp_cp_core.layout import Documents, SequenceLayout

__all__ = [
    "DSA_V32",
    "FAMILY_KINDS",
    "FLASH",
    "dsa_comm_per_rank",
    "dsa_traffic_measures",
    "family_comm_per_rank",
    "LAYOUT_KEYS",
    "Shapes",
    "comm_per_rank",
    "traffic_measures",
]


@dataclass(frozen=True)
class Shapes:
    """Attention sizes for the traffic and work counts.

    Attributes:
        hidden: model width (x rows).
        head_dim: D, width of KV rows and compressed slots.
        n_heads: query heads.
        index_heads: indexer heads.
        index_dim: Di, indexer key width.
        topk: indexer picks per query.
        window: W.
        elem_bytes: bytes per element on the wire (2 = bf16).
        q_lora_rank: width of the query residual ``qr`` (the indexer's query input).
    """

    hidden: int = 4096
    head_dim: int = 512
    n_heads: int = 64
    index_heads: int = 64
    index_dim: int = 128
    topk: int = 512
    window: int = 128
    elem_bytes: int = 2
    q_lora_rank: int = 1024


FLASH = Shapes()
"""DeepSeek V4-Flash attention: hidden 4096, 64 heads of 512, indexer 64 x 128, top-k 512."""

LAYOUT_KEYS = {"contiguous": "contiguous", "load_balanced": "balanced"}
"""Layout -> its name in ``bench.json`` keys."""


def _lower_bound_rank(
    rank: int,
    layout: SequenceLayout,
    docs: Documents,
    ratio: int,
    shapes: Shapes,
    overlap: bool | None = None,
) -> tuple[int, int]:
    """``(window rows, remote slots)`` rank must receive (Note [Communication lower bound]).

    Computed from the per-token definitions (a difference array over every row), not from
    the plan's halo code, so it checks the plan as well as bounding it. ``overlap``: whether
    a slot also reads the previous block (default: V4's rule, r = 4).
    """
    overlap = ratio == 4 if overlap is None else overlap
    seq = docs.total_rows
    rows = layout.rank_rows(rank)
    local = np.zeros(seq, dtype=bool)
    local[rows] = True
    w0 = window_start_rows(rows, docs, shapes.window)
    cover = np.zeros(seq + 1, dtype=np.int64)
    np.add.at(cover, w0, 1)
    np.add.at(cover, rows + 1, -1)
    window_rows = int((np.cumsum(cover[:seq]) > 0)[~local].sum())
    if ratio == 0:
        return window_rows, 0
    grid = "per_document"
    slots = build_slot_table(docs, ratio, overlap, grid)
    start, count = compressed_visibility(rows, docs, ratio, grid)
    seen = np.zeros(slots.n_slots + 1, dtype=np.int64)
    np.add.at(seen, start[count > 0], 1)
    np.add.at(seen, (start + count)[count > 0], -1)
    visible = np.cumsum(seen[:-1]) > 0
    # a slot is computable locally iff every row it reads is local (a row prefix-sum test)
    local_prefix = np.concatenate([[0], np.cumsum(local)])
    span = slots.last_row + 1 - slots.dep_start
    all_local = local_prefix[slots.last_row + 1] - local_prefix[slots.dep_start] == span
    return window_rows, int((visible & ~all_local).sum())


def _mindformers_rank(seq: int, cp: int, ratio: int, shapes: Shapes) -> int:
    """Bytes per rank of MindFormers' all-gather strategy (Note [Peer strategies])."""
    d, di, h, rows = shapes.head_dim, shapes.index_dim, shapes.hidden, seq // cp
    out = (cp - 1) * min(shapes.window - 1, rows) * d
    if ratio == 4:
        out += (cp - 1) * ratio * h + (cp - 1) * (rows // ratio + 1) * (d + di)
    elif ratio:
        out += (cp - 1) * (rows // ratio) * d
    return out * shapes.elem_bytes


def ulysses_rank_bytes(seq: int, cp: int, ratio: int, shapes: Shapes = FLASH) -> int:
    """Bytes per rank of Ulysses sequence parallelism on one layer (Note [Peer strategies])."""
    rows = seq // cp
    elems = 2 * (cp - 1) * rows * shapes.n_heads * shapes.head_dim // cp  # q and o all-to-all
    elems += (cp - 1) * rows * shapes.head_dim  # the single KV head, all-gathered
    if ratio:
        elems += (cp - 1) * rows * shapes.hidden  # the compressors' input x
    if ratio == 4:
        elems += (cp - 1) * rows * shapes.q_lora_rank  # the indexer's query residual
    return elems * shapes.elem_bytes


def comm_per_rank(
    seq: int, cp: int, ratio: int, layout: str = "contiguous", shapes: Shapes = FLASH
) -> dict[str, np.ndarray]:
    """Forward bytes each rank receives: ours (from the plan; compressed slots point to
    point, and the all-gather fallback beside it), the rank's lower bound, and the peers'.

    Ours: window halo rows x D + x halo rows x hidden (one point-to-point message per peer)
    + the slots its queries see that other ranks own, x (D [+ Di]) (one more). The fallback
    replaces the last term with the all-gather's ``(cp - 1) * gather_cap * (D [+ Di])``.
    """
    b, d, h = shapes.elem_bytes, shapes.head_dim, shapes.hidden
    width = d + (shapes.index_dim if ratio == 4 else 0)
    spec = LayerSpec(compress_ratio=ratio, window_size=shapes.window, has_indexer=ratio == 4)
    docs = Documents.padded(seq)
    lay = SequenceLayout(layout, cp, seq)
    keys = ("ours", "ours_window", "ours_x", "ours_slots", "ours_allgather_fallback", "lower",
            "lower_window", "lower_slots", "mindformers", "ulysses")  # fmt: skip
    out: dict[str, list[int]] = {k: [] for k in keys}
    for k in range(cp):
        plan = build_rank_plan(rank=k, cp_size=cp, spec=spec, layout_kind=layout, total_rows=seq)
        win = plan.window.n_halo * d * b
        xb = (plan.x.n_halo if plan.x is not None else 0) * h * b
        slots = plan.slot_exchange.n_halo * width * b if ratio else 0
        gather = (cp - 1) * plan.gather_cap * width * b if ratio else 0
        lw, ls = _lower_bound_rank(k, lay, docs, ratio, shapes)
        for key, value in (
            ("ours", win + xb + slots),
            ("ours_window", win),
            ("ours_x", xb),
            ("ours_slots", slots),
            ("ours_allgather_fallback", win + xb + gather),
            ("lower", (lw * d + ls * width) * b),
            ("lower_window", lw * d * b),
            ("lower_slots", ls * width * b),
            ("mindformers", _mindformers_rank(seq, cp, ratio, shapes)),
            ("ulysses", ulysses_rank_bytes(seq, cp, ratio, shapes)),
        ):
            out[key].append(int(value))
    return {k: np.asarray(v, dtype=np.int64) for k, v in out.items()}


def _max_own_ratio(ours: np.ndarray, lower: np.ndarray) -> float:
    """``max_k ours_k / lower_k`` over the ranks that need something (1.0 when none does);
    what ranks that need nothing receive is reported apart (``*_bytes_unneeded_*``)."""
    need = lower > 0
    return float((ours[need] / lower[need]).max()) if need.any() else 1.0


def traffic_measures(seq: int, cp: int, shapes: Shapes = FLASH) -> dict[str, Any]:
    """Every traffic key of ``hp-cp bench`` (Note [Communication lower bound],
    Note [Peer strategies]); per-rank lists become ``key_<rank>`` in ``bench.json``."""
    res: dict[str, Any] = {}
    for r in (0, 4, 128):
        for layout, name in LAYOUT_KEYS.items():
            c = comm_per_rank(seq, cp, r, layout, shapes)
            ours, low, fallback = c["ours"], c["lower"], c["ours_allgather_fallback"]
            res[f"comm_max_rank_over_own_lower_bound_{name}_r{r}"] = _max_own_ratio(ours, low)
            res[f"comm_bytes_unneeded_{name}_r{r}"] = int(ours[low == 0].sum())
            res[f"comm_total_over_sum_lower_bounds_{name}_r{r}"] = float(
                ours.sum() / max(low.sum(), 1)
            )
            res[f"comm_allgather_fallback_max_rank_over_own_lower_bound_{name}_r{r}"] = (
                _max_own_ratio(fallback, low)
            )
            res[f"comm_allgather_fallback_total_over_sum_lower_bounds_{name}_r{r}"] = float(
                fallback.sum() / max(low.sum(), 1)
            )
            res[f"comm_allgather_fallback_bytes_unneeded_{name}_r{r}"] = int(
                fallback[low == 0].sum()
            )
            for k in ("ours", "lower", "ours_window", "ours_x", "ours_slots", "lower_window",
                      "lower_slots", "ours_allgather_fallback"):  # fmt: skip
                res[f"comm_{k}_bytes_per_rank_{name}_r{r}"] = c[k].tolist()
            if layout != "contiguous":
                continue
            busiest = max(int(ours.max()), 1)
            res[f"comm_max_rank_bytes_over_lower_bound_r{r}"] = float(
                ours.max() / max(low.max(), 1)
            )
            res[f"comm_ours_max_rank_bytes_r{r}"] = int(ours.max())
            res[f"comm_lower_bound_max_rank_bytes_r{r}"] = int(low.max())
            res[f"mindformers_allgather_bytes_over_ours_r{r}"] = float(
                c["mindformers"].max() / busiest
            )
            res[f"ulysses_bytes_over_ours_r{r}"] = float(c["ulysses"].max() / busiest)
            res[f"mindformers_allgather_max_rank_bytes_r{r}"] = int(c["mindformers"].max())
            res[f"ulysses_max_rank_bytes_r{r}"] = int(c["ulysses"].max())
    return res


# Note [Traffic of the DSA family]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The same bound holds for every layer of the family, read off its LayerSpec: the window
# halo (none without a window), and every remote-dependent visible slot once, finished,
# ``D`` wide plus ``Di`` when the layer makes its own index keys. A DSA layer (ratio 1, no
# window; DeepSeek V3.2, GLM-5) reads no row of another rank except through its slots: its
# bound is every remote token visible to one of its queries (its causal prefix, per
# document) as the MLA latent (``kv_lora_rank + qk_rope_head_dim``) plus the index key. A
# layer that *reuses* an artifact (a GLM-5 "shared" layer the selection; a V4.1 Reindex
# layer the compressed KV and index keys; a V4.1 Reuse layer all three) gets it from the
# layer that made it, on the same rank, with no collective: it adds nothing to the bound
# and ours moves nothing for it::
#
#     GLM-5, cp 4, one full + two shared layers      full      shared    shared
#     moved per rank (latents, index keys)           L + K     L         L
#     V4.1 ratio 2: Full, Reindex, Reuse             W+x+S     W         W
#
# (W: window halo, x: the straddling block's rows, S: remote slots.) The all-gather the
# public DSA CPs use delivers every remote token of the sequence to every rank, latents and
# keys (``dsa_allgather_*``).

DSA_V32 = Shapes(hidden=7168, head_dim=512 + 64, index_dim=128, window=0)
"""DeepSeek V3.2 / GLM-5 attention: hidden 7168, MLA latent 512 + 64 rope (the slot),
index keys 128, no window, bf16."""

FAMILY_KINDS: dict[str, tuple[LayerSpec, Shapes]] = {
    "dsa": (LayerSpec(compress_ratio=1, window_size=0, has_indexer=True), DSA_V32),
    "dsa_shared": (
        LayerSpec(compress_ratio=1, window_size=0, has_indexer=True, reuses=("selection",)),
        DSA_V32,
    ),
    "csa2_r2_full": (
        LayerSpec(compress_ratio=2, window_size=128, has_indexer=True, overlapping=False),
        FLASH,
    ),
    "csa2_r1_full": (
        LayerSpec(compress_ratio=1, window_size=128, has_indexer=True, index_block=64),
        FLASH,
    ),
    "csa2_r2_reindex": (
        LayerSpec(
            compress_ratio=2,
            window_size=128,
            has_indexer=True,
            overlapping=False,
            reuses=("compressed_kv", "index_keys"),
        ),
        FLASH,
    ),
    "csa2_r2_reuse": (
        LayerSpec(
            compress_ratio=2,
            window_size=128,
            has_indexer=True,
            overlapping=False,
            reuses=("compressed_kv", "index_keys", "selection"),
        ),
        FLASH,
    ),
}
"""The family's new layer kinds and the shapes their bytes are counted at: V3.2 / GLM-5 DSA
(full and shared) and V4.1's CSA2 (ratio 2 and ratio 1 Full layers, ratio 2 Reindex and Reuse
layers) at V4-Flash's attention sizes."""


def family_comm_per_rank(
    seq: int, cp: int, spec: LayerSpec, layout: str = "contiguous", shapes: Shapes = FLASH
) -> dict[str, np.ndarray]:
    """Forward bytes each rank receives in one layer of any kind of the family (Note [Traffic
    of the DSA family]): ours from the plan (window halo, x halo, point-to-point slots, each
    only where the layer makes them), the rank's own lower bound, and the all-gather of every
    remote token's slot that the public DSA CPs run (``allgather``; a layer that reuses the
    compressed KV gathers nothing)."""
    b, d, h = shapes.elem_bytes, shapes.head_dim, shapes.hidden
    ratio = int(spec.compress_ratio)
    width = (d if spec.makes_compressed_kv else 0) + (
        shapes.index_dim if spec.makes_index_keys else 0
    )
    docs = Documents.padded(seq)
    lay = SequenceLayout(layout, cp, seq)
    keys = ("ours", "ours_window", "ours_x", "ours_slots", "lower", "allgather")
    out: dict[str, list[int]] = {k: [] for k in keys}
    for k in range(cp):
        plan = build_rank_plan(rank=k, cp_size=cp, spec=spec, layout_kind=layout, total_rows=seq)
        win = plan.window.n_halo * d * b
        # a layer that reuses its slots plans no x halo and no slot exchange (the core's)
        xb = (plan.x.n_halo if plan.x is not None else 0) * h * b
        slots = (plan.slot_exchange.n_halo if plan.slot_exchange is not None else 0) * width * b
        lw, ls = _lower_bound_rank(k, lay, docs, ratio, shapes, spec.overlap)
        remote_rows = seq - lay.rank_rows(k).size
        for key, value in (
            ("ours", win + xb + slots),
            ("ours_window", win),
            ("ours_x", xb),
            ("ours_slots", slots),
            ("lower", (lw * d + ls * width) * b),
            ("allgather", win + (remote_rows // max(ratio, 1)) * width * b),
        ):
            out[key].append(int(value))
    return {k: np.asarray(v, dtype=np.int64) for k, v in out.items()}


def dsa_comm_per_rank(
    seq: int, cp: int, layout: str = "contiguous", kind: str = "dsa"
) -> dict[str, np.ndarray]:
    """:func:`family_comm_per_rank` of a DSA layer: ``kind`` ``"dsa"`` (a full layer) or
    ``"dsa_shared"`` (a GLM-5 layer reusing the selection)."""
    spec, shapes = FAMILY_KINDS[kind]
    return family_comm_per_rank(seq, cp, spec, layout, shapes)


def dsa_traffic_measures(seq: int, cp: int) -> dict[str, Any]:
    """The family's traffic keys of ``hp-cp bench`` (Note [Traffic of the DSA family]), for
    every kind of :data:`FAMILY_KINDS` and both layouts:
    ``comm_max_rank_over_own_lower_bound_<layout>_<kind>``, ``comm_bytes_unneeded_*``,
    ``comm_ours_bytes_per_rank_*``; for the DSA kinds the all-gather's
    ``dsa_allgather_{max_rank,total}_bytes_over_ours_*``."""
    res: dict[str, Any] = {}
    for kind, (spec, shapes) in FAMILY_KINDS.items():
        for layout, name in LAYOUT_KEYS.items():
            c = family_comm_per_rank(seq, cp, spec, layout, shapes)
            ours, low, gather = c["ours"], c["lower"], c["allgather"]
            res[f"comm_max_rank_over_own_lower_bound_{name}_{kind}"] = _max_own_ratio(ours, low)
            res[f"comm_bytes_unneeded_{name}_{kind}"] = int(ours[low == 0].sum())
            res[f"comm_ours_bytes_per_rank_{name}_{kind}"] = ours.tolist()
            if kind.startswith("dsa"):
                res[f"dsa_allgather_max_rank_bytes_over_ours_{name}_{kind}"] = float(
                    gather.max() / max(int(ours.max()), 1)
                )
                res[f"dsa_allgather_total_bytes_over_ours_{name}_{kind}"] = float(
                    gather.sum() / max(int(ours.sum()), 1)
                )
                res[f"dsa_allgather_bytes_per_rank_{name}_{kind}"] = gather.tolist()
    return res


def main(argv: list[str] | None = None) -> int:
    """``python -m hp_cp_torch.bench.traffic``: only the traffic keys of ``hp-cp bench`` (exact,
    from the plans; a minute at the defaults), printed; ``--merge bench.json`` also writes
    them into that file (the other keys kept); ``--family``: the family's kinds only."""
    import argparse

    from hp_cp_torch.bench.numbers import merge_numbers

    parser = argparse.ArgumentParser(prog="python -m hp_cp_torch.bench.traffic")
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--family", action="store_true", help="only the family's layer kinds")
    parser.add_argument("--merge", default=None, help="a bench.json to update with the numbers")
    args = parser.parse_args(argv)
    res = {} if args.family else traffic_measures(args.seq, args.cp)
    res.update(dsa_traffic_measures(args.seq, args.cp))
    for key, value in sorted(res.items()):
        if not isinstance(value, list):
            print(f"{key:<64} {value}")
    if args.merge:
        merge_numbers(args.merge, res)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())

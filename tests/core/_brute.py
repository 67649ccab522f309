"""Brute-force, per-token definitions of what CP must compute (Python loops, no core code).

Every function here is written from the prose definitions in docs/design.md and
docs/semantics.md, token by token, so the planner tests compare the core's
vectorised plan against an independent statement of the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """One compressed slot (units: global rows)."""

    block_start: int
    last_row: int
    rope_pos: int
    deps: tuple[int, ...]  # every x row the compressor reads for this slot
    has_pred: bool
    doc: int  # -1: a global-grid block straddling two documents (never visible)


class World:
    """The per-token facts of one (S, cp, layout, r, W, cu_seqlens, grid) case."""

    def __init__(
        self,
        *,
        total_rows: int,
        cp: int,
        layout: str,
        r: int,
        window: int,
        cu_seqlens: list[int] | None,
        grid: str,
    ) -> None:
        self.S, self.cp, self.layout, self.r, self.W = total_rows, cp, layout, r, window
        self.packed = cu_seqlens is not None
        self.grid = grid if self.packed else "per_document"
        self.overlap = r == 4
        cu = [0, total_rows] if cu_seqlens is None else [int(c) for c in cu_seqlens]
        self.docs = [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]

        # rows -> ranks: rank k holds chunk k (contiguous) or chunks k and 2cp-1-k
        n_chunks = cp * (2 if layout == "load_balanced" else 1)
        chunk = total_rows // n_chunks
        self.rank_rows: list[list[int]] = []
        self.rank_chunks: list[list[tuple[int, int]]] = []  # (first row, rows) per chunk
        for k in range(cp):
            chunks = [k, 2 * cp - 1 - k] if layout == "load_balanced" else [k]
            self.rank_chunks.append([(c * chunk, chunk) for c in chunks])
            rows = []
            for c in chunks:
                for t in range(c * chunk, (c + 1) * chunk):
                    rows.append(t)
            self.rank_rows.append(rows)
        self.owner_of_row = [0] * total_rows
        for k, rows in enumerate(self.rank_rows):
            for t in rows:
                self.owner_of_row[t] = k

        # rows -> documents
        self.doc_of = [0] * total_rows
        for i, (a, b) in enumerate(self.docs):
            for t in range(a, b):
                self.doc_of[t] = i

        # slots in global order
        self.slots: list[Slot] = []
        if r > 0 and self.grid == "global":
            for g in range(total_rows // r):
                a = g * r
                pred = self.overlap and g > 0
                first_dep = a - r if pred else a
                same_doc = self.doc_of[a] == self.doc_of[a + r - 1]
                self.slots.append(
                    Slot(
                        block_start=a,
                        last_row=a + r - 1,
                        rope_pos=g * r,
                        deps=tuple(range(first_dep, a + r)),
                        has_pred=pred,
                        doc=self.doc_of[a] if same_doc else -1,
                    )
                )
        elif r > 0:
            for i, (a, b) in enumerate(self.docs):
                for j in range((b - a) // r):
                    start = a + j * r
                    pred = self.overlap and j > 0
                    first_dep = start - r if pred else start
                    self.slots.append(
                        Slot(
                            block_start=start,
                            last_row=start + r - 1,
                            rope_pos=j * r,
                            deps=tuple(range(first_dep, start + r)),
                            has_pred=pred,
                            doc=i,
                        )
                    )
        self.slots_of_doc: dict[int, list[int]] = {}
        for s, slot in enumerate(self.slots):
            self.slots_of_doc.setdefault(slot.doc, []).append(s)

    # -- per token ---------------------------------------------------------------------------
    def doc_start(self, t: int) -> int:
        return self.docs[self.doc_of[t]][0]

    def window_keys(self, t: int) -> list[int]:
        """Original KV rows query t reads: ``max(doc_start, t-W+1) .. t``."""
        return list(range(max(self.doc_start(t), t - self.W + 1), t + 1))

    def visible_slots(self, t: int) -> list[int]:
        """Slots of t's own document whose last row is <= t, in global order."""
        out = []
        for s in self.slots_of_doc.get(self.doc_of[t], []):
            if self.slots[s].last_row <= t:
                out.append(s)
        return out

    def position(self, t: int) -> int:
        """RoPE position of row t: document-relative on the per-document packed grid."""
        if self.packed and self.grid == "per_document":
            return t - self.doc_start(t)
        return t

    # -- per slot / per rank -------------------------------------------------------------------
    def owner(self, s: int) -> int:
        """The rank holding the slot's last row."""
        return self.owner_of_row[self.slots[s].last_row]

    def owned(self, rank: int) -> list[int]:
        return [s for s in range(len(self.slots)) if self.owner(s) == rank]

    def window_halo(self, rank: int) -> list[int]:
        """KV rows read by this rank's query windows that another rank holds."""
        local = set(self.rank_rows[rank])
        need = set()
        for t in self.rank_rows[rank]:
            for k in self.window_keys(t):
                if k not in local:
                    need.add(k)
        return sorted(need)

    def x_halo(self, rank: int) -> list[int]:
        """x rows read by this rank's owned slots that another rank holds."""
        local = set(self.rank_rows[rank])
        need = set()
        for s in self.owned(rank):
            for row in self.slots[s].deps:
                if row not in local:
                    need.add(row)
        return sorted(need)

    def cmp_cu_seqlens(self) -> list[int]:
        """``cumsum(n_b // r)`` over documents (per-document grid)."""
        out = [0]
        for a, b in self.docs:
            out.append(out[-1] + (b - a) // self.r)
        return out

    def seen_slots(self, rank: int) -> list[int]:
        """Slots at least one local query sees."""
        return sorted({s for t in self.rank_rows[rank] for s in self.visible_slots(t)})

    def slot_halo(self, rank: int) -> list[int]:
        """Slots a local query sees that another rank computes (what the rank must receive)."""
        return [s for s in self.seen_slots(rank) if self.owner(s) != rank]

    def needed_slots(self, rank: int) -> int:
        """One past the highest slot any local query sees (0 when none)."""
        top = 0
        for t in self.rank_rows[rank]:
            vis = self.visible_slots(t)
            if vis:
                top = max(top, vis[-1] + 1)
        return top

"""How the CSA indexer's KL loss is normalised under CP: one global token-weighted mean.

Note [Indexer loss under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The loss is a mean over query rows of a per-row KL (docs/semantics.md, section 7).
Each row's KL is local once the window halo and the gathered compressed KV are present (the
teacher's window + sink mass reads only the row's window). So every rank sums its own rows
and divides by the number of rows that count on *all* ranks::

    rows      r0: t0 t1 t2 t3 | r1: t4 t5 t6 t7 | r2: t8 t9 .. ..      (.. = padding, mask 0)
    KL sums        s0         |      s1         |      s2
    divisor   N = 4 + 4 + 2 = 10 rows that count   (known to every rank, same value)
    rank k attaches s_k / N;  the loss is  s0/N + s1/N + s2/N   (not (s0/4 + s1/4 + s2/2)/3)

Gradients summed over ranks are then exactly the single-device ones: rank k's share carries
its own rows, and the gathered indexer keys return their gradient to the owning rank through
the all-gather's backward. Padding rows (``loss_mask`` 0) are in neither the sum nor ``N``.

``N`` comes from the plan (``batch * total rows``) or, with a loss mask, from the forward's
one metadata all-gather (:class:`~hp_cp_core.forward.CPForward`). The value that is
logged is the sum of the ranks' shares: :func:`global_indexer_loss` (one tiny all-gather of
float64s, a host sync), or a backend's own all-reduce (the torch backend's, no host sync).
"""

from __future__ import annotations

import numpy as np

from hp_cp_core.config import CPContext


def indexer_loss_weight(call: CPContext) -> float:
    """What this rank multiplies its per-row KL *sum* by: ``1 / N`` (rows counting, all ranks).

    ``N = 0`` (every row masked) gives weight 0: the loss is 0, its backward still runs.
    """
    return 1.0 / call.loss_rows if call.loss_rows > 0 else 0.0


def global_indexer_loss(call: CPContext, local_share: float) -> float:
    """The global loss from this rank's share ``sum_k KL * weight``: the same on every rank.

    Every rank must call it (one small all-gather), whatever its rows.
    """
    if call.group is None or call.cp_size == 1:
        return float(local_share)
    bits = np.array([local_share], dtype=np.float64).view(np.int64)
    shares = np.ascontiguousarray(call.group.all_gather_meta(bits)).view(np.float64)
    return float(shares.reshape(-1).sum())  # rank order: the same rounding on every rank


__all__ = ["global_indexer_loss", "indexer_loss_weight"]

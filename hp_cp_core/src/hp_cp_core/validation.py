"""Input checks of one CP forward, and the one small collective that makes every rank agree.

Note [Validate, agree, then communicate]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A CP forward fails in two bad ways: a rank raises alone while its peers wait forever in the
next exchange, or ranks given different inputs exchange rows that do not fit (a silent wrong
answer). Neither can happen if every forward runs, on every rank, before any data moves::

    local checks (no communication)       one all_gather_meta of a few int64
    ---------------------------------     ---------------------------------------------
    tensors: dims, batch, heads, dtype,   [problem kind, digest(local rows), digest(cu),
      device, DTensor (the backend)        digest(tensor shapes and dtypes),
    cu_seqlens: 0 .. S, non-decreasing     digest(layer spec), digest(config)]
    S shardable by the layout              -> every rank sees every rank's verdict
    the plan (cached)

If any rank found a problem, or the ranks' digests differ, every rank learns it from the same
gathered array, joins one more tiny all-gather of the messages (error path only) and raises the
same :class:`~hp_cp_core.HpCpError`, saying which rank failed and why. Otherwise the exchanges
start. Whether a rank runs the agreement must never depend on a local fact (a cached plan, its
own inputs): a rank that skipped the collective would leave a peer that runs it waiting (the
hang this prevents). So the decision depends only on program order and on what the ranks
already agreed (:class:`AgreementMemo`, one per ``enable_cp`` handle):

* the first CP layer of each model forward (a layer whose index among the handle's layers is
  not above the previous call's: a new forward, or a recompute) always agrees; the gathered
  array, the same on every rank, is the forward's *fingerprint*;
* a later layer agrees unless it already agreed under this same fingerprint (in an earlier
  forward: the steady state of training); every rank reaches the same answer, since the
  fingerprint and the layer's agreement history are common knowledge.

A layer that skips compares its local vector with the one it agreed under this fingerprint.
Identical (the same model on the same inputs, every step after the first): it reuses the
agreed sums, with no collective and no host read. Different (this rank's layer changed while
its inputs did not, e.g. a layer cast or replaced on one rank): it cannot tell its peers
without a collective they do not run, so it raises :class:`~hp_cp_core.HpCpError` alone and
its peers fail in the layer's first exchange within the group's timeout (the desync report
names this rank's layer); still no silent wrong answer and no unbounded wait. Bad *inputs* on
one rank (rows, cu_seqlens, batch, dtype, masks) enter at the first layer and so still make
every rank raise the same error before any data moves. Steady-state cost: one all-gather of
seven integers per model forward per handle, and its one host read.

Checks of tensor *values* (the HF integration's: does the attention mask hide a token, are
``position_ids`` the plan's rows) are computed on the device and not read by the layer
(``LocalCheck.deferred``): their flags ride in the same all-gather, appended to the vector,
so the agreement's one read learns every rank's verdict on them too::

    local vector (int64, host)     device flags (0-dim, not read)
    [kind, rows, cu, ..., count] ++ [mask hides a token, positions differ]
    +------------- one all_gather_meta, one device-to-host read ----------+

A rank whose flag is set fails like a rank whose host check failed: every rank raises the same
error before any data moves.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hp_cp_core.config import CPConfig, LayerSpec
from hp_cp_core.errors import HpCpError, PlanError
from hp_cp_core.layout import SequenceLayout

FIELDS = ("rows", "cu_seqlens", "tensors", "spec", "config", "batch")
"""What every rank must agree on, in the order of the agreement vector (after the kind)."""

LABELS = {
    "rows": "local rows",
    "cu_seqlens": "cu_seqlens",
    "tensors": "tensor shapes (row dim left out) and dtypes",
    "spec": "layer spec",
    "config": "CPConfig",
    "batch": "digest of the batch handle.batch built",
}

FIXES = {
    "rows": "Expected every rank to pass the same number of local rows: shard every input with "
    "handle.shard(tensor, seq_dim).",
    "cu_seqlens": "Expected the same global cu_seqlens (the boundaries of the whole packed "
    "sequence, not of the local rows) on every rank, or None on every rank.",
    "tensors": "Expected every rank to pass inputs with the same batch size, heads, feature "
    "sizes and dtype.",
    "spec": "Expected every rank to run the same layer (compress_ratio, window_size, "
    "indexer): build the model identically on every rank before enable_cp.",
    "config": "Expected enable_cp to get the same CPConfig on every rank: build it the "
    "same way everywhere.",
    "batch": "Expected every rank of a CP group to pass the same FULL batch to handle.batch "
    "(it shards it): load the data by the data-parallel rank, not the global rank, and pass "
    "the whole sequence, not handle.shard(...) of it.",
}

_BATCH = 1 + FIELDS.index("batch")  # its column in the agreement vector


def _without_batch(values: np.ndarray) -> np.ndarray:
    """The agreement vector(s) with the batch digest zeroed: a later layer of the forward
    reuses the agreement whatever batch the forward runs (the first layer checked it)."""
    out = np.array(values, dtype=np.int64, copy=True)
    out[..., _BATCH] = 0
    return out


_KINDS = {1: HpCpError, 2: PlanError}


def short_list(values: np.ndarray, head: int = 8) -> str:
    """``[0, 5, 9]`` or ``[0, 5, ..., 90] (12 entries)`` for long arrays."""
    vals = [int(v) for v in np.asarray(values).reshape(-1)]
    if len(vals) <= head:
        return str(vals)
    return f"[{', '.join(map(str, vals[: head - 1]))}, ..., {vals[-1]}] ({len(vals)} entries)"


@dataclass
class LocalCheck:
    """What one rank found about its inputs before the agreement collective.

    Attributes:
        n_local: this rank's rows (tokens).
        cu_seqlens: the parsed global boundaries (int64), ``None`` when padded or unreadable.
        cu_given: whether the caller passed ``cu_seqlens`` at all.
        signature: the tensors' shapes (without the row dim) and dtypes, as one string.
        plan: this rank's plan, ``None`` when a check failed.
        problems: ``(error class, message)`` of every failed check, in order.
        cause: the exception a check caught (kept as ``__cause__`` on this rank).
        deferred: ``(flag, message)`` of checks the backend computed on the device (a 0-dim
            tensor, true = failed) and did not read: they travel in the agreement collective
            (Note [Validate, agree, then communicate]), so they cost no host read of their
            own. Every rank of a group must defer the same number of checks. ``message`` may
            be a sequence of messages, ``flag`` then an integer code: 0 passed, ``k`` failed
            with ``message[k - 1]`` (several checks in one entry, so a rank whose other
            checks failed can defer the same number: ``(0, ())``).
    """

    n_local: int
    cu_seqlens: np.ndarray | None = None
    cu_given: bool = False
    signature: str = ""
    plan: Any = None
    problems: list[tuple[type[HpCpError], str]] = field(default_factory=list)
    cause: BaseException | None = None
    deferred: list[tuple[Any, Any]] = field(default_factory=list)
    batch: int = 0
    """A digest of the batch ``handle.batch`` built for this forward (0: none)."""

    def fail(self, message: str, kind: type[HpCpError] = HpCpError) -> None:
        """Record a failed check (raised later, on every rank, by :func:`agree`)."""
        self.problems.append((kind, message))

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def kind(self) -> int:
        """0: no problem; 2: only plan problems (:class:`PlanError`); 1: any other."""
        if not self.problems:
            return 0
        return 2 if all(issubclass(k, PlanError) for k, _ in self.problems) else 1

    @property
    def message(self) -> str:
        return " ".join(msg for _, msg in self.problems)

    def cu_digest(self) -> int:
        if not self.cu_given:
            return 0
        if self.cu_seqlens is None:
            return -1
        return zlib.crc32(self.cu_seqlens.tobytes()) + 1

    def cu_text(self) -> str:
        if not self.cu_given:
            return "None"
        return "unreadable" if self.cu_seqlens is None else short_list(self.cu_seqlens)


# ------------------------------------------------------------------------ framework-free checks


def parse_cu_seqlens(cu_seqlens: Any, check: LocalCheck) -> None:
    """Read ``cu_seqlens`` into ``check.cu_seqlens`` (int64, 1-D) or record why it cannot be."""
    if cu_seqlens is None:
        return
    check.cu_given = True
    try:
        arr = np.asarray(cu_seqlens)
    except Exception as exc:  # noqa: BLE001 - any unreadable object is the user's input error
        check.fail(
            f"cu_seqlens must be a 1-D sequence of integers (the global document boundaries "
            f"[0, ..., S]); got a {type(cu_seqlens).__name__} numpy cannot read ({exc}). Pass a "
            "list, numpy array or integer tensor.",
            PlanError,
        )
        return
    if arr.ndim != 1 or arr.dtype.kind not in "iuf":
        check.fail(
            f"cu_seqlens must be a 1-D sequence of integers (the global document boundaries "
            f"[0, ..., S]); got shape {list(arr.shape)} of dtype {arr.dtype}. Pass e.g. "
            "torch.tensor([0, 5, 16]) or a list of ints.",
            PlanError,
        )
        return
    if arr.dtype.kind == "f" and not np.all(np.isfinite(arr) & (arr == np.round(arr))):
        check.fail(
            f"cu_seqlens must hold integers; got non-integer values {arr[:8].tolist()}. Pass "
            "integer boundaries (torch.int32 / int64).",
            PlanError,
        )
        return
    cu = arr.astype(np.int64)
    if cu.size < 2:
        check.fail(
            f"cu_seqlens must have at least 2 entries [0, ..., S]; got {cu.tolist()}. Pass the "
            "boundaries of the whole packed sequence, e.g. [0, S] for one document.",
            PlanError,
        )
        return
    if cu[0] != 0:
        check.fail(
            f"cu_seqlens must start at 0; got cu_seqlens[0] = {int(cu[0])} in {short_list(cu)}. "
            "Pass the boundaries of the whole packed sequence: [0, len(doc0), len(doc0) + "
            "len(doc1), ..., S].",
            PlanError,
        )
        return
    steps = np.diff(cu)
    if np.any(steps < 0):
        i = int(np.flatnonzero(steps < 0)[0]) + 1
        check.fail(
            f"cu_seqlens must be non-decreasing; got cu_seqlens[{i}] = {int(cu[i])} < "
            f"cu_seqlens[{i - 1}] = {int(cu[i - 1])} in {short_list(cu)}. Pass cumulative "
            "document lengths (torch.cumsum of the lengths, with a leading 0).",
            PlanError,
        )
        return
    check.cu_seqlens = cu


def check_rows(check: LocalCheck, cp_size: int, layout: str) -> bool:
    """Local rows and the layout's shardability; ``cu_seqlens`` ends at the row count."""
    n = check.n_local
    if n < 1:
        check.fail(
            f"this rank got {n} local rows; every rank needs at least one row. Shard a sequence "
            f"of at least {cp_size} rows with handle.shard(tensor, seq_dim).",
            PlanError,
        )
        return False
    total = n * cp_size
    try:
        SequenceLayout(layout, cp_size, total)
    except PlanError as exc:
        check.fail(
            f"{exc} (This rank holds {n} local rows: {total} in all if each of the {cp_size} "
            "ranks holds as many.)",
            PlanError,
        )
        return False
    cu = check.cu_seqlens
    if cu is not None and int(cu[-1]) != total:
        check.fail(
            f"cu_seqlens ends at {int(cu[-1])} but the ranks hold {n} x {cp_size} = {total} "
            "rows. Pass the global cu_seqlens (the same on every rank) and each rank's local "
            "rows from handle.shard(x, 0).",
            PlanError,
        )
        return False
    return True


def check_layer_spec(spec: Any, layer: Any) -> LayerSpec:
    """The ``hp_cp_layer_spec`` answer for ``layer``, or :class:`HpCpError` saying what is wrong.

    ``LayerSpec`` itself rejects bad values; this also rejects answers of the wrong type
    (``4.0``, ``"4"``, ``True`` for an integer field), which would be planned silently wrong.
    """
    where = f"hp_cp_layer_spec for `{type(layer).__name__}`"
    if not isinstance(spec, LayerSpec):
        raise HpCpError(
            f"hp_cp_layer_spec returned a {type(spec).__name__} for `{type(layer).__name__}`;"
            f" expected a hp_cp_core.LayerSpec, got {spec!r}. Return LayerSpec(compress_ratio="
            "..., window_size=..., has_indexer=...) from the backend's hook."
        )
    for name in ("compress_ratio", "window_size", "index_block", "share_from"):
        value = getattr(spec, name)
        if name == "share_from" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise HpCpError(
                f"{where} returned LayerSpec.{name}={value!r} ({type(value).__name__}); "
                f"expected an int. Convert it with int(...) in the hook."
            )
    for name in ("has_indexer", "force_unfused"):
        value = getattr(spec, name)
        if not isinstance(value, (bool, np.bool_)):
            raise HpCpError(
                f"{where} returned LayerSpec.{name}={value!r} ({type(value).__name__}); "
                f"expected a bool. Convert it with bool(...) in the hook."
            )
    if spec.overlapping is not None and not isinstance(spec.overlapping, (bool, np.bool_)):
        raise HpCpError(
            f"{where} returned LayerSpec.overlapping={spec.overlapping!r} "
            f"({type(spec.overlapping).__name__}); expected None or a bool."
        )
    return spec


def check_group(group: Any, mesh: Any, backend: str) -> None:
    """The backend's group for ``mesh`` must contain this rank: ``0 <= rank < size``."""
    size, rank = getattr(group, "size", None), getattr(group, "rank", None)
    ok = isinstance(size, (int, np.integer)) and isinstance(rank, (int, np.integer))
    if not ok or size < 1 or not 0 <= rank < size:
        raise HpCpError(
            f"backend {backend!r} made a CP group of size {size!r} in which this process has "
            f"rank {rank!r} from enable_cp(mesh={mesh!r}); expected a rank in 0 .. size-1. "
            "Pass a mesh or group this process belongs to (each rank passes its own CP group)."
        )


# ------------------------------------------------------------------------ the agreement


def agreed_config_text(config: CPConfig) -> str:
    """The options every rank must share (local-only ones, such as the plan cache size, are
    left out)."""
    regather = ", regather_compressed_kv=True" if config.regather_compressed_kv else ""
    precision = getattr(config, "attention_precision", "fp32")
    if precision != "fp32":
        regather += f", attention_precision={precision!r}"
    return (
        f"CPConfig(layout={config.layout!r}, attention_kernel="
        f"{config.attention_kernel!r}, query_chunk={config.query_chunk}{regather})"
    )


def digest(text: str) -> int:
    return zlib.crc32(text.encode())


def agreement_vector(
    check: LocalCheck, spec_digest: int, config_digest: int, count: int | None = None
) -> np.ndarray:
    """``[kind, local rows, cu, tensors, spec, config, batch digests, count]`` (int64; count
    -1: none)."""
    return np.array(
        [
            check.kind,
            check.n_local,
            check.cu_digest(),
            digest(check.signature),
            spec_digest,
            config_digest,
            check.batch,
            -1 if count is None else int(count),
        ],
        dtype=np.int64,
    )


def _encode(text: str, width: int) -> np.ndarray:
    raw = text.encode()
    buf = raw + b"\0" * (width * 8 - len(raw))
    return np.frombuffer(buf, dtype=np.int64).copy()


def _decode(row: np.ndarray) -> str:
    return np.ascontiguousarray(row, dtype=np.int64).tobytes().rstrip(b"\0").decode()


class AgreementMemo:
    """What the ranks of one ``enable_cp`` handle agreed, so later layers of a forward reuse
    it (Note [Validate, agree, then communicate]); every field is the same on every rank.

    Attributes:
        last_index: the handle's layer index of the previous agreement call.
        fingerprint: the gathered agreement array of this forward's first layer (bytes).
        agreed: layer index -> (fingerprint, local vector, agreed count sum) of its last
            agreement.
        collectives: agreements run (``all_gather_meta`` calls on the success path).
        reused: agreements skipped.
    """

    def __init__(self) -> None:
        self.last_index: int | None = None
        self.fingerprint: bytes | None = None
        self.agreed: dict[int, tuple[bytes | None, bytes, int | None]] = {}
        self.collectives = 0
        self.reused = 0
        self.checked: Any = None
        """A backend's key for the per-forward inputs the forward's first layer checked on
        the device (the torch HF integration: the mask and position_ids objects), so later
        layers that reuse the agreement skip that check's host read."""
        self.checked_index = -1
        """The layer index that last set :attr:`checked`."""

    def reuses(self, index: int) -> bool:
        """Whether layer ``index``'s next :func:`agree` reuses an agreement (the same answer
        on every rank: it depends only on program order and agreed facts)."""
        past = self.agreed.get(index)
        return (
            self.last_index is not None
            and index > self.last_index
            and past is not None
            and past[0] == self.fingerprint
        )


def agree(
    group: Any,
    check: LocalCheck,
    spec: LayerSpec,
    config: CPConfig,
    *,
    spec_text: str | None = None,
    config_text: str | None = None,
    count: int | None = None,
    memo: AgreementMemo | None = None,
    index: int = 0,
) -> int | None:
    """Raise the same :class:`HpCpError` on every rank unless every rank's checks passed and
    the ranks agree on the global metadata (see Note [Validate, agree, then communicate]).

    One ``all_gather_meta`` when all is well; two more (lengths, then messages) when not.
    With ``config.check_inputs_across_ranks=False`` or a group of one, only this rank's own
    problems are raised (a peer's failure then surfaces as a failed collective).

    Args:
        group: the CP group.
        check: this rank's :class:`LocalCheck`.
        spec, config: the layer's spec and the options (their digests are agreed on).
        spec_text, config_text: cached ``repr`` of ``spec`` / ``config``.
        count: a per-rank integer to sum over the ranks in the same collective (the rows
            that count in the indexer loss under a loss mask), or ``None``; an agreement
            with a count always runs (the count may change on some ranks only).
        memo, index: the handle's :class:`AgreementMemo` and this layer's index among the
            handle's layers; with a memo, later layers of a forward reuse the agreement.

    Returns:
        The sum of ``count`` over the ranks that gave one, ``None`` when none did.
    """
    if group.size == 1 or not config.check_inputs_across_ranks:
        if check.problems:
            raise _KINDS[check.kind](check.message) from check.cause
        if group.size == 1 or count is None:
            return count
        counts = group.all_gather_meta(np.array([count], dtype=np.int64))[:, 0]
        return int(counts[counts >= 0].sum())
    spec_text = spec_text if spec_text is not None else repr(spec)
    config_text = config_text if config_text is not None else agreed_config_text(config)
    mine = agreement_vector(check, digest(spec_text), digest(config_text), count)
    if memo is not None:
        new_forward = memo.last_index is None or index <= memo.last_index
        # a per-rank count (a loss mask's rows) may change on some ranks only: always summed
        reuse, past = count is None and memo.reuses(index), memo.agreed.get(index)
        memo.last_index = index
        if reuse and past is not None:
            # every rank skips here (common knowledge); this rank's vector must match
            if past[1] == _without_batch(mine).tobytes():
                memo.reused += 1
                return past[2]
            raise HpCpError(
                f"CP layer {index} on rank {group.rank} of {group.size}: "
                + (
                    check.message
                    if check.problems
                    else "its inputs (rows, cu_seqlens, tensor shapes or dtypes, layer spec, "
                    "config or indexer-loss rows) differ from the ones every rank agreed on in "
                    "an earlier forward of the same model inputs"
                )
                + ". The ranks already agreed on this forward, so only this rank raises; its "
                "peers fail in the layer's first exchange (see Note [Validate, agree, then "
                "communicate]). Change a layer on every rank, not on one."
            ) from check.cause
    if check.deferred:  # device-side checks: read in the same collective, on every rank
        every = group.all_gather_meta(mine, device_flags=[f for f, _ in check.deferred])
        codes = every[:, len(mine) :]
        flags = codes != 0
        every = np.ascontiguousarray(every[:, : len(mine)])
        for (_, message), code in zip(check.deferred, codes[group.rank]):
            if code:  # a message, or one of several: the code (1-based) says which
                check.fail(message if isinstance(message, str) else message[int(code) - 1])
        every[flags.any(axis=1) & (every[:, 0] == 0), 0] = 1
    else:
        every = group.all_gather_meta(mine)
    failed = np.flatnonzero(every[:, 0]).tolist()
    agreed = every[:, 1 : 1 + len(FIELDS)]
    differ = [f for i, f in enumerate(FIELDS) if np.any(agreed[:, i] != agreed[0, i])]
    if not failed and not differ:
        counts = every[:, -1]
        total = int(counts[counts >= 0].sum()) if np.any(counts >= 0) else None
        if memo is not None:
            memo.collectives += 1
            if new_forward:
                memo.fingerprint = _without_batch(every).tobytes()
            memo.agreed[index] = (memo.fingerprint, _without_batch(mine).tobytes(), total)
        return total
    if memo is not None:
        memo.agreed.pop(index, None)
    text = json.dumps(
        {
            "problem": check.message,
            "facts": {
                "rows": str(check.n_local),
                "cu_seqlens": check.cu_text(),
                "tensors": check.signature or "?",
                "spec": spec_text,
                "config": config_text,
                "batch": str(check.batch),
            },
        }
    )
    width = math.ceil(len(text.encode()) / 8)
    widths = group.all_gather_meta(np.array([width], dtype=np.int64))[:, 0]
    rows = group.all_gather_meta(_encode(text, int(widths.max())))
    reports = [json.loads(_decode(r)) for r in rows]
    kinds = {int(k) for k in every[failed, 0]}
    cls = PlanError if (not failed or kinds == {2}) else HpCpError
    exc = cls(agreement_message(reports, failed, differ))
    raise exc from (check.cause if check.problems else None)


def agreement_message(reports: Sequence[dict], failed: list[int], differ: list[str]) -> str:
    """The one message every rank raises (a function of the gathered reports only)."""
    cp = len(reports)

    def listing(fields: Sequence[str]) -> str:
        return "; ".join(
            f"{LABELS[f]} per rank [{', '.join(r['facts'][f] for r in reports)}]" for f in fields
        )

    if failed:  # a rank's own check of its rows assumes its peers hold as many
        rows = "rows" in differ and all(int(r["facts"]["rows"]) > 0 for r in reports)
        also = f" The ranks' inputs also differ: {listing(['rows'])}." if rows else ""
        return _failures_message(reports, failed, cp) + also
    fixes = " ".join(FIXES[f] for f in differ)
    return f"CP ranks were given inconsistent inputs: {listing(differ)}. {fixes}"


def _failures_message(reports: Sequence[dict], failed: list[int], cp: int) -> str:
    """What every rank raises for the ranks in ``failed``: their problems, by message."""
    by_msg: dict[str, list[int]] = {}
    for rank in failed:
        by_msg.setdefault(reports[rank]["problem"], []).append(rank)
    if len(failed) == cp and len(by_msg) == 1:
        return next(iter(by_msg))  # the same problem everywhere: the message as it is
    if len(by_msg) == 1:
        ranks = failed
        where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        return (
            f"CP input check failed on {where} of {cp} (every rank raises this error): "
            f"{next(iter(by_msg))}"
        )
    parts = [
        f"[{'rank ' + str(r[0]) if len(r) == 1 else 'ranks ' + str(r)}] {msg}"
        for msg, r in by_msg.items()
    ]
    return (
        f"CP input checks failed on ranks {failed} of {cp} (every rank raises this error): "
        + " ".join(parts)
    )

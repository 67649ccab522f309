"""``CPForward``: one layer forward under CP (the stages of docs/design.md, 4)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hp_cp_core.backend import Backend, Group
from hp_cp_core.collectives import exchange_halos
from hp_cp_core.compression import build_global_compressed_kv_for_cp, regather_compressed_kv
from hp_cp_core.config import CPConfig, CPContext, LayerSpec
from hp_cp_core.errors import HpCpError
from hp_cp_core.padding import ShardedSequence
from hp_cp_core.plan import PlanCache
from hp_cp_core.plugins import Hooks
from hp_cp_core.records import Agreed, ForwardRecord, ForwardRecords
from hp_cp_core.sharing import LayerRoles, SharedState, plan_sharing
from hp_cp_core.spec import PER_QUERY
from hp_cp_core.validation import (
    AgreementMemo,
    LocalCheck,
    agree,
    agreed_config_text,
    check_rows,
    parse_cu_seqlens,
)


def _sequence_key(total_rows: int, cu_seqlens: Any) -> tuple[Any, ...]:
    """What identifies the sequence a shared artifact belongs to: its rows and documents."""
    cu = None if cu_seqlens is None else np.asarray(cu_seqlens, dtype=np.int64).tobytes()
    return (int(total_rows), cu)


def _run_all(works: Sequence[Any]) -> Any:
    """One callable running ``works`` in order, ``None`` when there are none."""
    if not works:
        return None
    return lambda: [w() for w in works]


class CPForward:
    """Runs one attention layer on local rows through the hooks and the group's exchanges.

    Args:
        module: the attention layer (handed to every hook).
        hooks: the typed hook facade of the plugin host.
        backend: the module's backend (tensor ops).
        group: the CP group (collectives).
        spec: the layer's :class:`LayerSpec`.
        config: the ``enable_cp`` options.
        cache: where plans are kept (shared by the layers of one ``enable_cp`` call).
        memo, index: the handle's :class:`AgreementMemo` (shared by its layers) and this
            layer's index among them; ``None``: every forward agrees.
        sequence: the handle's :class:`~hp_cp_core.padding.ShardedSequence` (what
            ``handle.shard`` padded); ``None``: every row is real.
        records: the handle's :class:`~hp_cp_core.records.ForwardRecords` (Note [Records
            per forward]); default: records of ``sequence`` for this layer alone.
        roles: this layer's :class:`~hp_cp_core.sharing.LayerRoles` in the handle's
            :class:`~hp_cp_core.sharing.SharingPlan`; ``None``: the layer alone (it must
            reuse nothing).
        shared: a :class:`~hp_cp_core.sharing.SharedState` every forward publishes in and
            takes from (tests of one forward); default: each forward's own record's.
    """

    def __init__(
        self,
        module: Any,
        hooks: Hooks,
        backend: Backend,
        group: Group,
        spec: LayerSpec,
        config: CPConfig | None = None,
        cache: PlanCache | None = None,
        memo: AgreementMemo | None = None,
        index: int = 0,
        *,
        sequence: ShardedSequence | None = None,
        roles: LayerRoles | None = None,
        shared: SharedState | None = None,
        records: ForwardRecords | None = None,
    ) -> None:
        self.module = module
        self.hooks = hooks
        self.backend = backend
        self.group = group
        self.spec = spec
        self.config = config or CPConfig()
        self.cache = cache if cache is not None else PlanCache()
        self.memo, self.index = memo, index
        self._spec_text, self._config_text = repr(spec), agreed_config_text(self.config)
        self.roles = roles if roles is not None else plan_sharing([spec]).roles(0)
        self._shared = shared
        if records is None and sequence is not None:
            records = ForwardRecords(sequence)
        self.records = records
        self._checks_skipped = False
        self.record: ForwardRecord | None = None
        """The record of the forward this layer's current call belongs to (set by
        :meth:`inspect`, the first step of every call)."""

    @property
    def sequence(self) -> ShardedSequence | None:
        """The padding record of the current call's forward (``None``: every row is real)."""
        if self.records is None:
            return None
        record = self.record
        if record is None or self.records.scoped:  # the backend placed this call
            record = self.records.current
        return record.sequence if record is not None else self.records.builder

    @property
    def shared(self) -> SharedState:
        """Where the current call's forward publishes and takes shared artifacts."""
        record = self.records.current if self.records and self.records.scoped else self.record
        if record is not None:
            return record.shared
        if self._shared is None and self.records is None:
            self._shared = SharedState()  # a layer without records: its own, every forward
        return self._shared if self._shared is not None else SharedState()

    def _begin_call(self) -> str | None:
        """Find the record of the forward this call belongs to (Note [Records per
        forward]); the problem to raise on every rank when a recomputed call has none."""
        if self.records is None:
            return None
        self.record = self.records.for_layer(self.index)
        if self.record is None:
            return self.records.unknown(self.index)
        return None

    def __call__(
        self,
        query: Any,
        key: Any,
        x: Any,
        qr: Any = None,
        *,
        cu_seqlens: Any = None,
        call: CPContext | None = None,
        local_work: Sequence[Any] = (),
        stages: Any = None,
        **extra: Any,
    ) -> Any:
        """One layer forward on this rank's rows (sequence-major, rows first).

        Args:
            query, key, x, qr: the layer's local tensors (see the stage hooks; ``qr`` only
                for a backend whose ``hp_cp_run_attention`` reads it).
            cu_seqlens: global packed document boundaries, ``None`` when padded.
            call: the context :meth:`agree` returned, when the install wrapper already
                checked its inputs (then ``cu_seqlens`` is taken from it); else this call
                checks the inputs and agrees across ranks itself.
            local_work: zero-argument callables of the caller's local work that needs no
                received row, run in order while the exchanges travel (Note [Overlapped
                exchanges] in :mod:`hp_cp_core.collectives`): the first during the halo
                exchange, the others during the slot exchange (all during the halo exchange
                of a layer without compressed slots). Whatever they compute reaches the hooks
                through the caller's own tensors (``query`` / ``qr`` may then be ``None``
                here and filled through ``call.extra``).
            stages: the caller's stage object for this forward (its runner: methods named
                as the stage hooks without ``hp_cp_`` and ``module``), called directly
                unless a plugin overrides the stage (Note [A direct runtime path] in
                :mod:`hp_cp_core.plugins`); ``None``: every stage through the hooks.
            extra: backend-private values for the hooks (``call.extra``).
        """
        if call is None:
            shapes = [self.backend.shape(t)[1:] for t in (query, key, x, qr) if t is not None]
            n_local = self.backend.num_rows(x)
            check = self.inspect(
                n_local, cu_seqlens, signature=" ".join(str(list(s)) for s in shapes)
            )
            counted = ("loss_rows" in extra) or ("loss_rows_total" in extra)
            if self.spec.has_indexer and not counted:
                # every real row counts in the indexer loss: N = batch x real rows
                batch = int(np.prod(self.backend.shape(x)[1:-1], dtype=np.int64))
                extra = {**extra, "loss_rows_total": self.loss_rows_total(n_local, batch)}
            call = self.agree(check, extra)
        elif extra:
            call = call.replace(extra={**call.extra, **extra})
        token = self.group.begin_order(x)  # Note [Backward order] in hp_cp_core.collectives
        ori_kv = self.hooks.extract_ori_kv(self.module, key, stages)
        works = list(local_work)
        compressed = self.spec.makes_slots
        first = works[:1] if compressed else works
        rest = works[1:] if compressed else []
        overlap = self.config.overlap_exchanges
        if self.spec.needs_halo:
            ori_ext, halo_x, token = exchange_halos(
                self.group, self.backend, ori_kv, x, call.plan, token, _run_all(first), overlap
            )
        else:  # no rank reads a row of another outside the slots: no halo exchange at all
            for work in first:
                work()
            ori_ext, halo_x = ori_kv, None
        owned, gathered, made, token = self._slots(x, halo_x, call, token, _run_all(rest), stages)
        slots, keys = self._slot_buffers(call, made)
        call = call.replace(slots=slots, keys=keys)
        for artifact in PER_QUERY:
            if self.roles.reuses(artifact):
                call.reused[artifact] = self._take(call, artifact)
        scope = self.regather_scope(owned, gathered, call)
        attend = self.hooks.run_attention
        if scope is None:
            out = attend(self.module, query, ori_ext, x, qr, call, stages)
        else:
            with scope:  # Note [Re-gathered slots] in hp_cp_core.compression
                out = attend(self.module, query, ori_ext, x, qr, call, stages)
        public = {}
        for artifact in PER_QUERY:
            if not self.roles.publishes(artifact):
                continue
            if artifact not in call.outputs:
                raise HpCpError(
                    f"layer {self.index} publishes its {artifact!r} to layers "
                    f"{dict(self.roles.readers)[artifact]} (LayerSpec.reuses), but the "
                    f"backend's hp_cp_run_attention did not put it in call.outputs[{artifact!r}]."
                )
            public[artifact] = call.outputs[artifact]
        if public:
            self.shared.publish(self.index, self._sequence_key(call), public)
        self.record = None  # the forward's graph keeps its record, not the layer
        if scope is None:
            return self.group.end_order(out, token)
        return scope.end_order(out, token)

    def _sequence_key(self, call: CPContext) -> tuple[Any, ...]:
        """What identifies the sequence an artifact belongs to: its rows and documents."""
        return _sequence_key(call.plan.n_local * call.cp_size, call.cu_seqlens)

    def _take(self, call: CPContext, artifact: str) -> Any:
        owner = self.roles.owner(artifact)
        return self.shared.take(self.index, owner, self._sequence_key(call), artifact)

    def unpublished(self, n_local: int, cu_seqlens: Any) -> list[str]:
        """What this layer reuses that its owner has not published for the sequence of
        ``n_local`` rows per rank and ``cu_seqlens`` (Note [Layers that share their indexer]
        in :mod:`hp_cp_core.sharing`): one message per missing artifact."""
        key = _sequence_key(int(n_local) * self.group.size, cu_seqlens)
        out = []
        for artifact, owner in self.roles.owners:
            if owner != self.index and not self.shared.has(owner, key, artifact):
                out.append(
                    f"layer {self.index} reuses {artifact!r} of layer {owner} (LayerSpec.reuses="
                    f"{self.spec.reuses!r}), but layer {owner} has not run on this sequence "
                    "before it. Run the layers in the model's order in one forward (call the "
                    "whole model); a layer that reuses another's state cannot run on its own "
                    "under CP."
                )
        return out

    def _slots(
        self, x: Any, halo_x: Any, call: CPContext, token: Any, work: Any, stages: Any
    ) -> tuple[list[Any], list[Any], dict[str, Any], Any]:
        """``(owned, gathered, made, token)``: this rank's slots of what the layer makes (main,
        then indexer keys), every rank's in global slot order, the same by artifact name
        (published for the layers that reuse them), and the next order token."""
        if self.spec.compress_ratio == 0:
            if work is not None:
                work()
            return [], [], {}, token
        kinds = []
        owned = []
        if self.spec.makes_compressed_kv:
            kinds.append("compressed_kv")
            owned.append(self.hooks.compress_main(self.module, x, halo_x, call, stages))
        if self.spec.makes_index_keys:
            kinds.append("index_keys")
            owned.append(self.hooks.compress_indexer(self.module, x, halo_x, call, stages))
        if not owned:
            if work is not None:
                work()
            return [], [], {}, token
        gathered, token = build_global_compressed_kv_for_cp(
            self.group, self.backend, owned, call.plan, token, work, self.config.overlap_exchanges
        )
        made = dict(zip(kinds, gathered))
        public = {k: v for k, v in made.items() if self.roles.publishes(k)}
        if public:
            self.shared.publish(self.index, self._sequence_key(call), public)
        return owned, list(gathered), made, token

    def _slot_buffers(self, call: CPContext, made: dict[str, Any]) -> tuple[Any, Any]:
        """``(main compressed KV, indexer keys)``: what the layer gathered, else what it reuses
        from the layer that made it, else ``None``."""
        out = []
        for artifact in ("compressed_kv", "index_keys"):
            if artifact in made:
                out.append(made[artifact])
            elif self.spec.compress_ratio and self.roles.reuses(artifact):
                out.append(self._take(call, artifact))
            else:
                out.append(None)
        return out[0], out[1]

    def regather_scope(self, owned: Sequence[Any], gathered: Sequence[Any], call: CPContext) -> Any:
        """The group's scope that keeps ``gathered`` out of what autograd saves and receives
        it again in backward (``CPConfig.regather_compressed_kv``), or ``None``
        (option off, r = 0, or a group without ``regather_scope``)."""
        make = getattr(self.group, "regather_scope", None)
        if not (self.config.regather_compressed_kv and gathered and make is not None):
            return None
        group, ops, plan = self.group, self.backend, call.plan
        return make(
            list(gathered), list(owned), lambda own: regather_compressed_kv(group, ops, own, plan)
        )

    def real_rows(self, n_local: int) -> np.ndarray | None:
        """``[n_local]`` bool: which of this rank's rows are real, when this forward's
        sequence is the one ``handle.shard(..., pad_value=...)`` padded last; ``None`` when
        every row is (Note [Padding to the layout] in :mod:`hp_cp_core.padding`). The
        indexer loss counts only real rows."""
        if self.sequence is None:
            return None
        size = self.group.size
        return self.sequence.real_rows(self.config.layout, size, self.group.rank, n_local * size)

    def loss_rows_total(self, n_local: int, batch: int) -> int:
        """Rows of all ranks that count in the indexer loss when every real row counts:
        ``batch`` x the sequence's real rows (the padding ``handle.shard(..., pad_value=)``
        appended left out). Known on every rank without a collective, so a later layer that
        reuses the forward's agreement still gets this forward's count."""
        rows = self.sequence_rows(n_local)
        return int(batch) * (int(n_local) * self.group.size if rows is None else rows)

    def sequence_rows(self, n_local: int) -> int | None:
        """Global rows before the padding ``handle.shard(..., pad_value=...)`` appended, when
        this forward (``n_local`` rows per rank) runs on that padded sequence; else ``None``."""
        pad = None if self.sequence is None else self.sequence.padding
        if pad is None or pad.pad_rows == 0 or pad.padded_rows != int(n_local) * self.group.size:
            return None
        return int(pad.rows)

    def _plan(self, n_local: int, cu: np.ndarray | None) -> Any:
        return self.cache.get(
            rank=self.group.rank,
            cp_size=self.group.size,
            spec=self.spec,
            layout_kind=self.config.layout,
            total_rows=n_local * self.group.size,
            cu_seqlens=cu,
        )

    def inspect(
        self,
        n_local: int,
        cu_seqlens: Any = None,
        *,
        problems: Sequence[str] = (),
        signature: str = "",
    ) -> LocalCheck:
        """This rank's checks of one forward's inputs, and its plan; no communication.

        Never raises for bad input: every failed check is recorded, so that :meth:`agree`
        can make every rank raise it. See Note [Validate, agree, then communicate] in
        :mod:`hp_cp_core.validation`.

        Args:
            n_local: this rank's rows (tokens).
            cu_seqlens: global packed document boundaries, ``None`` when padded.
            problems: what the backend's own checks (tensor dims, dtype, device...) found.
            signature: the tensors' shapes without the row dim, and dtypes (agreed on).
        """
        check = LocalCheck(n_local=int(n_local), signature=signature)
        missing = self._begin_call()
        if missing is not None:
            check.fail(missing)
        elif self.record is not None and self.record.cut:
            pad = self.record.sequence.padding
            cut = pad.padded_rows if pad is not None else self.record.sequence.cut_rows
            seen = check.n_local * self.group.size
            if cut is not None and cut != seen:
                check.fail(
                    f"CP layer {self.index} sees {check.n_local} rows per rank ({seen} over "
                    f"{self.group.size} ranks), but this forward was given tensors that "
                    f"handle.shard / handle.batch cut from a sequence of {cut} "
                    "rows: a tensor sharded along another dimension than its sequence (pass "
                    "handle.shard(x, seq_dim) the sequence's dimension: 0 for a "
                    "sequence-major [S, B, hidden] tensor), or a layer that reads its rows "
                    "along another dimension (a model adapter's sequence_dim)."
                )
        if self.sequence is not None:
            check.batch = self.sequence.batch_for(check.n_local * self.group.size)
        for message in problems:
            check.fail(message)
        parse_cu_seqlens(cu_seqlens, check)
        if check.ok:
            for message in self.unpublished(check.n_local, check.cu_seqlens):
                check.fail(message)
        if check.ok and check_rows(check, self.group.size, self.config.layout):
            try:
                check.plan = self._plan(check.n_local, check.cu_seqlens)
            except HpCpError as exc:
                check.fail(str(exc), type(exc))
                check.cause = exc
            except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
                check.fail(f"building the CP plan failed: {type(exc).__name__}: {exc}")
                check.cause = exc
        return check

    def reuses_agreement(self, counted: bool = False) -> bool:
        """Whether this layer's next :meth:`agree` reuses the handle's agreement (no
        collective); the same on every rank. ``counted``: it will pass a per-rank
        ``loss_rows`` to sum (then it never reuses). A recomputed call reuses when its
        forward's call did (Note [A recomputation replays the agreement])."""
        replay = self.replayed()
        if replay is not None:
            return replay.reused and not counted
        return (
            not counted
            and self.memo is not None
            and self.group.size > 1
            and self.memo.reuses(self.index)
        )

    def agree(self, check: LocalCheck, extra: dict[str, Any] | None = None) -> CPContext:
        """One small collective: raise on every rank if any rank's check failed or the ranks
        disagree on the global metadata; else the context of this forward.

        ``extra["loss_rows"]`` (this rank's rows that count in the indexer loss, which only
        this rank knows: a loss mask's), when given, is summed over the ranks in the same
        collective into ``call.loss_rows``; such an agreement is never reused, since the
        count may change from one forward to the next on some ranks only.
        ``extra["loss_rows_total"]`` (the count of all ranks, known on every rank:
        :meth:`loss_rows_total`) is ``call.loss_rows`` as given.
        """
        extra = dict(extra or {})
        loss_rows = extra.pop("loss_rows", None)
        known_total = extra.pop("loss_rows_total", None)
        replay = self.replayed()
        if replay is not None and replay.reused and not check.problems:
            total = replay.total  # the forward reused: so does its recomputation
        else:
            memo = None if replay is not None else self.memo  # a replay leaves the memo be
            reused_before = None if memo is None else memo.reused
            total = agree(
                self.group,
                check,
                self.spec,
                self.config,
                spec_text=self._spec_text,
                config_text=self._config_text,
                count=loss_rows,
                memo=memo,
                index=self.index,
            )
            if replay is None and self.record is not None:
                reused = memo is not None and memo.reused != reused_before
                self.record.agreed[self.index] = Agreed(reused, total, self._checks_skipped)
        self._checks_skipped = False
        return CPContext(
            cp_rank=self.group.rank,
            cp_size=self.group.size,
            spec=self.spec,
            plan=check.plan,
            config=self.config,
            cu_seqlens=check.cu_seqlens,
            ops=self.backend,
            extra=extra,
            group=self.group,
            loss_rows=int(known_total) if known_total is not None else (total or 0),
            sequence_rows=self.sequence_rows(check.n_local),
            roles=self.roles,
        )

    def replayed(self) -> Agreed | None:
        """How this layer agreed in the forward the current call recomputes, or ``None``
        (not a recomputation, or the forward's call did not get that far): Note [A
        recomputation replays the agreement] in :mod:`hp_cp_core.records`."""
        if self.record is None or self.records is None or not self.records.recomputing:
            return None
        return self.record.agreed.get(self.index)

    def skip_checks(self) -> None:
        """Note that the backend skips this call's value checks (the objects the forward's
        first layer checked): the agreement it records says so, for a recomputation."""
        self._checks_skipped = True

    def context(self, n_local: int, cu_seqlens: Any, extra: dict[str, Any]) -> CPContext:
        """Check the local inputs (on every rank, before any exchange) and fetch the plan."""
        return self.agree(self.inspect(n_local, cu_seqlens), extra)


DeepSeekV4CPForward = CPForward
"""The 0.2 name of :class:`CPForward`, a plain alias (the forward serves the whole family)."""

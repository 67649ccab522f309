"""Records per forward in the core (Note [Records per forward] in hp_cp_core.records): which
record a layer call reads, with and without a backend's scope; a forward keeps its own copy of
the batch's padding whatever is recorded after it began."""

from __future__ import annotations

import gc

from hp_cp_core.padding import CPPadding, ShardedSequence
from hp_cp_core.records import ForwardRecords


def test_without_a_scope_a_new_forward_starts_when_a_layer_runs_again() -> None:
    builder = ShardedSequence()
    records = ForwardRecords(builder)
    builder.record(7, 8)
    first = [records.for_layer(k) for k in (0, 1, 2)]
    assert first[0] is first[1] is first[2] and first[0].last_layer == 2
    builder.record(5, 6)  # the next batch, built before the next forward
    second = records.for_layer(0)
    assert second is not first[0]
    assert first[0].sequence.padding == CPPadding(7, 8)  # its own copy, unchanged
    assert second.sequence.padding == CPPadding(5, 6)
    assert records.for_layer(1) is second


def test_a_scope_places_every_call_and_a_record_found_for_none_raises_a_message() -> None:
    records = ForwardRecords(ShardedSequence())
    a = records.start(0)
    records.for_layer(0), records.for_layer(1)
    b = records.start(0)  # layer 0 runs again: another forward
    assert b is not a
    records.enter(a)  # a recomputation of a's layer 1, after b
    assert records.scoped and records.for_layer(1) is a and records.current is a
    records.exit()
    records.enter(None)  # a recomputation whose forward the backend could not find
    assert records.for_layer(1) is None
    assert "could not be found" in records.unknown(1)
    records.exit()
    assert not records.scoped and records.current is b


def test_a_batch_named_by_the_backend_starts_its_own_record() -> None:
    records = ForwardRecords(ShardedSequence())
    batch = ShardedSequence()
    batch.record_batch(37, 40, 12345)
    record = records.start(0, batch)
    assert record.cut and record.sequence.batch_digest == 12345
    assert record.sequence is not batch  # a copy: the batch may be recorded again
    assert records.start(1) is record  # its later layers stay in it


def test_records_are_freed_when_nothing_holds_them() -> None:
    records = ForwardRecords(ShardedSequence())
    kept = records.start(0)
    records.for_layer(0)
    records.start(0)  # the latest is held by the records, the older one by `kept` only
    assert len(records.live()) == 2
    del kept
    gc.collect()
    assert len(records.live()) == 1
    records.clear()
    assert records.current is None

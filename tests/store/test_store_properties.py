"""Property tests: for random histories, the log is exactly the successful appends, in order.

Each example uses a fresh run id in the test's database (the ``store`` fixture is shared
by the examples of one test, hence the suppressed function-scoped-fixture health check).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutlog.eventstore import (
    AppendConflictError,
    EpochFencedError,
    EventStore,
    NewEvent,
    StoreError,
)

SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

BIGINT = st.integers(-(2**63), 2**63 - 1)
OPTIONAL_BIGINT = st.none() | BIGINT | st.integers(-5, 5)
# Text the store accepts: encodable as UTF-8 (no lone surrogates) and without NUL, which
# PostgreSQL TEXT cannot hold (a JSON payload never has a raw one: JSON writes \u0000).
TEXT_CHARS = st.characters(codec="utf-8", exclude_characters="\x00")
PAYLOAD = st.text(alphabet=TEXT_CHARS, max_size=300)
TYPE = st.text(alphabet=TEXT_CHARS, min_size=1, max_size=64)
RECORDED_AT = st.builds(
    lambda dt, minutes: dt.replace(tzinfo=UTC).astimezone(timezone(timedelta(minutes=minutes))),
    st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2200, 1, 1)),
    st.integers(-14 * 60, 14 * 60),
)
EVENT = st.builds(
    NewEvent,
    type=TYPE,
    schema_version=st.integers(1, 2**31 - 1),
    payload=PAYLOAD,
    recorded_at=RECORDED_AT,
    derived=st.none() | st.tuples(OPTIONAL_BIGINT, OPTIONAL_BIGINT),
)


def _as_new(e) -> NewEvent:
    return NewEvent(e.type, e.schema_version, e.payload, e.recorded_at)


@SETTINGS
@given(
    batches=st.lists(st.lists(EVENT, min_size=1, max_size=8), min_size=1, max_size=6),
    page_size=st.integers(1, 12),
)
def test_what_is_read_is_what_was_appended(
    store: EventStore, batches: list[list[NewEvent]], page_size: int
) -> None:
    run_id = uuid.uuid4().hex
    store.create_run(run_id)
    appended: list[NewEvent] = []
    for batch in batches:
        last = store.append(run_id, batch, expected_seq=len(appended) + 1, epoch=1)
        appended.extend(batch)
        assert last == len(appended)
    got = list(store.read(run_id, page_size=page_size))
    assert [e.seq for e in got] == list(range(1, len(appended) + 1))
    assert {(e.run_id, e.epoch) for e in got} == {(run_id, 1)}
    # Equal instants compare equal whatever the offset; the read-back is in UTC.
    assert [_as_new(e) for e in got] == [_as_new(e) for e in appended]
    assert all(e.recorded_at.utcoffset() == timedelta(0) for e in got)
    assert [e.payload.encode() for e in got] == [e.payload.encode() for e in appended]
    assert store.last_seq(run_id) == len(appended)


APPEND = st.tuples(
    st.just("append"),
    st.sampled_from([0, 0, 0, -2, -1, 1, 2, 5]),  # expected_seq offset from the true next
    st.sampled_from([0, 0, 0, 0, -1, 1]),  # epoch offset from the current epoch
    st.integers(1, 4),  # batch size
)
OPEN_EPOCH = st.tuples(
    st.just("open_epoch"),
    st.sampled_from([None, 0, 0, -1, 1]),  # expected_epoch offset (None: unconditional)
    st.just(0),
    st.just(0),
)


@SETTINGS
@given(ops=st.lists(APPEND | OPEN_EPOCH, min_size=1, max_size=25))
def test_log_equals_the_successful_appends(store: EventStore, ops: list[tuple]) -> None:
    run_id = uuid.uuid4().hex
    store.create_run(run_id)
    model: list[tuple[int, int, str]] = []  # (seq, epoch, payload) of successful appends
    epoch = 1
    counter = 0
    for kind, a, b, n in ops:
        if kind == "open_epoch":
            expected = None if a is None else epoch + a
            if expected is None or expected == epoch:
                assert store.open_epoch(run_id, expected_epoch=expected) == epoch + 1
                epoch += 1
            else:
                try:
                    store.open_epoch(run_id, expected_epoch=expected)
                except EpochFencedError as exc:
                    assert (exc.writer_epoch, exc.current_epoch) == (expected, epoch)
                else:
                    raise AssertionError("open_epoch with a stale expected epoch succeeded")
        else:
            expected_seq = len(model) + 1 + a
            writer_epoch = epoch + b
            payloads = [f'{{"n": {counter + j}, "s": "ü{counter}"}}' for j in range(n)]
            counter += n
            batch = [NewEvent("P", 1, p, datetime.now(UTC)) for p in payloads]
            try:
                last = store.append(run_id, batch, expected_seq=expected_seq, epoch=writer_epoch)
            except EpochFencedError as exc:
                assert expected_seq >= 1 and writer_epoch != epoch
                assert (exc.writer_epoch, exc.current_epoch) == (writer_epoch, epoch)
            except AppendConflictError as exc:
                assert expected_seq >= 1 and writer_epoch == epoch and a != 0
                assert exc.actual_next_seq == len(model) + 1
            except StoreError:
                assert expected_seq < 1
            else:
                assert (a, b) == (0, 0), "an append that should have been refused succeeded"
                assert last == len(model) + n
                base = len(model) + 1
                model.extend((base + j, epoch, p) for j, p in enumerate(payloads))
        assert store.last_seq(run_id) == len(model)
        assert store.get_run(run_id).current_epoch == epoch
    assert [(e.seq, e.epoch, e.payload) for e in store.read(run_id)] == model

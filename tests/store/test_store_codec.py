"""Contract of the EventCodec over a real store: round trip, upcasting, and bad rows.

Bad rows are inserted with plain SQL, as if written by another program (or a newer
rolloutlog), and must be reported with their offset, never decoded into garbage.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

import pytest

from rolloutlog.eventstore import (
    CorruptEventError,
    EventCodec,
    EventModel,
    EventStore,
    NewerSchemaVersionError,
    NewEvent,
    UnknownEventTypeError,
)

codec = EventCodec()


@codec.register
class SiblingDone(EventModel):
    event_type: ClassVar[str] = "SiblingDone"
    schema_version: ClassVar[int] = 3

    group_id: int
    prompt_index: int
    target_step: int
    reward: float
    tokens: int
    note: str = ""


@codec.register
class StepDone(EventModel):
    event_type: ClassVar[str] = "StepDone"

    step: int
    groups: tuple[int, ...]


@codec.upcaster("SiblingDone", 1)
def _v1_to_v2(d: dict[str, Any]) -> dict[str, Any]:
    # v1 called it "score" and had no token count.
    d = dict(d)
    d["reward"] = d.pop("score")
    d["tokens"] = 0
    return d


@codec.upcaster("SiblingDone", 2)
def _v2_to_v3(d: dict[str, Any]) -> dict[str, Any]:
    # v2 stored the group and prompt as one "gid:pidx" string.
    d = dict(d)
    gid, pidx = d.pop("ref").split(":")
    d["group_id"], d["prompt_index"] = int(gid), int(pidx)
    return d


NOW = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


def _sql_time(store: EventStore) -> object:
    # SQLite stores UTC text without an offset (SQLAlchemy's format); PostgreSQL a timestamptz.
    return NOW.strftime("%Y-%m-%d %H:%M:%S.%f") if store.dialect == "sqlite" else NOW


def _insert_raw(
    raw_sql: Callable[..., list[tuple]],
    store: EventStore,
    run_id: str,
    type_: str,
    version: int,
    payload: str,
) -> int:
    """Write one row past the end of the log with plain SQL (and move last_seq along)."""
    seq = store.last_seq(run_id) + 1
    raw_sql(
        "INSERT INTO events (run_id, seq, epoch, type, schema_version, recorded_at, payload) "
        "VALUES (:r, :s, 1, :t, :v, :ts, :p)",
        {"r": run_id, "s": seq, "t": type_, "v": version, "ts": _sql_time(store), "p": payload},
    )
    raw_sql("UPDATE runs SET last_seq = :s WHERE run_id = :r", {"s": seq, "r": run_id})
    return seq


def _only(store: EventStore, seq: int):
    (row,) = list(store.read("r1", seq, seq))
    return row


def test_encode_decode_round_trip_through_the_store(store: EventStore) -> None:
    store.create_run("r1")
    events = [
        SiblingDone(group_id=4, prompt_index=17, target_step=2, reward=0.5, tokens=99, note="ü✓"),
        StepDone(step=2, groups=(4, 5, 6)),
        SiblingDone(group_id=5, prompt_index=18, target_step=2, reward=-1e-9, tokens=0),
    ]
    rows = [codec.encode(e, recorded_at=NOW) for e in events]
    assert rows[0] == NewEvent("SiblingDone", 3, events[0].model_dump_json(), NOW)
    # ``derived`` rides along opaquely (for the store's indexers), never into the row.
    assert codec.encode(events[1], recorded_at=NOW, derived=(1, 2)).derived == (1, 2)
    store.append("r1", rows, expected_seq=1, epoch=1)
    stored = list(store.read("r1"))
    decoded = [codec.decode(r) for r in stored]
    assert decoded == events
    assert [type(d) for d in decoded] == [SiblingDone, StepDone, SiblingDone]


def test_encode_many_is_encode_of_each_event() -> None:
    events = [
        SiblingDone(group_id=4, prompt_index=17, target_step=2, reward=0.5, tokens=99, note="ü✓"),
        StepDone(step=2, groups=(4, 5, 6)),
        SiblingDone(group_id=5, prompt_index=18, target_step=2, reward=-1e-9, tokens=0),
    ]
    stamps = [NOW + timedelta(microseconds=i) for i in range(3)]
    keys = [(1, "a"), None, (3, None)]
    many = codec.encode_many(events, recorded_at=stamps, derived=keys)
    one_by_one = [
        codec.encode(e, recorded_at=t, derived=k)
        for e, t, k in zip(events, stamps, keys, strict=True)
    ]
    assert many == one_by_one
    assert all(type(row) is NewEvent for row in many)
    assert many[2].derived == (3, None) and many[1].derived is None
    # One time for all (a command's events), no derived values at all.
    shared = codec.encode_many(events, recorded_at=NOW)
    assert shared == [codec.encode(e, recorded_at=NOW) for e in events]
    assert codec.encode_many([], recorded_at=NOW) == []
    with pytest.raises(ValueError, match="3 events, 2 recorded_at values and 3 derived"):
        codec.encode_many(events, recorded_at=stamps[:2], derived=keys)
    with pytest.raises(ValueError, match="3 events, 3 recorded_at values and 1 derived"):
        codec.encode_many(events, recorded_at=NOW, derived=keys[:1])


def test_encode_refuses_unregistered_classes() -> None:
    class Stray(EventModel):
        event_type: ClassVar[str] = "Stray"

    with pytest.raises(TypeError, match="not registered"):
        codec.encode(Stray(), recorded_at=NOW)
    with pytest.raises(TypeError, match="Stray is not registered"):
        codec.encode_many([StepDone(step=1, groups=()), Stray()], recorded_at=NOW)
    other = EventCodec()
    with pytest.raises(TypeError, match="already registered"):
        other.register(SiblingDone)

        @other.register
        class Clash(EventModel):
            event_type: ClassVar[str] = "SiblingDone"


def test_upcasting_from_version_1_and_2(store: EventStore) -> None:
    store.create_run("r1")
    old = [
        NewEvent(
            "SiblingDone",
            1,
            json.dumps({"ref": "8:80", "target_step": 3, "score": 1.0}),
            NOW,
        ),
        NewEvent(
            "SiblingDone",
            2,
            json.dumps({"ref": "9:90", "target_step": 4, "reward": 0.25, "tokens": 12}),
            NOW,
        ),
    ]
    store.append("r1", old, expected_seq=1, epoch=1)
    got = [codec.decode(r) for r in store.read("r1")]
    assert got == [
        SiblingDone(group_id=8, prompt_index=80, target_step=3, reward=1.0, tokens=0),
        SiblingDone(group_id=9, prompt_index=90, target_step=4, reward=0.25, tokens=12),
    ]


def test_missing_upcaster_is_reported(store: EventStore) -> None:
    lonely = EventCodec()

    @lonely.register
    class V2(EventModel):
        event_type: ClassVar[str] = "V2"
        schema_version: ClassVar[int] = 2
        x: int

    store.create_run("r1")
    store.append("r1", [NewEvent("V2", 1, '{"x": 1}', NOW)], expected_seq=1, epoch=1)
    with pytest.raises(CorruptEventError, match="no upcaster from schema version 1 to 2") as info:
        lonely.decode(_only(store, 1))
    assert info.value.offset == 1


def test_unknown_type_names_type_version_and_offset(store, raw_sql) -> None:
    store.create_run("r1")
    store.append(
        "r1", [codec.encode(StepDone(step=1, groups=()), recorded_at=NOW)], expected_seq=1, epoch=1
    )
    seq = _insert_raw(raw_sql, store, "r1", "FromTheFuture", 4, '{"a": 1}')
    assert seq == 2
    with pytest.raises(UnknownEventTypeError) as info:
        codec.decode(_only(store, seq))
    err = info.value
    assert (err.offset, err.event_type, err.version) == (2, "FromTheFuture", 4)
    msg = str(err)
    assert "'FromTheFuture'" in msg and "version 4" in msg and "offset 2" in msg


def test_newer_schema_version(store, raw_sql) -> None:
    store.create_run("r1")
    seq = _insert_raw(raw_sql, store, "r1", "StepDone", 2, '{"step": 1, "groups": []}')
    with pytest.raises(NewerSchemaVersionError) as info:
        codec.decode(_only(store, seq))
    err = info.value
    assert (err.offset, err.event_type, err.version, err.known) == (1, "StepDone", 2, 1)
    assert "offset 1" in str(err) and "upgrade rolloutlog" in str(err)


@pytest.mark.parametrize(
    ("type_", "version", "payload", "reason"),
    [
        ("StepDone", 1, '{"step": 1, "groups": [', "JSON"),
        ("StepDone", 1, "", "JSON"),
        ("StepDone", 1, "not json at all", "JSON"),
        ("StepDone", 1, '{"step": "one", "groups": []}', "step"),
        ("StepDone", 1, '{"step": 1}', "groups"),
        ("StepDone", 1, '{"step": 1, "groups": [], "extra": true}', "extra"),
        ("StepDone", 1, "[1, 2]", "object"),
        ("SiblingDone", 1, '{"ref": "1:2", "target_step": 3, "score": 1.0', "invalid JSON"),
        ("SiblingDone", 1, "[]", "not a JSON object"),
        (
            "SiblingDone",
            2,
            '{"ref": "1:2", "target_step": "x", "reward": 1, "tokens": 1}',
            "target_step",
        ),
        # Nested past either parser's limit: pydantic's (current version), json's (upcast).
        ("StepDone", 1, '{"step": 1, "groups": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON"),
        ("SiblingDone", 1, '{"ref": ' + "[" * 100_000 + "]" * 100_000 + "}", "too deeply"),
    ],
)
def test_corrupt_rows_name_their_offset(store, raw_sql, type_, version, payload, reason) -> None:
    store.create_run("r1")
    store.append(
        "r1",
        [codec.encode(StepDone(step=i, groups=(i,)), recorded_at=NOW) for i in range(4)],
        expected_seq=1,
        epoch=1,
    )
    seq = _insert_raw(raw_sql, store, "r1", type_, version, payload)
    assert seq == 5
    rows = list(store.read("r1"))
    assert [codec.decode(r) for r in rows[:4]] == [StepDone(step=i, groups=(i,)) for i in range(4)]
    with pytest.raises(CorruptEventError, match=reason) as info:
        codec.decode(rows[4])
    assert info.value.offset == 5
    assert info.value.event_type == type_
    assert "offset 5" in str(info.value)


def test_decoded_events_are_frozen() -> None:
    ev = StepDone(step=1, groups=(1,))
    with pytest.raises(Exception, match="frozen"):
        ev.step = 2  # type: ignore[misc]


def test_raw_rows_round_trip_their_timestamp(store, raw_sql) -> None:
    store.create_run("r1")
    seq = _insert_raw(raw_sql, store, "r1", "StepDone", 1, '{"step": 3, "groups": [1]}')
    row = _only(store, seq)
    assert row.recorded_at == NOW and row.recorded_at.utcoffset() == timedelta(0)
    assert codec.decode(row) == StepDone(step=3, groups=(1,))


@pytest.mark.parametrize(
    ("version", "payload"),
    [
        (1, '{"ref": "1:2", "target_step": 3}'),  # no "score" for the v1 -> v2 upcaster
        (2, '{"ref": 12, "target_step": 3, "reward": 1, "tokens": 1}'),  # "ref" not a string
        (2, '{"ref": "1:2:3", "target_step": 3, "reward": 1, "tokens": 1}'),  # bad "ref"
    ],
)
def test_rows_an_upcaster_cannot_read_are_corrupt(store, raw_sql, version, payload) -> None:
    store.create_run("r1")
    seq = _insert_raw(raw_sql, store, "r1", "SiblingDone", version, payload)
    with pytest.raises(CorruptEventError, match=f"upcasting from schema version {version}") as info:
        codec.decode(_only(store, seq))
    assert info.value.offset == seq
    assert info.value.__cause__ is not None

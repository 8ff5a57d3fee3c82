"""Contract: what is appended is read back exactly, in order, by range, page and audit key."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from storetest_helpers import T0, KeyIndexer, make_batch, make_event, with_key_index

from rolloutlog.eventstore import (
    AppendConflictError,
    EpochFencedError,
    EventStore,
    NewEvent,
    RunExistsError,
    RunInfo,
    RunNotFoundError,
    StoredEvent,
    StoreError,
)


def _assert_same(stored: StoredEvent, new: NewEvent, *, run_id: str, seq: int, epoch: int) -> None:
    assert stored.run_id == run_id
    assert stored.seq == seq
    assert stored.epoch == epoch
    assert stored.type == new.type
    assert stored.schema_version == new.schema_version
    # The store never re-serialises: the text is identical, character for character.
    assert stored.payload == new.payload
    assert stored.payload.encode("utf-8") == new.payload.encode("utf-8")
    assert stored.recorded_at.tzinfo is not None
    assert stored.recorded_at.utcoffset() == timedelta(0)
    assert stored.recorded_at == new.recorded_at


def test_append_read_round_trip_of_every_column(store: EventStore) -> None:
    store.create_run("r1")
    batch = make_batch(1, 10)
    assert store.append("r1", batch, expected_seq=1, epoch=1) == 10
    got = list(store.read("r1"))
    assert len(got) == 10
    for seq, (stored, new) in enumerate(zip(got, batch, strict=True), start=1):
        _assert_same(stored, new, run_id="r1", seq=seq, epoch=1)


def test_nulls_unicode_and_big_audit_values_round_trip(store: EventStore) -> None:
    store.create_run("r1")
    tz = timezone(timedelta(hours=5, minutes=30))
    batch = [
        NewEvent("Bare", 1, "{}", T0),  # every optional column NULL
        NewEvent(
            "Big",
            7,
            '{"s": "日本語 — ünïcödé 🎲", "esc": "\\u0000\\n\\"q\\""}',
            datetime(2030, 1, 2, 3, 4, 5, 999999, tzinfo=tz),  # not UTC: same instant back
        ),
        NewEvent("Long", 1, '{"x": "' + "p" * 200_000 + '"}', T0),
    ]
    store.append("r1", batch, expected_seq=1, epoch=1)
    got = list(store.read("r1"))
    for seq, (stored, new) in enumerate(zip(got, batch, strict=True), start=1):
        _assert_same(stored, new, run_id="r1", seq=seq, epoch=1)
    assert got[1].recorded_at == datetime(2030, 1, 1, 21, 34, 5, 999999, tzinfo=UTC)


def test_read_ranges(store: EventStore) -> None:
    store.create_run("r1")
    store.append("r1", make_batch(1, 20), expected_seq=1, epoch=1)

    def seqs(*args: int | None, **kw: int) -> list[int]:
        return [e.seq for e in store.read("r1", *args, **kw)]  # type: ignore[arg-type]

    assert seqs() == list(range(1, 21))
    assert seqs(5) == list(range(5, 21))
    assert seqs(5, 9) == [5, 6, 7, 8, 9]
    assert seqs(7, 7) == [7]
    assert seqs(1, 20) == list(range(1, 21))
    assert seqs(15, 100) == list(range(15, 21))
    assert seqs(0) == list(range(1, 21))  # from_seq below 1 starts at 1
    assert seqs(21) == []
    assert seqs(9, 5) == []
    assert seqs(1, None) == list(range(1, 21))
    assert [e.payload for e in store.read("r1", 3, 4)] == [
        make_event(3).payload,
        make_event(4).payload,
    ]


@pytest.mark.parametrize("page_size", [1, 2, 3, 7, 10, 11])
def test_paging_across_page_boundaries(store: EventStore, page_size: int) -> None:
    store.create_run("r1")
    store.append("r1", make_batch(1, 10), expected_seq=1, epoch=1)
    store.append("r1", make_batch(11, 1), expected_seq=11, epoch=1)
    full = list(store.read("r1"))
    assert [e.seq for e in full] == list(range(1, 12))
    assert list(store.read("r1", page_size=page_size)) == full
    assert list(store.read("r1", 4, 9, page_size=page_size)) == full[3:9]
    assert list(store.read("r1", 10, page_size=page_size)) == full[9:]


def test_read_is_lazy_and_sees_later_appends_between_pages(store: EventStore) -> None:
    store.create_run("r1")
    store.append("r1", make_batch(1, 4), expected_seq=1, epoch=1)
    it = store.read("r1", page_size=2)
    assert [next(it).seq, next(it).seq] == [1, 2]
    store.append("r1", make_batch(5, 3), expected_seq=5, epoch=1)
    assert [e.seq for e in it] == [3, 4, 5, 6, 7]


def test_runs_are_isolated(store: EventStore) -> None:
    store.create_run("a")
    store.create_run("b")
    store.append("a", make_batch(1, 3), expected_seq=1, epoch=1)
    store.append("b", make_batch(50, 2), expected_seq=1, epoch=1)
    assert [e.payload for e in store.read("a")] == [e.payload for e in make_batch(1, 3)]
    assert [e.payload for e in store.read("b")] == [e.payload for e in make_batch(50, 2)]
    assert {e.run_id for e in store.read("b")} == {"b"}
    assert list(store.read("nobody")) == []


def test_indexer_rows_are_written_with_their_events_and_looked_up(store: EventStore) -> None:
    """An indexer's derived rows are written in the append's transaction, with the
    events' sequences; ``derived_rows`` finds them by equality, per run, in order."""
    with_key_index(store)
    store.create_run("r1")
    batch = make_batch(1, 40)
    store.append("r1", batch, expected_seq=1, epoch=1)
    store.create_run("other")
    store.append("other", make_batch(1, 40), expected_seq=1, epoch=1)

    def expect(pred) -> list[int]:
        return [seq for seq, ev in enumerate(batch, start=1) if pred(ev)]

    for pos, key in ((0, "k1"), (1, "k2")):
        values = {ev.derived[pos] for ev in batch}
        assert len(values) > 1
        for v in values:
            got = store.derived_rows("test_keys", "r1", **{key: v})
            assert [r[1] for r in got] == expect(lambda ev, p=pos, v=v: ev.derived[p] == v)
            assert all(r[0] == "r1" and r[2 + pos] == v for r in got)
        assert store.derived_rows("test_keys", "r1", **{key: 10**9}) == []
    both = store.derived_rows("test_keys", "r1", 10, 30, k1=2, k2=103)
    assert [r[1] for r in both] == [
        s for s in expect(lambda ev: ev.derived == (2, 103)) if 10 <= s <= 30
    ]
    assert both  # the combination exists in the test data
    assert store.derived_rows("test_keys", "nobody") == []
    with pytest.raises(StoreError, match="no columns"):
        store.derived_rows("test_keys", "r1", nope=1)
    # A refused append (conflict, fenced writer) writes no derived row either.
    with pytest.raises(AppendConflictError):
        store.append("r1", make_batch(41, 2), expected_seq=7, epoch=1)
    with pytest.raises(EpochFencedError):
        store.append("r1", make_batch(41, 2), expected_seq=41, epoch=9)
    assert len(store.derived_rows("test_keys", "r1")) == 40
    # The indexer's own checks: identifiers only, never a store table, (run_id, seq) first.
    for bad_table, bad_cols in (
        ("events", ("run_id", "seq")),
        ("x; DROP TABLE runs", ("run_id", "seq")),
        ("test_other", ("seq", "run_id")),
    ):
        bad = KeyIndexer()
        bad.table, bad.columns = bad_table, bad_cols  # type: ignore[misc]
        with pytest.raises(StoreError):
            store.add_indexer(bad)

    # A failing indexer aborts the whole append: no event, no derived row.
    class Broken(KeyIndexer):
        table = "test_broken"

        def rows(self, run_id, first_seq, batch):  # type: ignore[no-untyped-def]
            raise ValueError("indexer bug")

    store.add_indexer(Broken())
    with pytest.raises((ValueError, StoreError)):
        store.append("r1", make_batch(41, 2), expected_seq=41, epoch=1)
    assert store.last_seq("r1") == 40
    assert len(store.derived_rows("test_keys", "r1")) == 40


def test_last_seq_and_get_run(store: EventStore) -> None:
    info = store.create_run("r1", config_fingerprint="fp", config_json='{"k": 1}', epoch=3)
    assert isinstance(info, RunInfo)
    assert (info.run_id, info.config_fingerprint, info.config_json) == ("r1", "fp", '{"k": 1}')
    assert (info.current_epoch, info.last_seq) == (3, 0)
    assert info.created_at.utcoffset() == timedelta(0)
    assert abs(datetime.now(UTC) - info.created_at) < timedelta(minutes=1)
    assert store.last_seq("r1") == 0
    store.append("r1", make_batch(1, 5), expected_seq=1, epoch=3)
    assert store.last_seq("r1") == 5
    store.append("r1", make_batch(6, 1), expected_seq=6, epoch=3)
    assert store.last_seq("r1") == 6
    assert store.get_run("r1") == RunInfo("r1", info.created_at, "fp", '{"k": 1}', 3, 6)


def test_list_runs_oldest_first(store: EventStore) -> None:
    assert store.list_runs() == []
    names = ["zeta", "alpha", "mid"]
    created = [store.create_run(n) for n in names]
    store.append("alpha", make_batch(1, 2), expected_seq=1, epoch=1)
    runs = store.list_runs()
    assert [r.run_id for r in runs] == names
    assert runs[0] == created[0]
    assert runs[1].last_seq == 2


def test_get_run_of_missing_run(store: EventStore) -> None:
    with pytest.raises(RunNotFoundError, match="'ghost'"):
        store.get_run("ghost")
    with pytest.raises(RunNotFoundError):
        store.last_seq("ghost")


def test_create_run_twice(store: EventStore) -> None:
    store.create_run("r1", config_fingerprint="first")
    store.append("r1", make_batch(1, 2), expected_seq=1, epoch=1)
    with pytest.raises(RunExistsError, match="'r1'"):
        store.create_run("r1", config_fingerprint="second")
    info = store.get_run("r1")
    assert (info.config_fingerprint, info.last_seq) == ("first", 2)
    # The store is still usable after the failed insert.
    store.append("r1", make_batch(3, 1), expected_seq=3, epoch=1)
    assert store.last_seq("r1") == 3


@pytest.mark.parametrize("bad", ["", "x" * 129])
def test_create_run_rejects_bad_ids(store: EventStore, bad: str) -> None:
    with pytest.raises(StoreError, match="run id"):
        store.create_run(bad)
    assert store.list_runs() == []


def test_empty_append_writes_nothing(store: EventStore) -> None:
    store.create_run("r1")
    assert store.append("r1", [], expected_seq=1, epoch=1) == 0
    assert store.last_seq("r1") == 0
    with pytest.raises(StoreError, match="expected_seq"):
        store.append("r1", make_batch(1, 1), expected_seq=0, epoch=1)
    assert list(store.read("r1")) == []


def test_reopen_sees_the_same_log(db_url: str, open_store) -> None:
    first = open_store(db_url)
    first.create_run("r1")
    first.append("r1", make_batch(1, 5), expected_seq=1, epoch=1)
    before = list(first.read("r1"))
    first.close()
    again = open_store(db_url)
    assert list(again.read("r1")) == before
    assert again.last_seq("r1") == 5


def test_nul_in_payload_is_kept_or_refused_never_cut(store: EventStore) -> None:
    """SQLite keeps a raw NUL; PostgreSQL TEXT cannot hold one and refuses the whole batch
    with a StoreError. Either way nothing is truncated at the NUL and no batch is partial.
    (A codec-encoded payload is JSON, which writes NUL as \\u0000, so it never has one.)"""
    store.create_run("r1")
    batch = [make_event(1), make_event(2, payload='{"a": "x\x00y"}')]
    try:
        store.append("r1", batch, expected_seq=1, epoch=1)
    except StoreError as exc:
        assert store.dialect == "postgresql", exc
        assert "NUL" in str(exc) and "appending to run 'r1'" in str(exc)
        assert store.last_seq("r1") == 0
        assert list(store.read("r1")) == []
    else:
        assert store.dialect in ("sqlite", "memory")  # both keep the NUL
        assert [e.payload for e in store.read("r1")] == [e.payload for e in batch]


def test_record_separators_and_any_instant_round_trip(store: EventStore) -> None:
    """PostgreSQL sends a batch's types and payloads as text joined by U+001E and its
    timestamps as epoch microseconds, or as arrays when a payload holds a raw U+001E:
    either way every backend reads back exactly what was appended."""
    store.create_run("r1")
    east = timezone(timedelta(hours=14))
    plain = [
        NewEvent("A", 1, '{"i": 1}', datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)),
        NewEvent("B", 3, '{"esc": "\\u001e"}', datetime(1970, 1, 1, 0, 0, 0, 1, tzinfo=east)),
        NewEvent("C", 2, "{}", datetime(2262, 4, 11, 23, 47, 16, 854775, tzinfo=UTC)),
        NewEvent("D", 1, '{"s": ""}', datetime(1000, 1, 1, tzinfo=UTC)),
    ]
    raw_separator = [
        NewEvent("E", 1, '{"raw": "a\x1eb"}', T0),  # not JSON: the store keeps it anyway
        NewEvent("F", 1, "\x1e", T0 + timedelta(microseconds=1)),
    ]
    alone = [NewEvent("G", 1, "", T0)]  # one empty text: splits into nothing, not one ""
    empty_last = [NewEvent("H", 1, "{}", T0), NewEvent("I", 1, "", T0)]
    assert store.append("r1", plain, expected_seq=1, epoch=1) == 4
    assert store.append("r1", raw_separator, expected_seq=5, epoch=1) == 6
    assert store.append("r1", alone, expected_seq=7, epoch=1) == 7
    assert store.append("r1", empty_last, expected_seq=8, epoch=1) == 9
    got = list(store.read("r1"))
    appended = plain + raw_separator + alone + empty_last
    for seq, (stored, new) in enumerate(zip(got, appended, strict=True), start=1):
        _assert_same(stored, new, run_id="r1", seq=seq, epoch=1)


def test_derived_rows_with_nulls_and_extreme_keys_round_trip(store: EventStore) -> None:
    """Derived columns go to PostgreSQL as packed text where they can (NULL as an empty
    element) and as arrays where they cannot (a lone NULL): every backend stores the same
    rows, NULLs, negatives and 64-bit extremes included."""
    with_key_index(store)
    store.create_run("r1")
    keys = [(None, None), (-(2**63), 2**63 - 1), (0, None), (None, -1)]
    batch = [NewEvent("K", 1, "{}", T0, k) for k in keys]
    alone = [NewEvent("K", 1, "{}", T0, (None, None))]  # one row of NULLs: '' splits to {}
    store.append("r1", batch, expected_seq=1, epoch=1)
    store.append("r1", alone, expected_seq=5, epoch=1)
    got = [(r[1], r[2], r[3]) for r in store.derived_rows("test_keys", "r1")]
    assert got == [(seq, *k) for seq, k in enumerate([*keys, (None, None)], start=1)]


@pytest.mark.parametrize(
    ("text", "instant"),
    [
        ("2026-12-03 11:59:59.123456", datetime(2026, 12, 3, 11, 59, 59, 123456, tzinfo=UTC)),
        ("2026-12-03T11:59:59", datetime(2026, 12, 3, 11, 59, 59, tzinfo=UTC)),
        ("2026-12-03 11:59:59.5+00:00", datetime(2026, 12, 3, 11, 59, 59, 500000, tzinfo=UTC)),
    ],
)
def test_read_takes_any_iso_spelling_another_sqlite_writer_left(
    db_url: str, raw_sql, text: str, instant: datetime
) -> None:
    """``read`` parses SQLite's stamps on its hot path as ``_iso`` writes them; text spelt
    otherwise (another writer's, an older version's) takes the general parser: the same
    instant, in UTC, as a StoredEvent."""
    if not db_url.startswith("sqlite"):
        pytest.skip("SQLite stores the stamp as text; PostgreSQL as timestamptz")
    with EventStore.open(db_url) as store:
        store.create_run("r1")
        store.append("r1", [NewEvent("A", 1, "{}", T0)], expected_seq=1, epoch=1)
        raw_sql("UPDATE events SET recorded_at = :t WHERE run_id = 'r1' AND seq = 1", {"t": text})
        (row,) = list(store.read("r1"))
    assert type(row) is StoredEvent
    assert row.recorded_at == instant and row.recorded_at.utcoffset() == timedelta(0)
    assert (row.run_id, row.seq, row.epoch, row.type, row.schema_version, row.payload) == (
        "r1",
        1,
        1,
        "A",
        1,
        "{}",
    )

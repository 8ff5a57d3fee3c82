"""Contract: what is appended is read back exactly, in order, by range, page and audit key."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from storetest_helpers import T0, make_batch, make_event

from rolloutlog.eventstore import (
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
    assert stored.train_step == new.train_step
    assert stored.weight_version == new.weight_version
    assert stored.group_id == new.group_id
    assert stored.prompt_index == new.prompt_index
    assert stored.target_step == new.target_step


def test_append_read_round_trip_of_every_column(store: EventStore) -> None:
    store.create_run("r1")
    batch = make_batch(1, 10)
    assert store.append("r1", batch, expected_seq=1, epoch=1) == 10
    got = list(store.read("r1"))
    assert len(got) == 10
    for seq, (stored, new) in enumerate(zip(got, batch, strict=True), start=1):
        _assert_same(stored, new, run_id="r1", seq=seq, epoch=1)
    # read_where goes through SQLAlchemy Core rather than raw SQL: same values.
    assert store.read_where("r1") == got


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
            train_step=2**62,
            weight_version=-(2**40),
            group_id=2**63 - 1,
            prompt_index=0,
            target_step=-1,
        ),
        NewEvent("Long", 1, '{"x": "' + "p" * 200_000 + '"}', T0),
    ]
    store.append("r1", batch, expected_seq=1, epoch=1)
    got = list(store.read("r1"))
    for seq, (stored, new) in enumerate(zip(got, batch, strict=True), start=1):
        _assert_same(stored, new, run_id="r1", seq=seq, epoch=1)
    assert got[0].train_step is None and got[0].group_id is None
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
    assert store.read_where("b", group_id=make_event(3).group_id) == []  # only "a" has it
    assert list(store.read("nobody")) == []
    assert store.read_where("nobody") == []


def test_read_where_by_each_audit_key(store: EventStore) -> None:
    store.create_run("r1")
    batch = make_batch(1, 40)
    store.append("r1", batch, expected_seq=1, epoch=1)
    store.create_run("other")
    store.append("other", make_batch(1, 40), expected_seq=1, epoch=1)

    def expect(pred) -> list[int]:
        return [seq for seq, ev in enumerate(batch, start=1) if pred(ev)]

    for key in ("group_id", "prompt_index", "train_step", "target_step"):
        values = {getattr(ev, key) for ev in batch}
        assert len(values) > 1
        for v in values:
            got = store.read_where("r1", **{key: v})
            assert [e.seq for e in got] == expect(lambda ev, k=key, v=v: getattr(ev, k) == v)
            assert all(e.run_id == "r1" and getattr(e, key) == v for e in got)
        assert store.read_where("r1", **{key: 10**9}) == []
    both = store.read_where("r1", group_id=2, train_step=3)
    assert [e.seq for e in both] == expect(lambda ev: ev.group_id == 2 and ev.train_step == 3)
    assert both  # the combination exists in the test data
    full = {e.seq: e for e in store.read("r1")}
    assert all(full[e.seq] == e for e in both)


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
        assert store.dialect == "sqlite"
        assert [e.payload for e in store.read("r1")] == [e.payload for e in batch]

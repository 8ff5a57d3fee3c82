"""Multi-row inserts (eventstore/bulk.py): shared columns bound once, chunks within the
parameter limit, and the checks on what the store hands them."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rolloutlog.eventstore import StoreError
from rolloutlog.eventstore.bulk import MultiRowInsert
from rolloutlog.eventstore.records import NewEvent
from rolloutlog.eventstore.store import _iso, derived_values, sqlite_event_values


def _table() -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (run_id TEXT NOT NULL, seq INT, epoch INT, v TEXT)")
    return conn


@pytest.mark.parametrize("max_variables", [32766, 9, 4])
def test_shared_columns_are_bound_once_and_land_in_every_row(max_variables: int) -> None:
    bulk = MultiRowInsert(
        "t",
        ("run_id", "seq", "epoch", "v"),
        shared=("run_id", "epoch"),
        max_variables=max_variables,
    )
    assert bulk.per_row == ("seq", "v")
    rows = [(i, f"x{i}") for i in range(1, 8)]
    flat = [value for row in rows for value in row]
    conn = _table()
    chunks = list(bulk.chunks(flat, len(rows), ("r", 3)))
    for sql, params in chunks:
        assert params[:2] == ["r", 3]  # the shared values lead every statement's parameters
        assert sql.count("?") == len(params) and "?1" in sql and "?2" in sql
        conn.execute(sql, params)
    # As few statements as the limit allows: (limit - 2 shared) // 2 per-row values each.
    assert len(chunks) == -(-7 // max(1, (max_variables - 2) // 2))
    assert conn.execute("SELECT run_id, seq, epoch, v FROM t ORDER BY seq").fetchall() == [
        ("r", i, 3, f"x{i}") for i in range(1, 8)
    ]


def test_the_row_values_and_the_shared_values_must_fit_the_columns() -> None:
    bulk = MultiRowInsert("t", ("run_id", "seq", "epoch", "v"), shared=("run_id",))
    with pytest.raises(StoreError, match="5 values for 2 rows of 3 columns"):
        list(bulk.chunks([1, 2, "a", 3, 4], 2, ("r",)))
    with pytest.raises(StoreError, match="0 for the shared"):
        list(bulk.chunks([1, 2, "a"], 1))
    with pytest.raises(ValueError, match="not columns of t"):
        MultiRowInsert("t", ("run_id", "seq"), shared=("nope",))
    with pytest.raises(ValueError, match="cannot be combined"):
        MultiRowInsert("t", ("run_id", "seq"), shared=("run_id",), suffix="ON CONFLICT DO NOTHING")
    with pytest.raises(ValueError, match="per row"):
        MultiRowInsert("t", ("run_id",), shared=("run_id",))


def test_derived_rows_must_all_name_the_appended_run() -> None:
    assert derived_values("ix", "r", [("r", 1, 7), ("r", 2, 8)]) == [1, 7, 2, 8]
    assert derived_values("ix", "r", []) == []
    with pytest.raises(StoreError, match="starting with the appended run id 'r'"):
        derived_values("ix", "r", [("r", 1, 7), ("other", 2, 8)])
    with pytest.raises(StoreError, match="must all be 3 values"):
        derived_values("ix", "r", [("r", 1, 7), ("r", 2)])


_STAMPS = st.one_of(
    # Around now, often within one second of each other (the cached second's path).
    st.datetimes(
        min_value=datetime(2026, 12, 3, 11, 59, 58),
        max_value=datetime(2026, 12, 3, 12, 0, 2),
        timezones=st.just(UTC),
    ),
    st.datetimes(min_value=datetime(1, 1, 2), timezones=st.just(UTC)),  # before 1971 too
    st.datetimes(  # another zone: converted to UTC
        min_value=datetime(1971, 1, 2), timezones=st.just(timezone(timedelta(hours=5, minutes=30)))
    ),
    # The last and first microseconds of two adjacent seconds, in years whose epoch
    # seconds' floats are coarse (far future: .999999 can round up to the next second).
    st.builds(
        lambda year, second, us: datetime(year, 1, 1, 0, 0, second, us, tzinfo=UTC),
        st.sampled_from([2026, 2106, 2199, 2200, 2243, 5000, 9998]),
        st.integers(0, 1),
        st.sampled_from([0, 1, 999_998, 999_999]),
    ),
)


@given(stamps=st.lists(_STAMPS, max_size=40), repeats=st.lists(st.integers(1, 3), max_size=40))
def test_event_values_are_the_rows_columns_with_timestamps_as_iso_writes_them(
    stamps: list[datetime], repeats: list[int]
) -> None:
    """The hot path's row values: the columns in order, and every timestamp exactly as
    :func:`_iso` formats it, whether a stamp object repeats, shares a second with the one
    before, crosses a second or lies before 1971."""
    # A command's events share one stamp object: repeat some.
    shared = [
        s for s, r in zip(stamps, repeats + [1] * len(stamps), strict=False) for _ in range(r)
    ]
    batch = [
        NewEvent(f"T{i}", i % 3 + 1, f'{{"i":{i}}}', stamp, None) for i, stamp in enumerate(shared)
    ]
    flat = sqlite_event_values(batch, 7)
    assert flat == [
        value
        for seq, ev in enumerate(batch, 7)
        for value in (seq, ev.type, ev.schema_version, _iso(ev.recorded_at), ev.payload)
    ]


def test_event_values_of_the_last_microsecond_of_a_second() -> None:
    """A stamp a microsecond before the next second keeps its second, the next one is the
    next second's (the cached second's bounds)."""
    early = datetime(2026, 12, 3, 11, 59, 59, 0, tzinfo=UTC)
    late = early.replace(microsecond=999_999)
    after = late + timedelta(microseconds=1)
    batch = [NewEvent("T", 1, "{}", stamp, None) for stamp in (early, late, after)]
    assert sqlite_event_values(batch, 1)[3::5] == [
        "2026-12-03 11:59:59.000000",
        "2026-12-03 11:59:59.999999",
        "2026-12-03 12:00:00.000000",
    ]


@pytest.mark.parametrize("year", [1000, 1969, 2199, 2200, 2500, 9998, 9999])
def test_event_values_across_a_second_in_a_far_year(year: int) -> None:
    """Any year: a stamp just after a second's .999999 is not given the cached second (it
    was, in 9999, while the cache compared float epoch seconds: ``00:00:00.000001`` for
    ``00:00:01.000001``), and the last second of 9999 (no next second) is written too."""
    late = datetime(year, 1, 1, 0, 0, 0, 999_999, tzinfo=UTC)
    after = late + timedelta(microseconds=2)
    batch = [NewEvent("T", 1, "{}", stamp, None) for stamp in (late, after)]
    assert sqlite_event_values(batch, 1)[3::5] == [
        f"{year}-01-01 00:00:00.999999",
        f"{year}-01-01 00:00:01.000001",
    ]


def test_event_values_of_the_last_second_of_year_9999_and_before_year_1000() -> None:
    """The stamps the second cache leaves to :func:`_iso`: the last second there is, and
    years :func:`_iso` writes by ``strftime``."""
    last = datetime(9999, 12, 31, 23, 59, 59, 999_998, tzinfo=UTC)
    old = datetime(999, 5, 1, 0, 0, 0, 1, tzinfo=UTC)
    stamps = [last, last + timedelta(microseconds=1), old, old + timedelta(microseconds=1)]
    batch = [NewEvent("T", 1, "{}", stamp, None) for stamp in stamps]
    assert sqlite_event_values(batch, 1)[3::5] == [_iso(stamp) for stamp in stamps]

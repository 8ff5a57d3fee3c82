"""Multi-row inserts (eventstore/bulk.py): shared columns bound once, chunks within the
parameter limit, and the checks on what the store hands them."""

from __future__ import annotations

import sqlite3

import pytest

from rolloutlog.eventstore import StoreError
from rolloutlog.eventstore.bulk import MultiRowInsert
from rolloutlog.eventstore.store import derived_values


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

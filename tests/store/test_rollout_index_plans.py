"""The rollout index's lookups use its indexes, including the partial ones of the sparse
keys (revision 0009): an equality on a key implies the key IS NOT NULL, on both
databases, so making those indexes partial costs no lookup its index. A step alone is
read through the (type, step) index, one seek per type (revision 0010)."""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa

from rolloutlog.controller.rollout_index import _RUN_TYPES, attach, read_where
from rolloutlog.eventstore import EventStore

LOOKUPS = {
    "ix_rollout_index_run_group": "run_id = :r AND group_id = :k",
    "ix_rollout_index_run_prompt": "run_id = :r AND prompt_index = :k",
    "ix_rollout_index_run_target_step": "run_id = :r AND target_step = :k",
    "ix_rollout_index_run_type_step": "run_id = :r AND type = 'StepTrained' AND train_step = :k",
}

SPARSE = (
    "ix_rollout_index_run_group",
    "ix_rollout_index_run_prompt",
    "ix_rollout_index_run_target_step",
)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def sql_url(request: pytest.FixtureRequest) -> str:
    """A fresh SQLite file or PostgreSQL database (the memory store has no SQL)."""
    return str(request.getfixturevalue("pg_url" if request.param == "postgres" else "sqlite_url"))


def _plan(conn: sa.Connection, sql: str, params: dict[str, object]) -> str:
    """The query plan of ``sql`` as one string."""
    if conn.dialect.name == "postgresql":
        # An empty table is cheapest to scan: forbid that, so the plan shows whether the
        # index is usable at all (a partial index the planner cannot prove applicable
        # would still give a sequential scan).
        conn.execute(sa.text("SET enable_seqscan = off"))
        explain = "EXPLAIN"
    else:
        explain = "EXPLAIN QUERY PLAN"
    return " ".join(
        str(c) for row in conn.execute(sa.text(f"{explain} {sql}"), params) for c in row
    )


@pytest.mark.parametrize("index", sorted(LOOKUPS))
def test_each_lookup_uses_its_index(sql_url: str, index: str) -> None:
    store = EventStore.open(sql_url)
    attach(store)
    try:
        with store.engine.connect() as conn:
            # SELECT *: columns the index does not cover, as a lookup reads them.
            sql = f"SELECT * FROM rollout_index WHERE {LOOKUPS[index]}"
            plan = _plan(conn, sql, {"r": "run", "k": 3})
    finally:
        store.close()
    assert "Seq Scan" not in plan and "SCAN rollout_index" not in plan, plan  # no full scan
    # The key's own index, not a range of the primary key (run_id = ?: the whole run).
    assert index in plan, plan


def test_the_sparse_key_indexes_are_partial(sqlite_url: str) -> None:
    store = EventStore.open(sqlite_url)
    attach(store)
    try:
        with store.engine.connect() as conn:
            sql = dict(
                conn.execute(
                    sa.text(
                        "SELECT name, sql FROM sqlite_master WHERE type = 'index' "
                        "AND tbl_name = 'rollout_index' AND sql IS NOT NULL"
                    )
                ).all()
            )
    finally:
        store.close()
    for name, column in (
        ("ix_rollout_index_run_group", "group_id"),
        ("ix_rollout_index_run_prompt", "prompt_index"),
        ("ix_rollout_index_run_target_step", "target_step"),
    ):
        assert sql[name].endswith(f"WHERE {column} IS NOT NULL"), sql[name]
    assert "WHERE" not in sql["ix_rollout_index_run_type_step"]
    assert "ix_rollout_index_run_train_step" not in sql  # dropped by revision 0010


def test_a_step_alone_is_seeks_of_the_type_step_index(sql_url: str) -> None:
    """read_where(train_step=) lists the run's types by a loose index scan, then seeks
    (type, step) per type: no plan of either statement scans the table."""
    store = EventStore.open(sql_url)
    attach(store)
    try:
        with store.engine.connect() as conn:
            types_plan = _plan(conn, str(_RUN_TYPES), {"run_id": "run"})
            seek_plan = _plan(
                conn,
                "SELECT seq FROM rollout_index WHERE run_id = :r "
                "AND type IN ('BatchSelected', 'StepTrained') AND train_step = :k",
                {"r": "run", "k": 3},
            )
    finally:
        store.close()
    for plan in (types_plan, seek_plan):
        assert "Seq Scan" not in plan and "SCAN rollout_index" not in plan, plan
        assert "ix_rollout_index_run_type_step" in plan, plan


def test_read_where_a_step_alone_finds_every_type_of_that_step(sql_url: str) -> None:
    """Rows of several types at steps 0-2 (and of another run): a step's lookup returns
    exactly that run's rows of that step, whatever their type."""
    from datetime import UTC, datetime

    from rolloutlog.eventstore import NewEvent

    now = datetime(2026, 12, 2, tzinfo=UTC)
    store = EventStore.open(sql_url)
    attach(store)
    try:
        layout = [("A", 0), ("B", 0), ("A", 1), ("C", 1), ("B", 1), ("A", 2), ("D", 1)]
        for run in ("run", "other"):
            store.create_run(run)
            rows = [
                NewEvent(typ, 1, f'{{"i": {i}}}', now, (None, None, None, step, step))
                for i, (typ, step) in enumerate(layout)
            ]
            store.append(run, rows, expected_seq=1, epoch=1)
        got = read_where(store, "run", train_step=1)
        assert [(e.seq, e.type, e.train_step) for e in got] == [
            (3, "A", 1),
            (4, "C", 1),
            (5, "B", 1),
            (7, "D", 1),
        ]
        assert read_where(store, "run", train_step=9) == []
        assert read_where(store, "nobody", train_step=1) == []
    finally:
        store.close()


#: What each sibling lookup's plan must show: (SQLite's plan lines, PostgreSQL's index names).
SIBLING_PLANS: dict[str, tuple[dict[str, object], list[str], list[str]]] = {
    "group": (
        {"group_id": 3},
        ["sx USING COVERING INDEX ix_rollout_sibling_index_run_group", "m2 USING PRIMARY KEY"],
        ["ix_rollout_sibling_index_run_group", "pk_rollout_step_marks"],
    ),
    "group-and-step": (
        {"group_id": 3, "train_step": 1},
        ["sx USING COVERING INDEX ix_rollout_sibling_index_run_group"],
        ["ix_rollout_sibling_index_run_group"],
    ),
    "step": (
        {"train_step": 1},
        [
            "m USING COVERING INDEX ix_rollout_step_marks_run_train_step",
            "sx USING PRIMARY KEY (run_id=? AND seq>? AND seq<?)",
        ],
        ["ix_rollout_step_marks_run_train_step", "pk_rollout_sibling_index"],
    ),
    "step-and-type": (
        {"train_step": 1, "event_type": "SiblingCompleted"},
        ["m USING COVERING INDEX ix_rollout_step_marks_run_train_step"],
        ["ix_rollout_step_marks_run_train_step"],
    ),
}


@pytest.mark.parametrize("lookup", sorted(SIBLING_PLANS))
def test_sibling_lookups_seek_their_indexes(sql_url: str, lookup: str) -> None:
    """read_where's sibling events (revision 0011): a group through the sibling index
    (covering on SQLite), a step through its marks' index then primary-key ranges of the
    sibling rows; each event's mark and event row by primary key. No full scan, and no
    range of a whole run (SQLite without statistics tends to prefer those)."""
    from datetime import UTC, datetime

    from rolloutlog.controller.rollout_index import sibling_query
    from rolloutlog.eventstore import NewEvent

    keys, sqlite_lines, pg_indexes = SIBLING_PLANS[lookup]
    args = {"group_id": None, "train_step": None, "event_type": None, **keys}
    sql, params = sibling_query(**args)  # type: ignore[arg-type]
    store = EventStore.open(sql_url)
    attach(store)
    try:
        # Some runs' worth of sibling events (PostgreSQL plans by statistics: on empty
        # tables every plan costs the same). 2,000 events a run, 16 per group, a step
        # every 500, appended 100 at a time.
        now = datetime(2026, 12, 3, tzinfo=UTC)
        for run in ("run", "other", "third"):
            store.create_run(run)
            rows = [
                NewEvent(
                    "SiblingCompleted" if i % 2 else "SiblingDispatched",
                    1,
                    "{}",
                    now,
                    (i // 16, None, None, i // 500, i // 500),
                )
                for i in range(2000)
            ]
            for start in range(0, 2000, 100):
                store.append(run, rows[start : start + 100], expected_seq=start + 1, epoch=1)
        with store.engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(sa.text("ANALYZE"))
            plan = _plan(conn, sql, {"run_id": "run", **params})
    finally:
        store.close()
    assert "Seq Scan" not in plan, plan
    if sql_url.startswith("sqlite"):
        # "SCAN r" is the materialized list of the step's marks; nothing else is scanned.
        assert not re.search(r"SCAN (?!r\b)", plan), plan
        assert "(run_id=?)" not in plan, plan  # a range of the whole run
        for line in sqlite_lines:
            assert line in plan, plan
    else:
        for index in pg_indexes:
            assert index in plan, plan

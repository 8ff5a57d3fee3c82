"""The rollout index's lookups use its indexes, including the partial ones of the sparse
keys (revision 0009): an equality on a key implies the key IS NOT NULL, on both
databases, so making those indexes partial costs no lookup its index."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from rolloutlog.controller.rollout_index import attach
from rolloutlog.eventstore import EventStore

LOOKUPS = {
    "ix_rollout_index_run_group": "run_id = :r AND group_id = :k",
    "ix_rollout_index_run_prompt": "run_id = :r AND prompt_index = :k",
    "ix_rollout_index_run_target_step": "run_id = :r AND target_step = :k",
    "ix_rollout_index_run_train_step": "run_id = :r AND train_step = :k",
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


@pytest.mark.parametrize("index", sorted(LOOKUPS))
def test_each_lookup_uses_its_index(sql_url: str, index: str) -> None:
    store = EventStore.open(sql_url)
    attach(store)
    try:
        with store.engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                # An empty table is cheapest to scan: forbid that, so the plan shows
                # whether the index is usable at all (a partial index the planner cannot
                # prove applicable would still give a sequential scan).
                conn.execute(sa.text("SET enable_seqscan = off"))
                explain = "EXPLAIN"
            else:
                explain = "EXPLAIN QUERY PLAN"
            sql = f"{explain} SELECT seq FROM rollout_index WHERE {LOOKUPS[index]}"
            plan = " ".join(
                str(col) for row in conn.execute(sa.text(sql), {"r": "run", "k": 3}) for col in row
            )
    finally:
        store.close()
    assert "Seq Scan" not in plan and "SCAN rollout_index" not in plan, plan  # no full scan
    if index in SPARSE:
        assert index in plan, plan  # the partial index itself


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
    assert "WHERE" not in sql["ix_rollout_index_run_train_step"]

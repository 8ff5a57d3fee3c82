"""The alembic migrations on both dialects: up, down, up again; agreement with schema.py;
and the store's refusal of a database at another revision."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy.engine import Connection, Engine

from rolloutlog.controller.rollout_index import metadata as index_metadata
from rolloutlog.eventstore import EventStore, NewEvent, SchemaMismatchError, migrate, schema_head
from rolloutlog.eventstore.schema import metadata as store_metadata

# The log's tables and the controller's index: one chain of revisions creates both.
metadata = sa.MetaData(naming_convention=dict(store_metadata.naming_convention))
for _md in (store_metadata, index_metadata):
    for _table in _md.sorted_tables:
        _table.to_metadata(metadata)
OWN_TABLES = set(metadata.tables)
FUTURE_REVISION = "ffff_next_for_tests"


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """An engine on the (empty) test database, made the way the store makes it."""
    store = EventStore.open(db_url, check_schema=False)
    yield store.engine
    store.close()


def tables_of(engine: Engine) -> set[str]:
    """Names of the tables in the database."""
    with engine.connect() as conn:
        return set(sa.inspect(conn).get_table_names())


def views_of(engine: Engine) -> set[str]:
    """Names of the views in the database (the audit views of later revisions)."""
    with engine.connect() as conn:
        return set(sa.inspect(conn).get_view_names())


def revision_of(engine: Engine) -> str | None:
    """The database's alembic revision."""
    with engine.connect() as conn:
        return migrate.current_revision(conn)


def set_revision(engine: Engine, revision: str) -> None:
    """Overwrite the stored alembic revision (as another rolloutlog version would leave it)."""
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = :r"), {"r": revision})


def make_next_revision_dir(tmp_path: Path) -> Path:
    """A copy of the shipped migrations plus one newer revision that adds a table.

    Code pointed at this folder behaves like a newer rolloutlog whose head is one
    revision past the shipped head.
    """
    target = tmp_path / "migrations_next"
    shutil.copytree(
        migrate.migrations_dir(), target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    (target / "versions" / f"{FUTURE_REVISION}.py").write_text(
        f'''"""A revision past the shipped head, for tests."""

import sqlalchemy as sa
from alembic import op

revision = "{FUTURE_REVISION}"
down_revision = "{migrate.head_revision()}"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table("test_next", sa.Column("id", sa.Integer(), primary_key=True))


def downgrade() -> None:
    op.drop_table("test_next")
'''
    )
    return target


def test_upgrade_from_empty_downgrade_to_base_and_upgrade_again(
    engine: Engine, db_url: str
) -> None:
    head = migrate.head_revision()
    assert tables_of(engine) == set()
    assert revision_of(engine) is None

    migrate.upgrade(engine)
    assert revision_of(engine) == head
    assert tables_of(engine) == OWN_TABLES | {"alembic_version"}
    assert migrate.check(engine) == head

    views_at_head = views_of(engine)
    migrate.downgrade(engine, "base")
    assert revision_of(engine) is None
    assert tables_of(engine) & OWN_TABLES == set(), "downgrade to base must drop every table"
    assert views_of(engine) == set(), "downgrade to base must drop every view"
    with pytest.raises(SchemaMismatchError, match="rolloutlog db upgrade"):
        migrate.check(engine)

    migrate.upgrade(engine)
    assert revision_of(engine) == head
    assert tables_of(engine) == OWN_TABLES | {"alembic_version"}
    assert views_of(engine) == views_at_head
    # The re-created schema works end to end.
    with EventStore.open(db_url, create=False) as store:
        store.create_run("r")
        now = datetime.now(UTC)
        store.append("r", [NewEvent("T", 1, '{"a": 1}', now)], expected_seq=1, epoch=1)
        assert [e.payload for e in store.read("r")] == ['{"a": 1}']


def _compiled_columns(conn: Connection, table: str) -> dict[str, tuple[str, bool]]:
    dialect = conn.dialect
    return {
        c["name"]: (str(c["type"].compile(dialect=dialect)), bool(c["nullable"]))
        for c in sa.inspect(conn).get_columns(table)
    }


def _reflected_indexes(conn: Connection, table: str) -> dict[str, tuple[tuple[str, ...], bool]]:
    return {
        str(ix["name"]): (tuple(str(c) for c in ix["column_names"]), bool(ix["unique"]))
        for ix in sa.inspect(conn).get_indexes(table)
    }


def _diff(conn: Connection, md: sa.MetaData) -> list[Any]:
    ctx = MigrationContext.configure(
        conn, opts={"compare_type": True, "compare_server_default": True}
    )
    return list(compare_metadata(ctx, md))


def test_schema_tables_agree_with_migrations(engine: Engine) -> None:
    migrate.upgrade(engine)
    with engine.connect() as conn:
        # alembic's own comparison: tables, columns, types, nullability, defaults, indexes.
        assert _diff(conn, metadata) == []
        # What alembic does not compare: primary-key names and columns. And, to be strict
        # about types on every dialect, the DDL each column type compiles to (on SQLite a
        # DateTime(timezone=True) compiles to DATETIME either way, which is correct).
        inspector = sa.inspect(conn)
        assert set(inspector.get_table_names()) - {"alembic_version"} == OWN_TABLES
        for name, table in metadata.tables.items():
            want_cols = {
                c.name: (str(c.type.compile(dialect=conn.dialect)), bool(c.nullable))
                for c in table.columns
            }
            assert _compiled_columns(conn, name) == want_cols, name
            pk = inspector.get_pk_constraint(name)
            assert pk["name"] == table.primary_key.name, name
            assert pk["constrained_columns"] == [c.name for c in table.primary_key.columns]
            want_ix = {
                str(ix.name): (tuple(c.name for c in ix.columns), bool(ix.unique))
                for ix in table.indexes
            }
            assert _reflected_indexes(conn, name) == want_ix, name


def _mutated(kind: str) -> sa.MetaData:
    md = sa.MetaData(naming_convention=dict(metadata.naming_convention))
    for table in metadata.sorted_tables:
        table.to_metadata(md)
    events = md.tables["events"]
    index = md.tables["rollout_index"]
    if kind == "bigint_to_int":
        events.c.seq.type = sa.Integer()
    elif kind == "string_length":
        events.c.type.type = sa.String(32)
    elif kind == "nullable":
        index.c.train_step.nullable = False
    elif kind == "missing_index":
        index.indexes.discard(next(ix for ix in index.indexes if ix.name))
    elif kind == "blob_to_text":
        md.tables["payloads"].c.data.type = sa.Text()
    elif kind == "extra_column":
        sa.Table("runs", md, sa.Column("extra", sa.Integer), extend_existing=True)
    return md


@pytest.mark.parametrize(
    "kind",
    ["bigint_to_int", "string_length", "nullable", "missing_index", "blob_to_text", "extra_column"],
)
def test_schema_comparison_is_not_vacuous(engine: Engine, kind: str) -> None:
    """The comparison above would catch a drift of each kind on this dialect."""
    migrate.upgrade(engine)
    with engine.connect() as conn:
        assert _diff(conn, _mutated(kind)) != []


def test_open_creates_schema_on_empty_database_only_when_asked(db_url: str) -> None:
    with pytest.raises(SchemaMismatchError, match="rolloutlog db upgrade"):
        EventStore.open(db_url, create=False)
    with EventStore.open(db_url) as store, store.engine.connect() as conn:
        assert migrate.current_revision(conn) == migrate.head_revision()


def test_open_refuses_older_revision_and_names_the_upgrade_command(
    engine: Engine, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped_head = migrate.head_revision()
    migrate.upgrade(engine)
    # A newer rolloutlog (head one revision further) meets this database.
    next_dir = make_next_revision_dir(tmp_path)
    monkeypatch.setattr(schema_head, "migrations_dir", lambda: next_dir)
    assert migrate.head_revision() == FUTURE_REVISION
    for kwargs in ({}, {"create": False}, {"readonly": True, "create": False}):
        with pytest.raises(SchemaMismatchError) as err:
            EventStore.open(db_url, **kwargs)
        msg = str(err.value)
        assert "rolloutlog db upgrade" in msg, kwargs
        assert repr(shipped_head) in msg and repr(FUTURE_REVISION) in msg
    assert revision_of(engine) == shipped_head, "a refused open must not migrate"
    # After the upgrade the newer code opens it.
    migrate.upgrade(engine)
    assert revision_of(engine) == FUTURE_REVISION
    assert "test_next" in tables_of(engine)
    EventStore.open(db_url).close()
    # And the extra revision downgrades cleanly back to the shipped head.
    migrate.downgrade(engine, shipped_head)
    assert "test_next" not in tables_of(engine)


def test_open_refuses_unknown_newer_revision(engine: Engine, db_url: str) -> None:
    migrate.upgrade(engine)
    set_revision(engine, "zzzz_unknown")
    for kwargs in ({}, {"create": False}):
        with pytest.raises(SchemaMismatchError, match="newer rolloutlog") as err:
            EventStore.open(db_url, **kwargs)
        assert "zzzz_unknown" in str(err.value)


def test_open_refuses_foreign_tables_without_revision(engine: Engine, db_url: str) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE runs (x INTEGER)")
    with pytest.raises(SchemaMismatchError, match="not created by rolloutlog"):
        EventStore.open(db_url)
    assert revision_of(engine) is None


# ---------------------------------------------------------------- upgrade from 0003
_LEGACY_COLS = "run_id, seq, epoch, type, schema_version, recorded_at, train_step, " \
    "weight_version, group_id, prompt_index, target_step, payload"  # fmt: skip


def test_upgrade_from_0003_moves_the_audit_keys_into_the_rollout_index(
    engine: Engine, db_url: str
) -> None:
    """A database written at revision 0003 (audit keys in events columns) upgrades to head:
    the keys are backfilled into rollout_index, the columns and their indexes are gone, the
    views read the keys from the index, and the controller's lookups find them."""
    from rolloutlog.controller.rollout_index import read_where

    migrate.upgrade(engine, "0003_compactions")
    now = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    legacy = [
        # seq, type, train_step, weight_version, group_id, prompt_index, target_step
        (1, "RunStarted", 0, 0, None, None, None),
        (2, "GroupAdmitted", 0, 0, 7, 70, 1),
        (3, "SiblingDispatched", 0, 0, 7, None, None),
        (4, "GroupSelected", 1, 1, 7, 70, 1),
        (5, "Foreign", None, None, None, None, None),  # no keys at all: no index row
    ]
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO runs (run_id, created_at, config_fingerprint, config_json, "
                "current_epoch, last_seq) VALUES ('r', :t, '', '{}', 1, 5)"
            ),
            {"t": now},
        )
        conn.execute(
            sa.text(
                "INSERT INTO epochs (run_id, epoch, opened_at, resume_seq, first_seq) "
                "VALUES ('r', 1, :t, 0, 1)"
            ),
            {"t": now},
        )
        for seq, typ, step, wv, gid, pidx, tstep in legacy:
            conn.execute(
                sa.text(
                    f"INSERT INTO events ({_LEGACY_COLS}) VALUES ('r', :seq, 1, :typ, 1, :t, "
                    ":step, :wv, :gid, :pidx, :tstep, :payload)"
                ),
                {
                    "seq": seq,
                    "typ": typ,
                    "t": now,
                    "step": step,
                    "wv": wv,
                    "gid": gid,
                    "pidx": pidx,
                    "tstep": tstep,
                    "payload": f'{{"seq": {seq}, "train_step": {step or 0}}}',
                },
            )
    assert "history_events" in views_of(engine)

    migrate.upgrade(engine)
    assert revision_of(engine) == migrate.head_revision()
    with engine.connect() as conn:
        cols = {c["name"] for c in sa.inspect(conn).get_columns("events")}
        assert cols == {c.name for c in store_metadata.tables["events"].columns}
        assert _reflected_indexes(conn, "events") == {}
        index_rows = conn.execute(
            sa.text(
                "SELECT seq, type, train_step, weight_version, group_id, prompt_index, "
                "target_step FROM rollout_index WHERE run_id = 'r' ORDER BY seq"
            )
        ).all()
        # The sibling event's keys moved on to the sibling index and a step mark (0011).
        assert [tuple(r) for r in index_rows] == [row for row in legacy if row[0] not in (3, 5)]
        assert conn.execute(sa.text("SELECT seq, group_id FROM rollout_sibling_index")).all() == [
            (3, 7)
        ]
        assert conn.execute(
            sa.text("SELECT seq, train_step, weight_version FROM rollout_step_marks")
        ).all() == [(3, 0, 0)]
        viewed = conn.execute(
            sa.text(
                "SELECT seq, type, train_step, weight_version, group_id, prompt_index, "
                "target_step FROM history_events WHERE run_id = 'r' ORDER BY seq"
            )
        ).all()
        assert [tuple(r) for r in viewed] == legacy
        batch = conn.execute(
            sa.text("SELECT group_id, prompt_index FROM step_batches WHERE run_id = 'r'")
        ).all()
        assert [tuple(r) for r in batch] == [(7, 70)]
    with EventStore.open(db_url, create=False) as store:
        assert next(e.payload for e in store.read("r")) == '{"seq": 1, "train_step": 0}'
        got = read_where(store, "r", group_id=7)
        assert [(e.seq, e.train_step, e.prompt_index) for e in got] == [
            (2, 0, 70),
            (3, 0, None),
            (4, 1, 70),
        ]

    # And back: the keys return to the events columns and the legacy views work again.
    migrate.downgrade(engine, "0003_compactions")
    with engine.connect() as conn:
        assert "rollout_index" not in tables_of(engine)
        back = conn.execute(
            sa.text(
                "SELECT seq, type, train_step, weight_version, group_id, prompt_index, "
                "target_step FROM history_events WHERE run_id = 'r' ORDER BY seq"
            )
        ).all()
        assert [tuple(r) for r in back] == legacy


# ---------------------------------------------------------------- 0010, 0011 and back
_KEY_COLS = "seq, type, train_step, weight_version, group_id, prompt_index, target_step"


def _viewed(conn: Connection) -> list[tuple[Any, ...]]:
    """What the audit view reads of every event's keys, in (run, seq) order."""
    rows = conn.execute(
        sa.text(f"SELECT run_id, {_KEY_COLS} FROM history_events ORDER BY run_id, seq")
    ).all()
    return [tuple(r) for r in rows]


def _rollout_index_rows(conn: Connection) -> list[tuple[Any, ...]]:
    rows = conn.execute(
        sa.text(f"SELECT run_id, {_KEY_COLS} FROM rollout_index ORDER BY run_id, seq")
    ).all()
    return [tuple(r) for r in rows]


def test_0010_and_0011_and_back(engine: Engine, db_url: str) -> None:
    """Revisions 0010 (no train-step index) and 0011 (the sibling index and step marks)
    keep every event's keys, as the audit view and read_where read them, down and up
    again; the rows 0011 moves are exactly the sibling events', and its backfill marks
    the last sibling event of each run of equal steps."""
    from rolloutlog.controller.rollout_index import read_where

    migrate.upgrade(engine, "0010_no_train_step_index")
    now = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    # (type, (group, prompt, target, train_step, weight_version)) per event, two runs.
    keyed = [
        ("GroupAdmitted", (7, 70, 1, 0, 0)),
        ("SiblingDispatched", (7, None, None, 0, 0)),
        ("SiblingCompleted", (7, None, None, 0, 0)),
        ("GroupSelected", (7, 70, 1, 1, 1)),
        ("StepTrained", (None, None, None, 1, 1)),
        ("SiblingDispatched", (8, None, None, 1, 1)),
        ("SiblingAborted", (8, None, None, 1, 2)),
        ("SiblingDispatched", (8, None, None, 2, 2)),
        ("Foreign", None),  # no keys: no row anywhere
    ]
    with EventStore.open(db_url, create=False, check_schema=False) as store:
        for run in ("a", "b"):
            store.create_run(run)
            rows = [NewEvent(t, 1, f'{{"i": {i}}}', now, None) for i, (t, _) in enumerate(keyed)]
            store.append(run, rows, expected_seq=1, epoch=1)
    with engine.begin() as conn:  # the 0010 indexer's rows: one per keyed event
        for run in ("a", "b"):
            for seq, (typ, d) in enumerate(keyed, 1):
                if d is not None:
                    conn.execute(
                        sa.text(
                            "INSERT INTO rollout_index VALUES (:r, :s, :t, :g, :p, :ts, :st, :wv)"
                        ),
                        dict(r=run, s=seq, t=typ, g=d[0], p=d[1], ts=d[2], st=d[3], wv=d[4]),
                    )
    with engine.connect() as conn:
        at_0010 = _viewed(conn)
        assert len(_rollout_index_rows(conn)) == 16
    assert [r[1:] for r in at_0010[:9]] == [
        (i, t, *(d[3:] + d[:3] if d else (None,) * 5)) for i, (t, d) in enumerate(keyed, 1)
    ]

    migrate.upgrade(engine)
    with engine.connect() as conn:
        assert _viewed(conn) == at_0010
        assert {r[2] for r in _rollout_index_rows(conn)} == {
            "GroupAdmitted",
            "GroupSelected",
            "StepTrained",
        }
        siblings = conn.execute(
            sa.text("SELECT run_id, seq, group_id FROM rollout_sibling_index ORDER BY 1, 2")
        ).all()
        assert [tuple(r) for r in siblings if r[0] == "a"] == [
            ("a", 2, 7), ("a", 3, 7), ("a", 6, 8), ("a", 7, 8), ("a", 8, 8),
        ]  # fmt: skip
        marks = conn.execute(
            sa.text("SELECT run_id, seq, train_step, weight_version FROM rollout_step_marks")
        ).all()
        assert sorted(tuple(r) for r in marks if r[0] == "a") == [
            ("a", 3, 0, 0), ("a", 6, 1, 1), ("a", 7, 1, 2), ("a", 8, 2, 2),
        ]  # fmt: skip
        assert _diff(conn, metadata) == []
    with EventStore.open(db_url, create=False) as store:
        step_1 = [(e.seq, e.type) for e in read_where(store, "a", train_step=1)]
        group_8 = [
            (e.seq, e.train_step, e.weight_version) for e in read_where(store, "b", group_id=8)
        ]
    assert step_1 == [(4, "GroupSelected"), (5, "StepTrained"), (6, "SiblingDispatched"),
                      (7, "SiblingAborted")]  # fmt: skip
    assert group_8 == [(6, 1, 1), (7, 1, 2), (8, 2, 2)]

    migrate.downgrade(engine, "0010_no_train_step_index")
    with engine.connect() as conn:
        assert _viewed(conn) == at_0010
        assert len(_rollout_index_rows(conn)) == 16
        assert "rollout_sibling_index" not in tables_of(engine)
    migrate.downgrade(engine, "0009_partial_key_indexes")
    with engine.connect() as conn:
        assert _viewed(conn) == at_0010
        assert "ix_rollout_index_run_train_step" in _reflected_indexes(conn, "rollout_index")

    migrate.upgrade(engine)
    with engine.connect() as conn:
        assert _viewed(conn) == at_0010
        assert "ix_rollout_index_run_train_step" not in _reflected_indexes(conn, "rollout_index")
        assert _diff(conn, metadata) == []
    with EventStore.open(db_url, create=False) as store:
        assert [(e.seq, e.type) for e in read_where(store, "a", train_step=1)] == step_1

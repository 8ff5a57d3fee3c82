"""Contract for bad input: every failure is a StoreError subclass with a clear message."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from storetest_helpers import make_batch, skip_if_memory, worker_cmd

from rolloutlog.eventstore import (
    CorruptLogError,
    EventStore,
    NewEvent,
    PayloadNotFoundError,
    PayloadPut,
    ReadOnlyStoreError,
    RunExistsError,
    SchemaMismatchError,
    StoreError,
    StoreUnavailableError,
    StoreUrlError,
    migrate,
    normalise_url,
)
from rolloutlog.eventstore.migrate import migrations_dir

# ---------------------------------------------------------------- URLs


@pytest.mark.parametrize(
    "url",
    [
        "",
        "not a url",
        "://nothing",
        "sqlite:/relative-with-one-slash?",
    ],
)
def test_malformed_url(url: str) -> None:
    with pytest.raises(StoreUrlError, match=r"malformed database URL|names no file") as info:
        EventStore.open(url)
    assert isinstance(info.value, ValueError)  # also a ValueError, for generic callers


@pytest.mark.parametrize(
    "url",
    ["mysql://user@localhost/db", "oracle://u:p@h/x", "mssql+pyodbc://h/db", "duckdb:///x.db"],
)
def test_unsupported_dialect(url: str) -> None:
    with pytest.raises(StoreUrlError, match="unsupported database") as info:
        EventStore.open(url)
    assert "sqlite:///PATH" in str(info.value)


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "sqlite+pysqlite:///:memory:"])
def test_sqlite_in_memory_is_refused(url: str) -> None:
    with pytest.raises(StoreUrlError, match="names no file"):
        EventStore.open(url)


def test_bad_sqlite_options(tmp_path: Path) -> None:
    with pytest.raises(StoreUrlError, match="synchronous"):
        EventStore.open(f"sqlite:///{tmp_path / 'a.db'}?synchronous=SOMETIMES")
    with pytest.raises(StoreUrlError, match="unknown SQLite URL options"):
        EventStore.open(f"sqlite:///{tmp_path / 'a.db'}?journal=delete")
    # A timeout that is no whole number of milliseconds is named (it was a bare ValueError).
    for bad in ("1.5", "soon", "-1"):
        with pytest.raises(StoreUrlError, match=f"busy_timeout_ms='{bad}'"):
            EventStore.open(f"sqlite:///{tmp_path / 'a.db'}?busy_timeout_ms={bad}")
    assert not (tmp_path / "a.db").exists()


def test_sqlite_options_are_accepted(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}?synchronous=normal&busy_timeout_ms=500"
    with EventStore.open(url) as store:
        store.create_run("r1")
        store.append("r1", make_batch(1, 2), expected_seq=1, epoch=1)
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar_one() == 1  # NORMAL
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar_one() == "wal"
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar_one() == 500
        assert store.last_seq("r1") == 2


def test_postgres_urls_default_to_psycopg3() -> None:
    for url in ("postgresql://u@h/db", "postgresql+psycopg2://u@h/db", "postgres://u@h/db"):
        try:
            parsed = normalise_url(url)
        except StoreUrlError:
            assert url.startswith("postgres://")  # SQLAlchemy's spelling is postgresql://
            continue
        assert parsed.get_backend_name() == "postgresql"
        assert parsed.get_driver_name() == "psycopg"


# ---------------------------------------------------------------- unreachable databases


def test_sqlite_in_a_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "dir"
    with pytest.raises(StoreUnavailableError, match="does not exist") as info:
        EventStore.open(f"sqlite:///{missing / 'log.db'}")
    assert str(missing) in str(info.value)
    assert not missing.exists()


def test_readonly_open_of_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(StoreUnavailableError, match="does not exist"):
        EventStore.open(f"sqlite:///{tmp_path / 'absent.db'}", readonly=True)
    assert not (tmp_path / "absent.db").exists()


def test_postgres_port_with_nothing_listening() -> None:
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError) as info:
        EventStore.open("postgresql+psycopg://postgres@127.0.0.1:1/test")
    assert time.monotonic() - started < 15
    msg = str(info.value)
    assert "cannot reach" in msg and "127.0.0.1" in msg and "1/test" in msg
    assert "opening the database" in msg


@pytest.mark.postgres
def test_postgres_missing_database(pg_server_url: str) -> None:
    url = sa.engine.make_url(pg_server_url).set(database="rolloutlog_no_such_db")
    with pytest.raises(StoreUnavailableError, match="rolloutlog_no_such_db"):
        EventStore.open(url.render_as_string(hide_password=False))


@pytest.mark.parametrize(
    "content",
    [
        b"this is not a database, it is a text file\n" * 100,
        b"SQLite format 3\x00" + b"\xff" * 84,  # a header, then garbage
        b"\x00" * 5000,
    ],
)
def test_garbage_sqlite_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "garbage.db"
    path.write_bytes(content)
    with pytest.raises(StoreUnavailableError, match="not a valid SQLite database"):
        EventStore.open(f"sqlite:///{path}")
    assert path.read_bytes() == content  # never "repaired" by overwriting


def test_truncated_sqlite_file(tmp_path: Path) -> None:
    good = tmp_path / "good.db"
    with EventStore.open(f"sqlite:///{good}") as store:
        store.create_run("r1")
        for i in range(20):
            store.append("r1", make_batch(1 + 50 * i, 50), expected_seq=1 + 50 * i, epoch=1)
    data = good.read_bytes()
    assert len(data) > 8192
    assert not Path(f"{good}-wal").exists()  # the clean close checkpointed everything
    for cut in (60, 1000, len(data) // 3, len(data) // 2):
        bad = tmp_path / f"cut{cut}.db"
        bad.write_bytes(data[:cut])
        with pytest.raises(StoreUnavailableError, match="not a valid SQLite database"):
            EventStore.open(f"sqlite:///{bad}")


# ---------------------------------------------------------------- read-only


def _make_readonly_db(directory: Path) -> Path:
    path = directory / "ro.db"
    with EventStore.open(f"sqlite:///{path}") as store:
        store.create_run("r1")
        store.append("r1", make_batch(1, 3), expected_seq=1, epoch=1)
    os.chmod(path, 0o444)
    return path


def test_readonly_sqlite_file(tmp_path: Path) -> None:
    """chmod 0444 makes the store refuse writes, and readonly=True still reads it.

    Root ignores file modes (os.access says writable), so under root the check runs in a
    child process that drops to uid 65534 (nobody) after loading its modules.
    """
    if os.access(tmp_path, os.W_OK) and os.geteuid() != 0:
        path = _make_readonly_db(tmp_path)
        with pytest.raises(ReadOnlyStoreError, match="read-only") as info:
            EventStore.open(f"sqlite:///{path}")
        assert "readonly=True" in str(info.value)
        with EventStore.open(f"sqlite:///{path}", readonly=True) as store:
            assert store.last_seq("r1") == 3
            assert [e.seq for e in store.read("r1")] == [1, 2, 3]
            with pytest.raises(ReadOnlyStoreError):
                store.append("r1", make_batch(4, 1), expected_seq=4, epoch=1)
        return
    if not hasattr(os, "setuid"):
        pytest.skip("running as root on a platform without setuid: cannot drop privileges")
    # A folder nobody can reach (and write: SQLite creates the -shm file for WAL reads).
    folder = Path(tempfile.mkdtemp(prefix="rolloutlog-ro-"))
    try:
        os.chmod(folder, 0o777)
        path = _make_readonly_db(folder)
        # What nobody reads after dropping privileges (alembic's migrations, on every
        # open) is copied to a readable place: the checkout may sit in a 0700 folder.
        shared = folder / "shared"
        shutil.copytree(
            migrations_dir(), shared / "migrations", ignore=shutil.ignore_patterns("__pycache__")
        )
        import rolloutlog.controller.index_migrations as index_migrations

        shutil.copytree(
            Path(index_migrations.__file__).parent,
            shared / "index_migrations",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        for p in [shared, *shared.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        res = subprocess.run(
            worker_cmd("readonly-as-nobody", str(path), "r1", str(shared)),
            capture_output=True,
            text=True,
            cwd=shared,
            timeout=120,
        )
        if res.returncode != 0 and "Operation not permitted" in res.stderr:
            pytest.skip("running as root without CAP_SETUID: cannot test file modes")
        assert res.returncode == 0, res.stderr[-3000:]
        out = json.loads(res.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert out["writable"] is False
    kind, msg = out["open_rw"]
    assert kind == "ReadOnlyStoreError"
    assert "read-only" in msg and "readonly=True" in msg
    assert out["last_seq"] == 3
    assert out["payloads"] == [e.payload for e in make_batch(1, 3)]
    kind, msg = out["append"]
    assert kind == "ReadOnlyStoreError" and "appending" in msg


def test_readonly_connection_reads_but_refuses_writes(db_url: str, open_store) -> None:
    writer = open_store(db_url)
    writer.create_run("r1")
    writer.append("r1", make_batch(1, 4), expected_seq=1, epoch=1)
    writer.put_payload("r1", "p", "tokens", b"abc")
    writer.save_snapshot("r1", 2, 1, b"snap")
    ro = open_store(db_url, readonly=True)
    assert ro.readonly
    assert ro.last_seq("r1") == 4
    assert [e.payload for e in ro.read("r1")] == [e.payload for e in make_batch(1, 4)]
    assert ro.get_payload("r1", "p") == b"abc"
    snap = ro.load_snapshot("r1")
    assert snap is not None and snap.data == b"snap"
    assert [r.run_id for r in ro.list_runs()] == ["r1"]
    refused = [
        lambda: ro.append("r1", make_batch(5, 1), expected_seq=5, epoch=1),
        lambda: ro.create_run("r2"),
        lambda: ro.open_epoch("r1"),
        lambda: ro.put_payload("r1", "q", "tokens", b"x"),
        lambda: ro.save_snapshot("r1", 3, 1, b"x"),
    ]
    for attempt in refused:
        with pytest.raises(ReadOnlyStoreError, match="read-only"):
            attempt()
    assert writer.last_seq("r1") == 4
    assert writer.get_run("r1").current_epoch == 1
    assert [r.run_id for r in writer.list_runs()] == ["r1"]
    # The writer is unaffected and the reader sees its new events.
    writer.append("r1", make_batch(5, 1), expected_seq=5, epoch=1)
    assert ro.last_seq("r1") == 5


# ---------------------------------------------------------------- schema version


def test_database_at_an_unknown_newer_revision(db_url: str, open_store, raw_sql) -> None:
    # A process that knows every schema branch (here: the rollout index's, registered on
    # import) can tell a newer revision from a branch's. A store-only process accepts an
    # unknown revision when its own tables are current (tests/test_schema_branches.py):
    # without this import the outcome depended on what the worker had imported before.
    import rolloutlog.controller.rollout_index  # noqa: F401

    store = open_store(db_url)
    store.create_run("r1")
    store.close()
    head = migrate.head_revision()
    assert raw_sql("SELECT version_num FROM alembic_version") == [(head,)]
    raw_sql("UPDATE alembic_version SET version_num = '9999_from_the_future'")
    for kw in ({}, {"create": False}, {"readonly": True}):
        with pytest.raises(SchemaMismatchError) as info:
            EventStore.open(db_url, **kw)
        msg = str(info.value)
        assert "9999_from_the_future" in msg and head in msg
        assert "newer rolloutlog" in msg
    # Opening did not touch the stamp or the data.
    assert raw_sql("SELECT version_num FROM alembic_version") == [("9999_from_the_future",)]
    assert raw_sql("SELECT run_id FROM runs") == [("r1",)]
    # check_schema=False is the escape hatch (e.g. for `rolloutlog db` commands).
    assert open_store(db_url, check_schema=False).last_seq("r1") == 0


def test_database_without_the_schema(db_url: str) -> None:
    skip_if_memory(db_url, "opens the database by URL")
    with pytest.raises(SchemaMismatchError, match="rolloutlog db upgrade"):
        EventStore.open(db_url, create=False)


def test_database_at_an_older_revision(db_url: str, open_store) -> None:
    skip_if_memory(db_url, "schema migrations")
    store = open_store(db_url)
    migrate.downgrade(store.engine, "base")
    store.close()
    # No revision and no tables: create=False refuses and names the fix.
    with pytest.raises(SchemaMismatchError, match="rolloutlog db upgrade"):
        EventStore.open(db_url, create=False)
    # The default (create=True) upgrades an empty database to head.
    again = open_store(db_url)
    again.create_run("r1")
    assert again.last_seq("r1") == 0


def test_foreign_tables_without_alembic_stamp(db_url: str, open_store, raw_sql) -> None:
    store = open_store(db_url)
    store.close()
    raw_sql("DELETE FROM alembic_version")
    with pytest.raises(SchemaMismatchError, match="no alembic revision"):
        EventStore.open(db_url)


def test_errors_share_one_hierarchy() -> None:
    for cls in (StoreUrlError, StoreUnavailableError, ReadOnlyStoreError, SchemaMismatchError):
        assert issubclass(cls, StoreError)


# ---------------------------------------------------------------- bad values and foreign rows


def test_constraint_violations_are_store_errors(store: EventStore) -> None:
    """A NOT NULL violation surfaces as a StoreError naming the operation, not a driver error."""
    store.create_run("r1")
    store.append("r1", make_batch(1, 2), expected_seq=1, epoch=1)
    bad = make_batch(3, 2)
    bad[1] = NewEvent("T", 1, None, bad[0].recorded_at)  # type: ignore[arg-type]
    with pytest.raises(StoreError, match="appending to run 'r1'") as info:
        store.append("r1", bad, expected_seq=3, epoch=1)
    assert not isinstance(info.value, RunExistsError)
    if store.dialect != "memory":  # the memory store has no driver to name
        assert not isinstance(info.value.__cause__, StoreError)  # the driver error is the cause
    assert store.last_seq("r1") == 2
    assert [e.seq for e in store.read("r1")] == [1, 2]
    with pytest.raises(StoreError, match="storing payload"):
        store.put_payload("r1", "p", None, b"x")  # type: ignore[arg-type]
    with pytest.raises(StoreError, match="saving a snapshot"):
        store.save_snapshot("r1", 1, 1, None)  # type: ignore[arg-type]
    assert store.load_snapshot("r1") is None


def test_foreign_row_past_the_end_makes_append_fail_cleanly(store, raw_sql) -> None:
    """A row some other program wrote at last_seq + 1 (without moving last_seq) is not
    overwritten: the append fails as a StoreError and writes nothing."""
    store.create_run("r1")
    store.append("r1", make_batch(1, 2), expected_seq=1, epoch=1)
    ts = make_batch(1, 1)[0].recorded_at
    raw_sql(
        "INSERT INTO events (run_id, seq, epoch, type, schema_version, recorded_at, payload) "
        "VALUES ('r1', 3, 1, 'Foreign', 1, :ts, '{}')",
        {"ts": ts.strftime("%Y-%m-%d %H:%M:%S.%f") if store.dialect == "sqlite" else ts},
    )
    with pytest.raises(StoreError, match="appending to run 'r1'"):
        store.append(
            "r1",
            make_batch(3, 2),
            expected_seq=3,
            epoch=1,
            payload_puts=[PayloadPut("p", "k", b"")],
        )
    assert store.last_seq("r1") == 2
    # The foreign row is beyond runs.last_seq: reading reports it as corruption (issue 9).
    with pytest.raises(CorruptLogError, match="offset 3: extra row"):
        list(store.read("r1"))
    with pytest.raises(PayloadNotFoundError):
        store.get_payload("r1", "p")

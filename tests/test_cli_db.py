"""``rolloutlog db upgrade|check|downgrade`` on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result

from rolloutlog.cli import main
from rolloutlog.eventstore import EventStore, migrate, schema_head
from rolloutlog.eventstore.schema import metadata

UNREACHABLE_PG = "postgresql+psycopg://postgres@127.0.0.1:1/nothing"
NEXT_REVISION = "ffff_cli_next"


def cli(*args: str, input: str | None = None) -> Result:
    """Run ``rolloutlog ARGS`` in-process."""
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)


def tables(url: str) -> set[str]:
    """Table names in the database at ``url``."""
    store = EventStore.open(url, check_schema=False)
    try:
        with store.engine.connect() as conn:
            return set(sa.inspect(conn).get_table_names())
    finally:
        store.close()


def set_revision(url: str, revision: str) -> None:
    """Overwrite the stored alembic revision."""
    store = EventStore.open(url, check_schema=False)
    try:
        with store.engine.begin() as conn:
            conn.execute(sa.text("UPDATE alembic_version SET version_num = :r"), {"r": revision})
    finally:
        store.close()


def rolloutlog_exe() -> str:
    """The installed ``rolloutlog`` console script next to this interpreter."""
    exe = Path(sys.executable).parent / "rolloutlog"
    if exe.exists():
        return str(exe)
    found = shutil.which("rolloutlog")
    assert found, "the rolloutlog console script is not installed (pip install -e .)"
    return found


@pytest.mark.parametrize(
    "args", [[], ["db"], ["db", "upgrade"], ["db", "check"], ["db", "downgrade"]]
)
def test_every_command_has_help(args: list[str]) -> None:
    result = cli(*args, "--help")
    assert result.exit_code == 0
    assert "Usage:" in result.output
    assert "--help" in result.output


def test_check_empty_then_upgrade_then_check(db_url: str) -> None:
    head = migrate.head_revision()
    result = cli("db", "check", db_url)
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ")
    assert "no rolloutlog schema" in result.stderr
    assert "rolloutlog db upgrade" in result.stderr

    result = cli("db", "upgrade", db_url)
    assert result.exit_code == 0, result.output
    assert head in result.stdout
    assert tables(db_url) >= set(metadata.tables)

    result = cli("db", "check", db_url)
    assert result.exit_code == 0, result.output
    assert head in result.stdout
    assert result.stderr == ""


def test_json_output(db_url: str) -> None:
    head = migrate.head_revision()
    result = cli("db", "check", db_url, "--json")
    assert result.exit_code == 1
    out = json.loads(result.stdout)
    assert out["ok"] is False and out["revision"] is None and out["head"] == head
    assert "rolloutlog db upgrade" in out["error"]

    first = json.loads(cli("db", "upgrade", db_url, "--json").stdout)
    assert first == {**first, "ok": True, "previous": None, "revision": head, "head": head}
    again = cli("db", "upgrade", db_url, "--json")
    assert again.exit_code == 0
    assert json.loads(again.stdout)["previous"] == head

    result = cli("db", "check", "--json", db_url)
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {
        "head": head,
        "ok": True,
        "revision": head,
        "url": json.loads(result.stdout)["url"],
    }


def test_check_and_upgrade_refuse_unknown_newer_revision(db_url: str) -> None:
    assert cli("db", "upgrade", db_url).exit_code == 0
    set_revision(db_url, "zzzz_from_a_newer_release")
    for command in ("check", "upgrade"):
        result = cli("db", command, db_url)
        assert result.exit_code == 1, command
        assert "zzzz_from_a_newer_release" in result.stderr
        assert "newer rolloutlog" in result.stderr


def test_check_older_revision_names_upgrade_and_upgrade_fixes_it(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped = migrate.head_revision()
    assert cli("db", "upgrade", db_url).exit_code == 0
    # A newer rolloutlog whose head is one revision past the shipped one.
    target = tmp_path / "migrations_next"
    shutil.copytree(migrate.migrations_dir(), target, ignore=shutil.ignore_patterns("__pycache__"))
    (target / "versions" / f"{NEXT_REVISION}.py").write_text(
        f'revision = "{NEXT_REVISION}"\ndown_revision = "{shipped}"\n'
        "branch_labels = None\ndepends_on = None\n\n\n"
        "def upgrade() -> None:\n    pass\n\n\ndef downgrade() -> None:\n    pass\n"
    )
    monkeypatch.setattr(schema_head, "migrations_dir", lambda: target)

    result = cli("db", "check", db_url)
    assert result.exit_code == 1
    assert "rolloutlog db upgrade" in result.stderr
    assert shipped in result.stderr and NEXT_REVISION in result.stderr

    result = cli("db", "upgrade", db_url, "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert (out["previous"], out["revision"]) == (shipped, NEXT_REVISION)
    assert cli("db", "check", db_url).exit_code == 0

    result = cli("db", "downgrade", db_url, shipped, "--yes", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["revision"] == shipped


def test_downgrade_to_base_drops_everything(db_url: str) -> None:
    assert cli("db", "upgrade", db_url).exit_code == 0
    # Without --yes the command asks; answering no changes nothing.
    result = cli("db", "downgrade", db_url, "base", input="n\n")
    assert result.exit_code == 2
    assert "cancelled" in result.stderr
    assert tables(db_url) >= set(metadata.tables)

    result = cli("db", "downgrade", db_url, "base", "--yes")
    assert result.exit_code == 0, result.output
    assert tables(db_url) & set(metadata.tables) == set()
    assert cli("db", "check", db_url).exit_code == 1
    # Nothing left to downgrade.
    assert cli("db", "downgrade", db_url, "base", "--yes").exit_code == 1
    # And back up.
    assert cli("db", "upgrade", db_url).exit_code == 0
    assert cli("db", "check", db_url).exit_code == 0


def test_downgrade_to_unknown_revision_is_an_error(db_url: str) -> None:
    assert cli("db", "upgrade", db_url).exit_code == 0
    result = cli("db", "downgrade", db_url, "no_such_revision", "--yes")
    assert result.exit_code == 2
    assert "no_such_revision" in result.stderr
    assert cli("db", "check", db_url).exit_code == 0


def test_upgrade_refuses_foreign_tables(db_url: str) -> None:
    store = EventStore.open(db_url, check_schema=False)
    with store.engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE events (x INTEGER)")
    store.close()
    result = cli("db", "upgrade", db_url)
    assert result.exit_code == 1
    assert "not created by rolloutlog" in result.stderr
    assert "runs" not in tables(db_url), "a refused upgrade must not create tables"


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        (UNREACHABLE_PG, "cannot reach"),
        ("not a url", "malformed database URL"),
        ("mysql://u@h/db", "unsupported database"),
        ("sqlite:////no/such/directory/log.db", "does not exist"),
    ],
)
@pytest.mark.parametrize("command", ["check", "upgrade"])
def test_unusable_url_exits_2_with_error(command: str, url: str, needle: str) -> None:
    result = cli("db", command, url)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ")
    assert needle in result.stderr
    assert "Traceback" not in result.output


def test_check_does_not_create_a_missing_sqlite_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.db"
    result = cli("db", "check", f"sqlite:///{path}")
    assert result.exit_code == 1
    assert "rolloutlog db upgrade" in result.stderr
    assert not path.exists()


def test_real_process_exit_codes(db_url: str) -> None:
    exe = rolloutlog_exe()

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [exe, "db", *args], capture_output=True, text=True, timeout=120, check=False
        )

    empty = run("check", db_url)
    assert empty.returncode == 1, empty.stderr
    assert "error: " in empty.stderr and "rolloutlog db upgrade" in empty.stderr
    upgraded = run("upgrade", db_url)
    assert upgraded.returncode == 0, upgraded.stderr
    ok = run("check", db_url)
    assert ok.returncode == 0, ok.stderr
    assert migrate.head_revision() in ok.stdout
    down = run("check", UNREACHABLE_PG)
    assert down.returncode == 2
    assert down.stderr.startswith("error: cannot reach")

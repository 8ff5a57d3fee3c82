"""``rolloutlog audit DB_URL`` on SQLite and PostgreSQL: canned queries, ``--sql``,
``--json`` output, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from audit_helpers import BuiltRun
from click.testing import CliRunner, Result

from rolloutlog.cli import main
from rolloutlog.eventstore import EventStore, migrate


def cli(*args: str, input: str | None = None) -> Result:
    """Run ``rolloutlog ARGS`` in-process."""
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)


def as_json(*args: str, input: str | None = None) -> list[dict[str, Any]]:
    result = cli(*args, "--json", input=input)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert isinstance(rows, list) and all(isinstance(r, dict) for r in rows)
    return rows


@pytest.fixture
def sql_url(audit_run: BuiltRun, request: pytest.FixtureRequest) -> str:
    """The URL ``--sql`` runs on: the SQLite file, or a reader role's URL on PostgreSQL."""
    if audit_run.dialect == "sqlite":
        return audit_run.url
    url, _role = request.getfixturevalue("reader_role")
    return str(url)


def test_help_lists_the_queries() -> None:
    result = cli("audit", "--help")
    assert result.exit_code == 0
    for flag in ("--run", "--prompt", "--step", "--dropped", "--staleness", "--recovery",
                 "--sql", "--param", "--json"):  # fmt: skip
        assert flag in result.output
    assert "audit" in cli("--help").output


def test_summary(audit_run: BuiltRun) -> None:
    b = audit_run
    (row,) = as_json("audit", b.url)
    assert row["run_id"] == b.run.run_id
    assert row["history_events"] == len(b.history)
    assert row["prompts_dropped"] == len(b.ledger.dropped)
    table = cli("audit", b.url)
    assert table.exit_code == 0 and b.run.run_id in table.output and "prompts_live" in table.output


def test_prompt_history(audit_run: BuiltRun) -> None:
    """A prompt's events: its group's (siblings included) and its step's selection."""
    b = audit_run
    prompt = 3  # abandoned branch: dropped; history: salvaged, re-run, trained at step 1
    group = b.ledger.group_of_prompt[prompt]
    rows = as_json("audit", b.url, "--run", b.run.run_id, "--prompt", str(prompt))
    kept = {e.seq for e in b.history}
    assert all(r["seq"] in kept for r in rows)
    want = [e.seq for e in b.history if e.group_id == group]
    assert [r["seq"] for r in rows if r["group_id"] == group] == want
    types = [r["type"] for r in rows]
    assert "SiblingDispatched" in types and "SiblingCompleted" in types
    assert "PromptDropped" not in types  # the abandoned branch's drop is not history
    assert types[-2:] == ["BatchSelected", "StepTrained"]
    assert all(r["train_step"] == 1 for r in rows if r["type"] in ("BatchSelected", "StepTrained"))
    salvaged = [json.loads(r["payload"]) for r in rows if r["type"] == "SiblingCompleted"]
    assert any(p["salvaged_from"] is not None for p in salvaged)
    table = cli("audit", b.url, "--prompt", str(prompt))  # the only run: --run optional
    assert table.exit_code == 0 and "SiblingCompleted" in table.output
    assert "salvaged_from=" in table.output
    group_rows = as_json("audit", b.url, "--group", str(group))
    assert [r["seq"] for r in group_rows] == [r["seq"] for r in rows]


def test_step_dropped_staleness_recovery(audit_run: BuiltRun) -> None:
    b = audit_run
    run = ("audit", b.url, "--run", b.run.run_id)
    step1 = as_json(*run, "--step", "1")
    assert sorted(r["prompt_index"] for r in step1) == sorted(
        p for p, steps in b.ledger.step_of_prompt.items() if 1 in steps
    )
    assert all(r["trained"] is True for r in step1)  # booleans on both dialects
    dropped = as_json(*run, "--dropped")
    assert {r["prompt_index"]: r["reason"] for r in dropped if r["outcome"] == "dropped"} == (
        b.ledger.dropped
    )
    assert {r["prompt_index"]: r["reason"] for r in dropped if r["outcome"] == "evicted"} == (
        b.ledger.evicted
    )
    staleness = as_json(*run, "--staleness")
    rewards = {r["train_step"]: r["mean_reward"] for r in staleness if r["trained"]}
    assert rewards == pytest.approx(b.ledger.step_rewards)
    assert all(r["trained_at"].endswith("+00:00") for r in staleness if r["trained"])
    (restore, resume) = as_json(*run, "--recovery")
    assert restore["kind"] == "restore" and restore["forced"] is False
    assert restore["siblings_salvaged"] == b.run.report["siblings_salvaged"] == 1
    assert resume["kind"] == "resume"
    for flag in ("--dropped", "--staleness", "--recovery"):
        table = cli(*run, flag)
        assert table.exit_code == 0 and b.run.run_id in table.output, flag


def test_sql(audit_run: BuiltRun, sql_url: str) -> None:
    b = audit_run
    sql = (
        "SELECT prompt_index, train_step FROM prompt_outcomes "
        "WHERE run_id = :run_id AND prompt_index = :prompt_index"
    )
    rows = as_json(
        "audit", sql_url, "--run", b.run.run_id, "--sql", sql, "--param", "prompt_index=5"
    )
    assert rows == [{"prompt_index": 5, "train_step": b.ledger.step_of_prompt[5][0]}]
    from_stdin = as_json("audit", sql_url, "--run", b.run.run_id, "--sql", "-",
                         "--param", "prompt_index=5", input=sql)  # fmt: skip
    assert from_stdin == rows
    table = cli("audit", sql_url, "--sql", "SELECT COUNT(*) AS n FROM history_events")
    assert table.exit_code == 0 and str(len(b.history)) in table.output
    cut = cli("audit", sql_url, "--sql", "SELECT seq FROM events", "--limit", "3", "--json")
    assert cut.exit_code == 0 and len(json.loads(cut.stdout)) == 3
    assert "truncated to 3 rows" in cut.stderr


def test_refused_writes_change_nothing(audit_run: BuiltRun, sql_url: str) -> None:
    b = audit_run
    before = as_json("audit", b.url)
    result = cli("audit", sql_url, "--sql", "DELETE FROM events")
    assert result.exit_code == 1
    assert "only a single SELECT or WITH query" in result.stderr
    hidden = (
        "WITH x AS (SELECT 1) DELETE FROM events"
        if b.dialect == "sqlite"
        else "WITH d AS (DELETE FROM events RETURNING seq) SELECT COUNT(*) FROM d"
    )
    result = cli("audit", sql_url, "--sql", hidden)
    assert result.exit_code == 1
    assert "read-only" in result.stderr and "nothing was changed" in result.stderr
    result = cli("audit", sql_url, "--sql", "SELECT 1; DROP TABLE events")
    assert result.exit_code == 1 and "only one statement" in result.stderr
    assert as_json("audit", b.url) == before


def test_errors(audit_run: BuiltRun, sql_url: str, tmp_path: Path) -> None:
    b = audit_run
    result = cli("audit", b.url, "--run", "nope", "--dropped")
    assert result.exit_code == 1
    assert "no run 'nope'" in result.stderr and b.run.run_id in result.stderr
    # Without --run, :run_id is the database's only run.
    result = cli("audit", sql_url, "--sql", "SELECT * FROM runs WHERE run_id = :run_id")
    assert result.exit_code == 0 and b.run.run_id in result.stdout
    result = cli("audit", sql_url, "--sql", "SELECT * FROM runs WHERE run_id = :other")
    assert result.exit_code == 1 and "--param other=VALUE" in result.stderr
    result = cli("audit", sql_url, "--sql", "SELECT no_such FROM runs")
    assert result.exit_code == 1 and "query failed" in result.stderr
    result = cli("audit", b.url, "--dropped", "--staleness")
    assert result.exit_code == 2 and "choose one query" in result.stderr
    result = cli("audit", sql_url, "--sql", "SELECT 1", "--param", "oops")
    assert result.exit_code == 2 and "NAME=VALUE" in result.stderr
    result = cli("audit", b.url, "--param", "a=1")
    assert result.exit_code == 2
    for url, message in (
        ("mysql://x/y", "unsupported database"),
        ("not a url", "malformed database URL"),
        (f"sqlite:///{tmp_path / 'nowhere' / 'x.db'}", "does not exist"),
        (f"sqlite:///{tmp_path / 'missing.db'}", "does not exist"),
        ("postgresql+psycopg://postgres@127.0.0.1:1/nothing", "cannot reach"),
    ):
        result = cli("audit", url)
        assert result.exit_code == 1, url
        assert message in result.stderr, (url, result.stderr)
        assert "Traceback" not in result.output


def test_no_or_several_runs(sqlite_url: str) -> None:
    with EventStore.open(sqlite_url) as store:
        pass
    result = cli("audit", sqlite_url, "--dropped")
    assert result.exit_code == 1 and "holds no runs" in result.stderr
    assert as_json("audit", sqlite_url) == []
    with EventStore.open(sqlite_url) as store:
        store.create_run("a")
        store.create_run("b")
    result = cli("audit", sqlite_url, "--staleness")
    assert result.exit_code == 1 and "pick one with --run" in result.stderr
    assert [r["run_id"] for r in as_json("audit", sqlite_url)] == ["a", "b"]
    assert as_json("audit", sqlite_url, "--run", "b", "--staleness") == []
    assert "no rows" in cli("audit", sqlite_url, "--run", "b", "--recovery").output


def test_old_schema_names_the_upgrade(db_url: str) -> None:
    with EventStore.open(db_url) as store:
        migrate.downgrade(store.engine, "0001_initial")
    result = cli("audit", db_url)
    assert result.exit_code == 1 and "rolloutlog db upgrade" in result.stderr

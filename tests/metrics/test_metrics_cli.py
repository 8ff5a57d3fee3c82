"""``rolloutlog metrics`` and ``rolloutlog serve-metrics``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from metrics_helpers import RUN_ID, Scenario
from test_metrics_exporter import expected, scrape

from rolloutlog.cli import main
from rolloutlog.controller.domain.events import SiblingCompleted
from rolloutlog.controller.metrics import project_history
from rolloutlog.eventstore import EventStore


def cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def offline(url: str, **kw: int | None) -> dict:
    store = EventStore.open(url)
    try:
        return project_history(store, RUN_ID, **kw).values()  # type: ignore[arg-type]
    finally:
        store.close()


@pytest.mark.parametrize("command", ["metrics", "serve-metrics"])
def test_help(command: str) -> None:
    result = cli(command, "--help")
    assert result.exit_code == 0
    assert "DB_URL" in result.output and "--run" in result.output


def test_json_is_the_offline_projection(scenario: Scenario) -> None:
    result = cli("metrics", scenario.url, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data.pop("db") == scenario.url
    assert data.pop("not_in_log") == [
        "rollout_checkpoint_seconds",
        "rollout_log_append_seconds",
        "rollout_restore_phase_seconds",
    ]
    assert data == json.loads(json.dumps(offline(scenario.url)))
    assert data["run_id"] == RUN_ID  # the only run, picked by default
    assert len(data["steps"]) == 10 and len(data["restores"]) == 1
    by_name = json.loads(cli("metrics", scenario.url, "--json", "--run", RUN_ID).output)
    assert by_name["counters"] == data["counters"]


def test_table(scenario: Scenario) -> None:
    result = cli("metrics", scenario.url, "--steps", "3")
    assert result.exit_code == 0, result.output
    out = result.output
    for text in (
        f"run {RUN_ID}",
        "rollout_tokens_generated_total",
        "rollout_tokens_committed_total",
        "rollout_selected_group_staleness",
        "rollout_siblings_in_flight",
        "restore at offset",
        "train steps (3 of 10",
        "not in the log",
    ):
        assert text in out, text
    tokens = offline(scenario.url)["counters"]["rollout_tokens_generated_total"]
    line = next(x for x in out.splitlines() if "rollout_tokens_generated_total" in x)
    assert str(tokens) in line


def test_ranges(scenario: Scenario) -> None:
    url, ckpt = scenario.url, scenario.checkpoint_offset
    whole = offline(url)
    # Up to the checkpoint: the gauges are those at the checkpoint.
    upto = json.loads(cli("metrics", url, "--json", "--to", str(ckpt)).output)
    assert upto["offset"] == ckpt and upto["history"] == [[1, ckpt]]
    assert upto["gauges"]["rollout_train_step"] == 4
    assert upto["counters"]["rollout_restores_total"] == 0
    # From the checkpoint on: counters cover the range only, and add up with the rest.
    after = json.loads(cli("metrics", url, "--json", "--from", str(ckpt + 1)).output)
    for name in ("rollout_tokens_generated_total", "rollout_groups_trained_total"):
        assert upto["counters"][name] + after["counters"][name] == whole["counters"][name]
    assert after["gauges"] == whole["gauges"]
    assert [r["step"] for r in after["steps"]] == list(range(4, 10))
    # Work done counts every stored event of the range (the abandoned branch included);
    # the history's own counts only the events of the current history.
    events = sum(s["value"] for s in after["counters"]["rollout_events_total"])
    (_first, last), (second_first, second_last) = whole["history"]
    assert events == second_last - ckpt
    history_events = sum(s["value"] for s in after["history_counters"]["rollout_events_total"])
    assert history_events == (last - ckpt) + (second_last - second_first + 1)
    assert events > history_events
    # An offset a restore abandoned: the history of that branch, counted as it was.
    store = EventStore.open(url)
    try:
        abandoned = [
            row.seq
            for row in store.read(RUN_ID, ckpt + 1, second_first - 1)
            if row.type == SiblingCompleted.event_type
        ]
    finally:
        store.close()
    branch = json.loads(cli("metrics", url, "--json", "--to", str(abandoned[-1])).output)
    assert branch["history"] == [[1, abandoned[-1]]]
    assert branch["counters"]["rollout_restores_total"] == 0
    assert (
        branch["counters"]["rollout_siblings_completed_total"]
        > upto["counters"]["rollout_siblings_completed_total"]
    )


def test_errors(scenario: Scenario, tmp_path: Path) -> None:
    unknown = cli("metrics", scenario.url, "--run", "nope")
    assert unknown.exit_code == 1
    assert "no run 'nope'" in unknown.output and RUN_ID in unknown.output
    bad_url = cli("metrics", "mysql://x/y")
    assert bad_url.exit_code == 1 and "unsupported database" in bad_url.output
    missing = cli("metrics", f"sqlite:///{tmp_path}/absent/log.db")
    assert missing.exit_code == 1 and "does not exist" in missing.output
    beyond = cli("metrics", scenario.url, "--to", "999999")
    assert beyond.exit_code == 1 and "outside run" in beyond.output
    backwards = cli("metrics", scenario.url, "--from", "10", "--to", "5")
    assert backwards.exit_code == 2 and "--from 10 is after --to 5" in backwards.output
    empty = tmp_path / "empty.db"
    EventStore.open(f"sqlite:///{empty}").close()
    none = cli("metrics", f"sqlite:///{empty}")
    assert none.exit_code == 1 and "no run" in none.output
    unreachable = cli("metrics", "postgresql+psycopg://postgres@127.0.0.1:1/nothing")
    assert unreachable.exit_code == 1 and "Error:" in unreachable.output
    for result in (unknown, bad_url, missing, beyond, none, unreachable):
        assert "Traceback" not in result.output


def test_serve_metrics_serves_the_log(scenario: Scenario) -> None:
    """The real command in its own process: port 0, scraped over HTTP, stopped by SIGTERM."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from rolloutlog.cli import main; main()",
            "serve-metrics",
            scenario.url,
            "--port",
            "0",
            "--host",
            "127.0.0.1",
            "--interval",
            "0.1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "serving metrics of run" in line, line + (proc.stderr.read() if proc.stderr else "")
        port = int(line.split("(port ")[1].split(")")[0])
        url = f"http://127.0.0.1:{port}/metrics"
        samples = scrape(url)
        store = EventStore.open(scenario.url)
        try:
            families = project_history(store, RUN_ID).families()
        finally:
            store.close()
        assert samples == expected(families)
        time.sleep(0.3)  # a few polls later, nothing changed
        assert scrape(url) == samples
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0


def test_serve_metrics_port_in_use(scenario: Scenario) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = cli("serve-metrics", scenario.url, "--port", str(port), "--host", "127.0.0.1")
    assert result.exit_code == 1 and f"cannot serve on 127.0.0.1:{port}" in result.output

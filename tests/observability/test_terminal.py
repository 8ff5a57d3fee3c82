"""Terminal output a person can read (issue 15.6): replay --explain and audit of several
runs fit 80 columns, metrics prints dates (not 1.7961e+09) and rates apart from gauges,
`run` hides third-party progress bars, and `demo --json` shows progress on stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from prom_server import kill_group

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "metrics"))

from metrics_helpers import RUN_ID, run_scenario

from rolloutlog.cli import main as cli_main
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.eventstore import EventStore


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The scripted run (with a restore) and a second, empty run in one log."""
    path = tmp_path_factory.mktemp("terminal") / "log.db"
    db = f"sqlite:///{path}"
    run_scenario(db)
    store = EventStore.open(db)
    try:
        ctl = RolloutController.start(
            store,
            "second-run",
            RolloutConfig(group_size=2, groups_per_step=2),
            dataset_fingerprint="terminal",
            dataset_size=10,
            store_config=StoreConfig(snapshot_interval=0),
        )
        ctl.flush()
        ctl.close()
    finally:
        store.close()
    return db


def _cli(*args: str, columns: int = 80) -> str:
    result = CliRunner(env={"COLUMNS": str(columns)}).invoke(cli_main, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def _widest(text: str) -> int:
    return max(len(line.rstrip()) for line in text.splitlines())


def test_replay_explain_fits_80_columns(url: str) -> None:
    out = _cli("replay", url, "--run", RUN_ID, "--explain", "prompt:45")
    assert _widest(out) <= 80, out
    assert "SiblingDispatched" in out and "SiblingCompleted" in out
    assert "abandoned" in out  # prompt 45's first attempt was rolled back by the restore
    assert "payload_id" not in out and "=None" not in out


def test_audit_of_several_runs_fits_80_columns(url: str) -> None:
    out = _cli("audit", url)
    assert _widest(out) <= 80, out
    assert RUN_ID in out and "second-run" in out
    assert "runs (1 of 2)" in out and "runs (2 of 2)" in out


def test_metrics_prints_dates_and_rates_apart(url: str) -> None:
    out = _cli("metrics", url, "--run", RUN_ID, columns=100)
    assert "e+09" not in out
    gauges = out[out.index("gauges (at the end") : out.index("rates (per second")]
    assert "rollout_last_event_timestamp_seconds" in gauges and "+00:00" in gauges
    assert "per_second" not in gauges and "tokens_generated" not in gauges.split("history")[0]
    rates = out[out.index("rates (per second") : out.index("histograms")]
    assert "groups_trained" in rates and "tokens_generated" in rates
    assert "work done" in out and "history" in out


@pytest.mark.slow
def test_demo_json_shows_progress_on_stderr(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "from rolloutlog.cli import main; main()", "demo", "--json",
         "--steps", "8", "--checkpoint-every", "2", "--backend", "deterministic",
         "--workdir", str(tmp_path), "--db", f"sqlite:///{tmp_path / 'demo.db'}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, err
    summary = json.loads(out)  # stdout: the one JSON object, nothing else
    assert summary["steps_trained"] == 8
    assert "first: step 1/8" in err and "resume: step 8/8" in err
    assert "worker killed (SIGKILL)" in err
    assert "Writing model shards" not in err and "Loading weights" not in err

"""Labels and discovery (issue 15.2): every series carries ``run_id``; serve-metrics
serves several runs (every run, bounded by --max-runs); the embedded exporter binds
127.0.0.1 by default and prints its URL also without --json."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import yaml
from click.testing import CliRunner
from prom_server import kill_group
from prometheus_client.parser import text_string_to_metric_families

from rolloutlog.cli import main as cli_main
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.metrics import RunsTailer, start_exporter
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.eventstore import EventStore


def _make_runs(url: str, names: list[str]) -> None:
    store = EventStore.open(url)
    try:
        for name in names:
            ctl = RolloutController.start(
                store,
                name,
                RolloutConfig(group_size=2, groups_per_step=2),
                dataset_fingerprint="labels",
                dataset_size=10,
                store_config=StoreConfig(snapshot_interval=0),
            )
            ctl.flush()
            ctl.close()
    finally:
        store.close()


def _runs_of(url: str) -> dict[str, set[str]]:
    """metric family name -> the run_id labels of its samples (every sample has one)."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            assert "run_id" in s.labels, (s.name, s.labels)
            out.setdefault(fam.name, set()).add(s.labels["run_id"])
    return out


def test_runs_tailer_serves_the_newest_runs_each_labelled(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    _make_runs(url, ["a", "b", "c"])
    store = EventStore.open(url)
    tailer = RunsTailer(store, interval=0.1, max_runs=2)
    try:
        tailer.poll()
        assert [t.run_id for t in tailer.sources()] == ["b", "c"]
        handle = start_exporter(tailer.sources, 0)
        try:
            assert handle.url.startswith("http://127.0.0.1:")  # the default host
            runs = _runs_of(handle.url)
            assert runs["rollout_epoch"] == {"b", "c"}
            assert runs["rollout_events"] == {"b", "c"}  # a counter: one family, two runs
            _make_runs(url, ["d"])  # a run created later is picked up; the oldest leaves
            tailer.poll()
            assert _runs_of(handle.url)["rollout_epoch"] == {"c", "d"}
        finally:
            handle.close()
    finally:
        store.close()


def test_serve_metrics_all_runs_and_several_runs(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    _make_runs(url, ["a", "b", "c"])
    for args, want in (
        (["--all-runs", "--max-runs", "2"], {"b", "c"}),
        (["--run", "a", "--run", "c"], {"a", "c"}),
        ([], {"c"}),
    ):
        proc = subprocess.Popen(
            [sys.executable, "-c", "from rolloutlog.cli import main; main()", "serve-metrics",
             url, "--port", "0", "--host", "127.0.0.1", "--interval", "0.1", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert "serving metrics of" in line, line
            port = int(line.split("(port ")[1].split(")")[0])
            assert _runs_of(f"http://127.0.0.1:{port}/metrics")["rollout_epoch"] == want
        finally:
            kill_group(proc)
    bad = CliRunner().invoke(cli_main, ["serve-metrics", url, "--all-runs", "--run", "a"])
    assert bad.exit_code == 2 and "exclude each other" in bad.output
    unknown = CliRunner().invoke(cli_main, ["serve-metrics", url, "--run", "zz"])
    assert unknown.exit_code == 1 and "no run 'zz'" in unknown.output


def test_run_prints_the_exporter_url_without_json(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "steps": 1,
                "checkpoint_every": 1,
                "checkpoint_dir": str(tmp_path / "checkpoints"),
                "backend": "deterministic",
                "model": {"dir": str(tmp_path / "model"), "build": "tiny"},
                "store": {"url": f"sqlite:///{tmp_path / 'log.db'}"},
                "telemetry": {"enabled": True, "port": 0},
            }
        )
    )
    result = CliRunner().invoke(cli_main, ["run", str(config), "--run-id", "r1"])
    assert result.exit_code == 0, result.output
    assert "serving metrics of run r1 at http://127.0.0.1:" in result.output
    # Third-party progress bars (model shards written and loaded) are silenced.
    assert "Writing model shards" not in result.output
    assert "Loading weights" not in result.output

"""``rolloutlog demo --trainer trl --json`` and ``examples/trl_async_grpo.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from contextlib import suppress
from pathlib import Path

import pytest

from rolloutlog.integrations.trl import cpu as trl_cpu

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "trl_async_grpo.py"


def _run(argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``argv`` in its own process group, killed (group) at the deadline."""
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env={**os.environ, **trl_cpu.OFFLINE_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.mark.slow
@pytest.mark.usefixtures("trl_installed")
def test_demo_trainer_trl_json(tmp_path: Path) -> None:
    rolloutlog = Path(sys.executable).with_name("rolloutlog")
    db = f"sqlite:///{tmp_path / 'log.db'}"
    argv = [str(rolloutlog), "demo", "--trainer", "trl", "--json", "--steps", "8"]
    argv += ["--checkpoint-every", "2", "--workdir", str(tmp_path / "w"), "--db", db]
    done = _run(argv, tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    import trl

    assert summary["trl_version"] == trl.__version__
    assert summary["resumed_from_step"] == 2 and summary["checkpoint_step"] == 2
    assert summary["killed_after_step"] >= 3
    assert summary["prompts_lost"] == 0 and summary["prompts_trained_twice"] == 0
    assert summary["samples_dropped_by_trl"] == 0
    assert summary["groups_salvaged"] > 0 and summary["salvaged_siblings_redispatched"] == 0
    assert summary["steps_trained"] == 8 and summary["prompts_trained"] == 8 * 2
    assert summary["ok"] is True and summary["db"] == db
    assert Path(summary["resumed_from_checkpoint"]).name == "checkpoint-2"


def test_demo_trainer_trl_refuses_another_backend(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from rolloutlog.cli import main

    result = CliRunner().invoke(
        main, ["demo", "--trainer", "trl", "--backend", "torch", "--workdir", str(tmp_path)]
    )
    assert result.exit_code == 1
    assert "rolloutlog demo --trainer trl runs the deterministic backend only, not torch" in (
        result.output
    )


def test_samples_dropped_by_trl_reads_trls_printed_metric(tmp_path: Path) -> None:
    from rolloutlog.integrations.trl.demo import samples_dropped_by_trl

    log = tmp_path / "first.log"
    log.write_text(
        "{'loss': '0.4', 'sample/dropped_stale_total': '2'}\n{'loss': '0.3'}\n"
        "{'sample/dropped_stale_total': '1.0', 'epoch': '1'}\n"
    )
    assert samples_dropped_by_trl(log, tmp_path / "missing.log") == 3.0
    assert samples_dropped_by_trl(tmp_path / "missing.log") == 0.0


@pytest.mark.usefixtures("trl_installed")
def test_example_script_help() -> None:
    done = _run([sys.executable, str(EXAMPLE), "--help"], REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--resume" in done.stdout and "--model-dir" in done.stdout


@pytest.mark.slow
@pytest.mark.usefixtures("trl_installed")
def test_example_script_trains_and_resumes(trl_tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    base = [sys.executable, str(EXAMPLE), "--model-dir", str(trl_tiny_model), "--cpu"]
    base += ["--output-dir", str(out), "--save-steps", "2"]
    first = _run([*base, "--max-steps", "2"], tmp_path, timeout=600)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "trained to step 2" in first.stdout
    second = _run([*base, "--max-steps", "4", "--resume"], tmp_path, timeout=600)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "trained to step 4" in second.stdout
    run_id = first.stdout.rsplit("rollout log run ", 1)[1].split()[0]
    assert second.stdout.rsplit("rollout log run ", 1)[1].split()[0] == run_id
    assert (out / "checkpoint-4" / "rolloutlog_state.json").is_file()

"""``rolloutlog demo`` end to end, as a real subprocess: a worker is SIGKILLed between
checkpoints, a second one resumes from the newest checkpoint offset, and the summary
(from the log alone) shows no prompt lost and none trained twice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from rolloutlog.cli import main

from .conftest import rolloutlog

STEPS = 8
KEYS = {
    "run_id",
    "db",
    "backend",
    "steps_trained",
    "steps_planned",
    "reward_first",
    "reward_last",
    "rewards",
    "killed_after_step",
    "restored_from_offset",
    "recovery",
    "prompts_pulled",
    "prompts_trained",
    "prompts_lost",
    "prompts_trained_twice",
    "invariant_violations",
    "log_events",
    "seconds",
    "ok",
}


def _demo(db: str, workdir: Path, *extra: str, timeout: float = 300) -> dict[str, Any]:
    proc = rolloutlog(
        "demo",
        "--json",
        "--steps",
        str(STEPS),
        "--checkpoint-every",
        "3",
        "--workdir",
        str(workdir),
        "--db",
        db,
        *extra,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert isinstance(summary, dict)
    return summary


def _check(summary: dict[str, Any], db: str) -> None:
    assert set(summary) >= KEYS, KEYS - set(summary)
    assert summary["ok"] is True
    assert summary["db"] == db
    assert summary["steps_trained"] == STEPS
    assert summary["steps_planned"] == STEPS
    assert summary["prompts_lost"] == 0
    assert summary["prompts_trained_twice"] == 0
    assert summary["invariant_violations"] == []
    assert len(summary["rewards"]) == STEPS
    assert all(0.0 <= r <= 1.0 for r in summary["rewards"])
    # The crash came after the checkpoint at step 3 and the resume started from it.
    assert summary["killed_after_step"] >= 3
    assert isinstance(summary["restored_from_offset"], int)
    assert 0 < summary["restored_from_offset"] < summary["log_events"]
    assert summary["prompts_trained"] == STEPS * 8  # groups_per_step of the demo
    rec = summary["recovery"]
    assert rec["complete_groups_restored"] is not None
    assert rec["siblings_reused"] + rec["siblings_salvaged"] + rec["siblings_rerun"] >= 0


@pytest.mark.slow
def test_demo_sqlite(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'x.db'}"
    summary = _demo(db, tmp_path)
    _check(summary, db)
    assert summary["backend"] == "torch"
    # The tiny policy learns the toy task even in 8 steps.
    assert summary["reward_last"] > summary["reward_first"]


@pytest.mark.slow
@pytest.mark.postgres
def test_demo_postgres(tmp_path: Path, pg_url: str) -> None:
    summary = _demo(pg_url, tmp_path)
    _check(summary, pg_url)


def test_demo_rejects_too_few_steps(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        main,
        ["demo", "--steps", "8", "--checkpoint-every", "6", "--workdir", str(tmp_path),
         "--db", f"sqlite:///{tmp_path / 'x.db'}"],
    )  # fmt: skip
    assert res.exit_code == 1
    assert "checkpoint_every + 3 = 9 steps" in res.output
    assert not (tmp_path / "checkpoints").exists()  # no worker was started

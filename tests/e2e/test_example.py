"""``examples/grpo_toy.py``, the documented library example, run as a subprocess: the
mean reward rises over 12 steps, and ``--resume`` continues from the rollout offset
stored in the newest model checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolloutlog.controller.prompt_ledger import build_ledger, cross_check
from rolloutlog.controller.replay_tool import check_history
from rolloutlog.controller.rollout_controller import iter_history, replay
from rolloutlog.eventstore import EventStore

from .conftest import REPO, json_lines, run_cmd

EXAMPLE = REPO / "examples" / "grpo_toy.py"


def _example(*args: str) -> list[dict[str, object]]:
    import sys

    proc = run_cmd([sys.executable, str(EXAMPLE), *args], timeout=300)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-3000:]}"
    return json_lines(proc.stdout)


@pytest.mark.slow
def test_example_learns_and_resumes(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'example.db'}"
    common = ("--db", db, "--workdir", str(tmp_path), "--run-id", "ex", "--checkpoint-every", "4")
    first = [m for m in _example(*common, "--steps", "12") if m["event"] == "step"]
    assert [m["step"] for m in first] == list(range(12))
    rewards = [float(m["reward"]) for m in first]  # type: ignore[arg-type]
    early, late = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    # Untrained, the policy emits the target character ~3% of the time; after 12 steps
    # well over a third of the time (0.03 -> ~0.75 with the default seed).
    assert late > early + 0.2, rewards
    last_offset = first[-1]["checkpoint_offset"]
    assert isinstance(last_offset, int)

    second = _example(*common, "--steps", "14", "--resume")
    restored = next(m for m in second if m["event"] == "restored")
    assert restored["from_offset"] == last_offset
    assert [m["step"] for m in second if m["event"] == "step"] == [12, 13]

    store = EventStore.open(db)
    try:
        assert check_history(store, "ex").violation is None
        # The log shows the restore at exactly the checkpoint offset of the model file.
        restores = [
            (row.seq, ev) for row, ev in iter_history(store, "ex") if ev.event_type == "RunRestored"
        ]
        assert len(restores) == 1
        seq, event = restores[0]
        assert seq > last_offset
        assert event.from_offset == last_offset  # type: ignore[attr-defined]
        assert event.checkpoint_train_step == 12  # type: ignore[attr-defined]
        ledger = build_ledger(store, "ex")
        check = cross_check(ledger, replay(store, "ex").state)
        assert sorted(ledger.step_rewards) == list(range(14))
        assert check.prompts_lost == 0 and check.prompts_trained_twice == 0
    finally:
        store.close()


def test_example_resume_without_checkpoint_fails_clearly(tmp_path: Path) -> None:
    import sys

    proc = run_cmd(
        [sys.executable, str(EXAMPLE), "--db", f"sqlite:///{tmp_path / 'x.db'}",
         "--workdir", str(tmp_path), "--resume"],
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "no checkpoint in" in proc.stderr

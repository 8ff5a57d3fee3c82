"""The demo's worker holds after each step report past the planned crash until the demo
answers, so a demo process that is slow to read (a loaded machine) still crashes the
worker where it planned to, not after the worker has trained on and finished."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rolloutlog.controller.prompt_ledger import build_ledger
from rolloutlog.eventstore import EventStore
from rolloutlog.grpo.demo import _run_worker
from rolloutlog.grpo.run_config import RunConfig


def _config(tmp_path: Path, steps: int = 12) -> RunConfig:
    return RunConfig.model_validate(
        {
            "steps": steps,
            "checkpoint_every": 3,
            "checkpoint_dir": str(tmp_path / "checkpoints"),
            "backend": "deterministic",
            "model": {"dir": str(tmp_path / "tiny-model"), "build": "tiny"},
            "store": {"url": f"sqlite:///{tmp_path / 'log.db'}"},
        }
    )


def test_a_slow_demo_still_crashes_the_worker_at_the_planned_step(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    seen: list[int] = []

    def slow_reader(msg: dict[str, Any]) -> None:
        if msg.get("event") == "step":
            seen.append(msg["step"])
            if msg["step"] == 4:
                time.sleep(3.0)  # the demo is starved: the worker must wait for it

    answered: list[int] = []

    def may_kill() -> bool:
        answered.append(seen[-1])
        return seen[-1] >= 6  # "not yet" twice: the worker goes on after each answer

    out = _run_worker(
        cfg, "r", "fresh", kill_after_step=4, on_message=slow_reader, may_kill=may_kill
    )
    assert out.killed
    assert answered == [4, 5, 6]
    with EventStore.open(cfg.store.url) as store:
        trained = sorted(build_ledger(store, "r").step_rewards)
    # Steps 0..6 trained, and nothing after the report the demo crashed it at.
    assert trained == list(range(7)), trained


def test_without_a_planned_crash_the_worker_does_not_hold(tmp_path: Path) -> None:
    # Past a checkpoint (every 3) to the last step, no hold on the way: 4 steps show it
    # as 12 did (the steps cost seconds each).
    cfg = _config(tmp_path, steps=4)
    out = _run_worker(cfg, "r", "fresh", kill_after_step=None, on_message=lambda _m: None)
    assert not out.killed and out.returncode == 0
    assert [m["event"] for m in out.messages].count("step") == 4

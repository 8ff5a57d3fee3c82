"""A training loop whose generation backend cannot be made closes the controller it
opened: its commit thread stops instead of outliving the failed run."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.grpo import loop
from rolloutlog.grpo.run_config import RunConfig


def test_a_backend_that_cannot_be_made_closes_the_controller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = RunConfig.model_validate(
        {
            "steps": 2,
            "backend": "deterministic",
            "checkpoint_dir": str(tmp_path / "checkpoints"),
            "model": {"dir": str(tmp_path / "model")},
            "store": {"url": f"sqlite:///{tmp_path / 'log.db'}"},
        }
    )
    closed: list[RolloutController] = []
    original_close = RolloutController.close

    def spy_close(self: RolloutController) -> None:
        closed.append(self)
        original_close(self)

    def no_backend(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("injected: the engine cannot start")

    monkeypatch.setattr(RolloutController, "close", spy_close)
    monkeypatch.setattr(loop, "make_backend", no_backend)
    with pytest.raises(RuntimeError, match="injected: the engine cannot start"):
        asyncio.run(loop.run_training(cfg, run_id="nobackend", resume=False))
    assert len(closed) == 1
    assert not any(t.name == "rolloutlog-commit-nobackend" for t in threading.enumerate())

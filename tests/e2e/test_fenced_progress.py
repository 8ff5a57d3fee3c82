"""A controller fenced by a takeover never reports progress the log refused.

``run_training`` trains with the deterministic backend; a second controller opens the
run (a takeover) either right after a step was reported as progress, or right after the
trainer recorded a step but before that step was durable. The first loop must stop
with one clear fence error, and every step it reported must be in the log, under its
own epoch, at or before the offset it reported.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from rolloutlog.controller.config import StoreConfig
from rolloutlog.controller.rollout_controller import RolloutController, iter_history
from rolloutlog.controller.rollout_runtime import RolloutRuntime
from rolloutlog.eventstore import EpochFencedError, EventStore
from rolloutlog.grpo.loop import run_training
from rolloutlog.grpo.run_config import RunConfig

RUN = "fenced"


def _cfg(tmp_path: Path) -> RunConfig:
    return RunConfig.model_validate(
        {
            "steps": 6,
            "checkpoint_every": 2,
            "checkpoint_dir": str(tmp_path / "checkpoints"),
            "backend": "deterministic",
            "model": {"dir": str(tmp_path / "model"), "build": "tiny"},
            "store": {"url": f"sqlite:///{tmp_path / 'log.db'}"},
        }
    )


@pytest.mark.parametrize("when", ["after_progress", "before_durable"])
def test_a_fenced_loop_reports_no_refused_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    cfg = _cfg(tmp_path)
    url = cfg.store.url
    taken: list[RolloutController] = []
    stores: list[EventStore] = []

    def take_over() -> None:
        store = EventStore.open(url)
        stores.append(store)
        taken.append(RolloutController.open(store, RUN, store_config=StoreConfig()))

    steps: list[dict[str, Any]] = []

    def progress(msg: dict[str, Any]) -> None:
        if msg["event"] != "step":
            return
        steps.append(msg)
        if when == "after_progress" and msg["step"] == 1:
            take_over()

    if when == "before_durable":
        original = RolloutRuntime.report_trained

        async def report_then_lose_the_run(
            self: RolloutRuntime, train_step: int, weight_version: int
        ) -> None:
            await original(self, train_step, weight_version)
            if train_step == 2:  # StepTrained is queued, not yet durable
                take_over()

        monkeypatch.setattr(RolloutRuntime, "report_trained", report_then_lose_the_run)

    try:
        with pytest.raises(EpochFencedError) as info:
            asyncio.run(
                asyncio.wait_for(
                    run_training(cfg, run_id=RUN, resume=False, progress=progress), timeout=240
                )
            )
        assert str(info.value) == (
            f"run {RUN!r} is fenced: this writer holds epoch 1 but the run is at epoch 2 (a "
            "restore or another controller took over); nothing of this batch was written"
        )
        # Step 2 (when it is reported at all) needs appends after the takeover.
        assert [m["step"] for m in steps] == [0, 1]
        with EventStore.open(url) as store:
            trained = {
                ev.train_step: row  # type: ignore[attr-defined]
                for row, ev in iter_history(store, RUN)
                if ev.event_type == "StepTrained" and row.epoch == 1
            }
        for msg in steps:
            # Reported only once durable: the step's StepTrained is in the log, at or
            # before the offset the loop reported, and written by the first controller.
            row = trained.get(msg["step"])
            assert row is not None, (msg, sorted(trained))
            assert row.seq <= msg["offset"], (row.seq, msg)
    finally:
        for ctl in taken:
            ctl.close()
        for store in stores:
            store.close()

"""Spares at the end of the data are trained, and ``passes_completed`` counts only passes
whose every prompt has an outcome (issue 31, item 6).

The shape of ``configs/real-workload.yaml`` at a small scale (two passes that fill the
steps exactly, a spare pool of 2), on the deterministic backend and a SQLite file: the
spares pulled ahead of the steps used to sit unused at the end while the last step ran
short by the pool's size, and the summary still said both passes were complete.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from rolloutlog.controller.domain.events import BatchSelected
from rolloutlog.controller.rollout_controller import iter_history
from rolloutlog.eventstore import EventStore
from rolloutlog.grpo.loop import run_training
from rolloutlog.grpo.run_config import RunConfig
from rolloutlog.grpo.workload import run_summary

from .conftest import two_pass_raw_config

RUN = "spares"
SIZE = 12  # prompts a pass; 2 passes = 6 steps of 4 groups


def _cfg(tmp_path: Path, tiny_dir: Path, steps: int) -> RunConfig:
    rows: list[dict[str, object]] = [
        {"question": f"what is {i} + 1?", "answer": str(i + 1)} for i in range(SIZE)
    ]
    raw = two_pass_raw_config(
        tmp_path, tiny_dir, rows, steps=steps, checkpoint_every=10, spare_pool_size=2
    )
    return RunConfig.model_validate(raw)


def _batches(cfg: RunConfig) -> list[BatchSelected]:
    store = EventStore.open(cfg.store.url)
    try:
        return [e for _row, e in iter_history(store, RUN) if isinstance(e, BatchSelected)]
    finally:
        store.close()


def test_the_last_step_trains_the_spares_and_both_passes_complete(
    tmp_path: Path, tiny_dir: Path
) -> None:
    cfg = _cfg(tmp_path, tiny_dir, steps=2 * SIZE // 4)
    result = asyncio.run(run_training(cfg, run_id=RUN, resume=False))
    assert result.stopped is None and result.steps_trained == cfg.steps
    batches = _batches(cfg)
    assert [(len(b.group_ids), b.shortfall) for b in batches] == [(4, 0)] * cfg.steps
    summary = run_summary(cfg, RUN, result.workload)
    assert summary["prompts_trained"] == 2 * SIZE  # every (pass, index) once
    assert summary["prompts_lost"] == 0 and summary["prompts_trained_twice"] == 0
    assert summary["passes_completed"] == 2


def test_a_pass_with_spares_never_trained_is_not_complete(tmp_path: Path, tiny_dir: Path) -> None:
    # One step short of the data: the spares (prompts of pass 0, pulled at step 0) are
    # never trained, so pass 0 is not complete, and neither is pass 1.
    cfg = _cfg(tmp_path, tiny_dir, steps=2 * SIZE // 4 - 1)
    result = asyncio.run(run_training(cfg, run_id=RUN, resume=False))
    assert result.steps_trained == cfg.steps
    summary = run_summary(cfg, RUN, result.workload)
    assert summary["prompts_trained"] == 4 * cfg.steps
    assert summary["passes_completed"] == 0

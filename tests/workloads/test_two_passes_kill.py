"""Two passes over a 24-prompt dataset, SIGKILLed inside the second pass and resumed:
counted from the log per (pass, index), every prompt is trained exactly once per pass.

The worker runs ``run_training`` in its own process group; its progress callback blocks
once step 8 (inside the second pass: 6 steps of 4 groups per pass) is in the log, so the
kill lands mid-pass deterministically, with later groups in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rolloutlog.controller.domain.events import RunStarted
from rolloutlog.controller.prompt_ledger import build_ledger
from rolloutlog.controller.rollout_controller import iter_history
from rolloutlog.eventstore import EventStore
from rolloutlog.grpo.loop import run_training
from rolloutlog.grpo.run_config import RunConfig
from rolloutlog.grpo.workload import run_summary

from .conftest import two_pass_raw_config

RUN = "two-passes"
SIZE = 24
KILL_AT_STEP = 8

WORKER = """
import asyncio, json, sys, time
from rolloutlog.grpo.loop import run_training
from rolloutlog.grpo.run_config import RunConfig

cfg = RunConfig.model_validate(json.loads(open(sys.argv[1]).read()))

def progress(msg):
    print(json.dumps(msg, default=str), flush=True)
    if msg.get("event") == "step" and msg["step"] == int(sys.argv[2]):
        print("BLOCKED", flush=True)
        time.sleep(600)  # hold still until the test kills the whole group

asyncio.run(run_training(cfg, run_id=sys.argv[3], resume=False, progress=progress))
print("FINISHED", flush=True)
"""


def _raw(tmp_path: Path, tiny_dir: Path) -> dict[str, Any]:
    rows: list[dict[str, object]] = [
        {"question": f"what is {i} + {i % 5}?", "answer": str(i + i % 5)} for i in range(SIZE)
    ]
    return two_pass_raw_config(
        tmp_path, tiny_dir, rows, steps=2 * SIZE // 4, checkpoint_every=1, spare_pool_size=0
    )


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.slow
def test_two_passes_with_a_kill_in_the_second_pass_train_each_prompt_once_per_pass(
    tmp_path: Path, tiny_dir: Path
) -> None:
    raw = _raw(tmp_path, tiny_dir)
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(raw))
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    proc = subprocess.Popen(
        [sys.executable, str(worker), str(cfg_path), str(KILL_AT_STEP), RUN],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 240
        assert proc.stdout is not None
        for line in proc.stdout:  # ends at EOF if the worker dies first
            seen.append(line)
            if line.strip() == "BLOCKED" or time.monotonic() > deadline:
                break
        assert seen and seen[-1].strip() == "BLOCKED", "".join(seen[-30:])
    finally:
        _kill_group(proc)
    assert proc.returncode == -signal.SIGKILL

    cfg = RunConfig.model_validate(raw)
    result = asyncio.run(run_training(cfg, run_id=RUN, resume=True))
    assert result.stopped is None
    assert result.first_step <= KILL_AT_STEP + 1
    assert result.first_step + result.steps_trained == cfg.steps

    store = EventStore.open(cfg.store.url)
    try:
        ledger = build_ledger(store, RUN)
        started = [e for _row, e in iter_history(store, RUN) if isinstance(e, RunStarted)]
    finally:
        store.close()
    assert [(e.passes, e.shuffle_seed) for e in started] == [(2, 7)]
    # Counted from the log per (pass, index): each prompt exactly once in each pass.
    want = {(p, i): 1 for p in range(2) for i in range(SIZE)}
    assert dict(ledger.trained_keys) == want
    assert ledger.trained_twice == [] and ledger.pulled_twice == []
    # By dataset index alone, every prompt was trained twice: once per pass.
    assert dict(ledger.trained) == {i: 2 for i in range(SIZE)}
    summary = run_summary(cfg, RUN, {})
    assert summary["prompts_lost"] == 0
    assert summary["prompts_trained_twice"] == 0
    assert summary["prompts_trained"] == 2 * SIZE
    assert summary["passes_completed"] == 2
    assert summary["stopped"] is None

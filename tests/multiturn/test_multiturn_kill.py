"""A real SIGKILL of a multi-turn run mid-conversation, then a restore that resumes
each trajectory after its last durable turn. Checked from the SQL log (every epoch, the
abandoned branch included) and the tool's own ledger of side effects."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from mt_task import ROLLOUT, RUN, STORE, Ledger, Prompts, runtime

from rolloutlog.controller.domain.events import CODEC
from rolloutlog.controller.domain.invariants import check_invariants
from rolloutlog.controller.domain.trajectory import (
    TURN_EVENT_TYPES,
    ModelCallCompleted,
    ToolCallCompleted,
    ToolCallFailed,
    ToolCallRequested,
    TrajectoryCompleted,
    TrajectoryResumed,
    TrajectoryStarted,
    fold_trajectories,
)
from rolloutlog.controller.prompt_ledger import build_ledger
from rolloutlog.controller.replay_tool import check_history, verify_decisions
from rolloutlog.controller.rollout_controller import RolloutController, replay
from rolloutlog.eventstore import EventStore, decode_arrays

WORKER = Path(__file__).resolve().parent / "mt_worker.py"
WEIGHTS = [("w", torch.zeros(1))]
DEADLINE_S = 180.0


class _Worker:
    """The worker process in its own process group, its stdout read by a thread."""

    def __init__(self, url: str, ledger: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), url, str(ledger), "50"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.strip())
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, prefix: str, count: int = 1, after: int = 0) -> int:
        """Index of the ``count``-th line from ``after`` starting with ``prefix``."""
        deadline = time.monotonic() + DEADLINE_S
        with self._cond:
            while True:
                hits = [i for i, x in enumerate(self.lines) if i >= after and x.startswith(prefix)]
                if len(hits) >= count:
                    return hits[count - 1]
                left = deadline - time.monotonic()
                if left <= 0 or not self._reader.is_alive():
                    break
                self._cond.wait(min(left, 0.2))
        err = self.proc.stderr.read() if self.proc.poll() is not None and self.proc.stderr else ""
        raise AssertionError(f"no {prefix!r} line: {self.lines[-5:]} {err[-2000:]}")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._reader.join(timeout=10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


def _kill_mid_conversation(url: str, ledger: Path) -> int:
    """Run the worker past its checkpoint, SIGKILL it while a tool runs; the offset."""
    worker = _Worker(url, ledger)
    try:
        at = worker.wait_for("CKPT")
        offset = int(worker.lines[at].split()[1])
        worker.wait_for("RUNNING", count=3, after=at)  # a tool between its run and result
        os.killpg(worker.proc.pid, signal.SIGKILL)
    finally:
        worker.kill()
    assert worker.proc.returncode == -signal.SIGKILL
    return offset


async def _resume(ctl: RolloutController, ledger: Ledger, steps: int) -> Any:
    rt, multi, _ = runtime(ctl, ledger)
    await rt.start()
    try:
        await rt.sync_weights(WEIGHTS, ctl.state.weight_version)
        for step in range(ctl.state.train_step, steps):
            batch = await rt.next_batch(step, timeout=120)
            assert all(s.reward == 1.0 for s in batch.samples), batch.samples
            await rt.report_trained(step, step + 1)
            await rt.publish_weights(WEIGHTS, step + 1)
    finally:
        await rt.close()
    return multi.stats


@pytest.mark.slow
def test_sigkill_mid_conversation_then_restore_resumes_at_the_last_durable_turn(
    db_url: str, tmp_path: Path
) -> None:
    ledger_path = tmp_path / "ledger.tsv"
    offset = _kill_mid_conversation(db_url, ledger_path)
    killed_epoch_rows = None
    store = EventStore.open(db_url)
    try:
        killed_epoch_rows = store.last_seq(RUN)
        ctl, report = RolloutController.restore(
            store,
            RUN,
            offset,
            rollout=ROLLOUT,
            dataset_fingerprint=Prompts.fingerprint,
            store_config=STORE,
        )
        stats = asyncio.run(_resume(ctl, Ledger(ledger_path), 4))
        ctl.close()

        rows = list(store.read(RUN))
        events = [(r.seq, r.epoch, CODEC.decode(r)) for r in rows if r.type in TURN_EVENT_TYPES]
        new_epoch = report.epoch
        # No tool call ran twice: the ledger (the side effect itself) holds each key once,
        # and the log holds at most one result per key over every branch.
        keys = [k for k, _ in Ledger(ledger_path).entries()]
        assert keys and len(keys) == len(set(keys)), keys
        results = Counter(
            e.idempotency_key
            for _, _, e in events
            if isinstance(e, ToolCallCompleted | ToolCallFailed)
        )
        assert results and max(results.values()) == 1
        requested = {e.idempotency_key for _, _, e in events if isinstance(e, ToolCallRequested)}
        assert set(keys) <= requested  # every run was requested durably first
        # The kill landed between a tool's run and its result: the restore asked the tool.
        checked = [
            e
            for _, ep, e in events
            if ep == new_epoch and isinstance(e, ToolCallCompleted) and e.source == "status_check"
        ]
        assert checked and stats.tool_calls_status_checked >= 1
        # No completed model call was regenerated: one per (group, sibling, turn) over
        # every branch of the log (this run's group ids name the same prompts in both).
        calls = Counter(
            (e.group_id, e.sibling, e.turn)
            for _, _, e in events
            if isinstance(e, ModelCallCompleted)
        )
        assert max(calls.values()) == 1
        starts = Counter(
            (e.group_id, e.sibling) for _, _, e in events if isinstance(e, TrajectoryStarted)
        )
        assert max(starts.values()) == 1
        # Turns were salvaged: trajectories resumed under a new attempt in the new epoch.
        resumed = [e for _, ep, e in events if ep == new_epoch and isinstance(e, TrajectoryResumed)]
        assert resumed and sum(e.model_calls_reused for e in resumed) > 0
        assert stats.model_calls_reused > 0
        # Every completed trajectory: mask and versions agree with its turns.
        book = fold_trajectories((ep, e) for _, ep, e in events)
        completed = [e for _, _, e in events if isinstance(e, TrajectoryCompleted)]
        assert completed
        for ev in completed:
            arrays = decode_arrays(store.get_payload(RUN, ev.payload_id))
            traj = book[(ev.group_id, ev.sibling)]
            mask = arrays["loss_mask"].tolist()
            assert mask == traj.loss_mask()
            assert arrays["weight_versions"].tolist() == traj.token_versions()
            assert len(arrays["token_ids"]) == len(mask) == len(arrays["logprobs"])
            assert ev.model_tokens == sum(mask)
        # The restored run's history is sound: invariants after every decision, every
        # re-decidable decision re-decided, no prompt trained twice.
        state = replay(store, RUN).state
        check_invariants(state)
        assert check_history(store, RUN).violation is None
        assert verify_decisions(store, RUN).mismatch is None
        assert build_ledger(store, RUN).trained_twice == []
        assert state.train_step == 4
        assert killed_epoch_rows is not None and store.last_seq(RUN) > killed_epoch_rows
    finally:
        store.close()

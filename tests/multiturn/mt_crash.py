"""The crash-offset tests' shared parts: the run they crash, what a crash leaves of the
calculator's side effects, the checks after the restored run finished, and
:func:`run_until_killed`, a live run that SIGKILLs its process at an offset.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from mt_task import RUN, Ledger, runtime, start

from rolloutlog.controller.domain.events import CODEC
from rolloutlog.controller.domain.invariants import find_violations
from rolloutlog.controller.domain.trajectory import (
    TURN_EVENT_TYPES,
    ModelCallCompleted,
    ToolCallCompleted,
    ToolCallFailed,
    ToolCallRequested,
    TrajectoryCompleted,
    TrajectoryResumed,
    fold_trajectories,
)
from rolloutlog.controller.prompt_ledger import build_ledger, cross_check
from rolloutlog.controller.rollout_controller import RolloutController, replay
from rolloutlog.eventstore import EventStore, NewEvent, decode_arrays

WEIGHTS = [("w", torch.zeros(1))]
#: Train steps of the run the tests crash.
STEPS = 3


async def drive(ctl: RolloutController, ledger: Ledger, steps: int = STEPS) -> None:
    """Train to ``steps`` from the controller's step, a checkpoint after each."""
    rt, _, _ = runtime(ctl, ledger)
    await rt.start()
    try:
        await rt.sync_weights(WEIGHTS, ctl.state.weight_version)
        for step in range(ctl.state.train_step, steps):
            batch = await rt.next_batch(step, timeout=60)
            assert all(s.reward == 1.0 for s in batch.samples)
            await rt.report_trained(step, step + 1)
            await rt.publish_weights(WEIGHTS, step + 1)
            await rt.checkpoint(step + 1)
    finally:
        await rt.close()


def ran_by_the_crash(rows: Iterable[Any], ledger: Ledger) -> int:
    """Record in ``ledger`` the ``add`` calls whose request is durable in ``rows`` and
    which the ledger lacks: the process died just after their side effect (the harder
    case for a restore: a tool that ran, its result never recorded). Returns the offset
    of the newest checkpoint in ``rows`` (0 if none)."""
    ran = {key for key, _ in ledger.entries()}
    checkpoint = 0
    for r in rows:
        if r.type == "ToolCallRequested":
            data = json.loads(r.payload)
            if data["tool"] == "add" and data["idempotency_key"] not in ran:
                args = data["arguments"]
                ledger.add(args["a"], args["b"], data["idempotency_key"])
        elif r.type == "CheckpointMarked":
            checkpoint = r.seq
    return checkpoint


def check(store: Any, ledger: Ledger) -> dict[str, Any]:
    """What the finished run's log (every epoch) and the ledger say; every list empty and
    ``train_step == STEPS`` on a correct run (see :func:`failed`)."""
    events = [(r.epoch, CODEC.decode(r)) for r in store.read(RUN) if r.type in TURN_EVENT_TYPES]
    keys = Counter(k for k, _ in ledger.entries())
    results = Counter(
        e.idempotency_key for _, e in events if isinstance(e, ToolCallCompleted | ToolCallFailed)
    )
    calls = Counter(
        (e.group_id, e.sibling, e.turn) for _, e in events if isinstance(e, ModelCallCompleted)
    )
    requested = {e.idempotency_key for _, e in events if isinstance(e, ToolCallRequested)}
    book = fold_trajectories(events)
    bad_masks = []
    for _, ev in events:
        if isinstance(ev, TrajectoryCompleted):
            arrays = decode_arrays(store.get_payload(RUN, ev.payload_id))
            traj = book[(ev.group_id, ev.sibling)]
            if (
                arrays["loss_mask"].tolist() != traj.loss_mask()
                or arrays["weight_versions"].tolist() != traj.token_versions()
            ):
                bad_masks.append((ev.group_id, ev.sibling))
    state = replay(store, RUN).state
    ledger_check = cross_check(build_ledger(store, RUN), state)
    return {
        "tools_run_twice": sorted(k for k, n in keys.items() if n > 1),
        "results_twice": sorted(k for k, n in results.items() if n > 1),
        "unrequested_runs": sorted(set(keys) - requested),
        "model_calls_regenerated": sorted(c for c, n in calls.items() if n > 1),
        "bad_masks": bad_masks,
        "lost": ledger_check.lost,
        "trained_twice": ledger_check.trained_twice,
        "violations": [str(v) for v in find_violations(state)],
        "train_step": state.train_step,
    }


def failed(result: dict[str, Any]) -> bool:
    return (
        any(v for key, v in result.items() if key != "train_step") or result["train_step"] != STEPS
    )


def model_calls_reused(store: Any) -> int:
    """Model calls the restores took over instead of regenerating them."""
    return sum(
        e.model_calls_reused
        for e in (CODEC.decode(r) for r in store.read(RUN) if r.type == "TrajectoryResumed")
        if isinstance(e, TrajectoryResumed)
    )


class CrashingStore(EventStore):
    """A store whose process dies right after the commit that reaches ``crash_at`` (the
    log is durable to there, nothing after it is written)."""

    crash_at = 0

    def append(self, run_id: str, batch: Sequence[NewEvent], **kwargs: Any) -> int:
        last = super().append(run_id, batch, **kwargs)
        if batch and last >= self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return last


def run_until_killed(url: str, ledger: Ledger, crash_at: int) -> None:
    """Start the run at ``url`` (checkpoint at 0, then after every step, as
    :func:`drive`) and SIGKILL this process right after the commit that makes offset
    ``crash_at`` durable: the log then ends at that commit, as a real crash leaves it (a
    transaction is durable whole or not at all). Returns only if the run finished first."""
    store = CrashingStore.open(url)
    store.crash_at = crash_at
    ctl = start(store)
    ctl.checkpoint(0)
    asyncio.run(drive(ctl, ledger))
    ctl.close()
    store.close()

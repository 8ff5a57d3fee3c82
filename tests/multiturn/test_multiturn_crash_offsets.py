"""Crash a multi-turn run at many offsets: for each k the log ends at k (the tools whose
request is durable by k ran: the harder case, a run without its result), the trainer
comes back from the newest checkpoint at or before k, and the run finishes. No tool runs
twice, no completed model call is regenerated, every trajectory's mask and versions
agree with its turns, and every prompt is trained exactly once."""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from mt_task import ROLLOUT, RUN, STORE, Ledger, Prompts, runtime, start

from rolloutlog.controller.domain.events import CODEC
from rolloutlog.controller.domain.invariants import find_violations
from rolloutlog.controller.domain.trajectory import (
    TURN_EVENT_TYPES,
    ModelCallCompleted,
    ToolCallCompleted,
    ToolCallFailed,
    ToolCallRequested,
    TrajectoryCompleted,
    fold_trajectories,
)
from rolloutlog.controller.prompt_ledger import build_ledger, cross_check
from rolloutlog.controller.rollout_controller import RolloutController, replay
from rolloutlog.controller.rollout_index import attach as attach_index
from rolloutlog.controller.rollout_index import read_indexed
from rolloutlog.eventstore import MemoryEventStore, NewEvent, decode_arrays

WEIGHTS = [("w", torch.zeros(1))]
STEPS = 3


async def _drive(ctl: RolloutController, ledger: Ledger, steps: int) -> None:
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


@pytest.fixture(scope="module")
def base_log(tmp_path_factory: pytest.TempPathFactory) -> MemoryEventStore:
    store = MemoryEventStore()
    ctl = start(store)
    ctl.checkpoint(0)
    asyncio.run(_drive(ctl, Ledger(tmp_path_factory.mktemp("base") / "ledger.tsv"), STEPS))
    ctl.close()
    return store


def _crashed_at(base: MemoryEventStore, k: int, ledger: Ledger) -> tuple[MemoryEventStore, int]:
    """The log a crash at k left, its payloads, and the ledger of the tools that ran by
    then; the offset of the newest checkpoint at or before k."""
    info = base.get_run(RUN)
    target = MemoryEventStore()
    target.create_run(RUN, config_fingerprint=info.config_fingerprint, config_json=info.config_json)
    rows = list(read_indexed(base, RUN, 1, k))
    attach_index(target)  # the index is written with its events, as the controller's store does
    target.append(
        RUN,
        [
            NewEvent(
                r.type,
                r.schema_version,
                r.payload,
                r.recorded_at,
                (r.group_id, r.prompt_index, r.target_step, r.train_step, r.weight_version),
            )
            for r in rows
        ],
        expected_seq=1,
        epoch=1,
    )
    checkpoint = 0
    for r in base.read(RUN, 1, k):
        data = json.loads(r.payload)
        if data.get("payload_id"):
            pid = data["payload_id"]
            target.put_payload(RUN, pid, "x", base.get_payload(RUN, pid))
        if r.type == "ToolCallRequested" and data["tool"] == "add":
            args = data["arguments"]
            ledger.add(args["a"], args["b"], data["idempotency_key"])  # it ran by the crash
        if r.type == "CheckpointMarked":
            checkpoint = r.seq
    assert checkpoint, f"no checkpoint at or before {k}"
    return target, checkpoint


def _check(store: MemoryEventStore, ledger: Ledger) -> dict[str, Any]:
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
    check = cross_check(build_ledger(store, RUN), state)
    return {
        "tools_run_twice": sorted(k for k, n in keys.items() if n > 1),
        "results_twice": sorted(k for k, n in results.items() if n > 1),
        "unrequested_runs": sorted(set(keys) - requested),
        "model_calls_regenerated": sorted(c for c, n in calls.items() if n > 1),
        "bad_masks": bad_masks,
        "lost": check.lost,
        "trained_twice": check.trained_twice,
        "violations": [str(v) for v in find_violations(state)],
        "train_step": state.train_step,
    }


def _offsets(base: MemoryEventStore) -> list[int]:
    stride = 1 if os.environ.get("ROLLOUTLOG_CRASH_ALL") else 6
    return list(range(3, base.last_seq(RUN) + 1, stride))


@pytest.mark.slow
def test_crash_a_multi_turn_run_at_many_offsets(base_log: MemoryEventStore, tmp_path: Path) -> None:
    offsets = _offsets(base_log)
    assert len(offsets) > 30
    failures = []
    salvaged = 0
    for k in offsets:
        ledger = Ledger(tmp_path / f"ledger-{k}.tsv")
        crashed, checkpoint = _crashed_at(base_log, k, ledger)
        ctl, _ = RolloutController.restore(
            crashed,
            RUN,
            checkpoint,
            rollout=ROLLOUT,
            dataset_fingerprint=Prompts.fingerprint,
            store_config=STORE,
        )
        asyncio.run(_drive(ctl, ledger, STEPS))
        ctl.close()
        result = _check(crashed, ledger)
        salvaged += sum(
            CODEC.decode(r).model_calls_reused  # type: ignore[attr-defined]
            for r in crashed.read(RUN)
            if r.type == "TrajectoryResumed"
        )
        if (
            any(v for key, v in result.items() if key != "train_step")
            or result["train_step"] != STEPS
        ):
            failures.append((k, result))
    assert not failures, failures[:3]
    assert salvaged > 0  # turns were resumed, not regenerated

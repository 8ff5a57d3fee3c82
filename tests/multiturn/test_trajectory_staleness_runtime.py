"""The per-trajectory staleness policy on the runtime: weights published mid-conversation.

Rollout: one sibling per group, one group per step, lookahead 2, so the groups of steps
1 and 2 are dispatched under version 0 and live through the publishes of versions 1 and
2. The scripted model answers in four turns (``add``, ``add`` again, ``submit``, ``ok.``).
The ``add`` of turn ``j`` waits until the engine serves version ``min(j + 1, target
step)`` (never a version that needs the group itself trained), and the trainer publishes
version ``v`` only once every started trajectory of a later step has made ``v`` model
calls (or is finished or abandoned). So the group of step 2 makes turn 0 under version
0, turn 1 under version 1 and would make turn 2 under version 2, every run.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from mt_task import RUN, TOKENIZER, Ledger, runtime

from rolloutlog.controller.backends.base import GroupRequest, SiblingSpec
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.domain.events import CODEC, SiblingAborted
from rolloutlog.controller.domain.trajectory import (
    TURN_EVENT_TYPES,
    ModelCallCompleted,
    ToolCallRequested,
    TrajectoryCompleted,
    TrajectoryResumed,
    TrajectoryStarted,
    TrajectoryTooStale,
    fold_trajectories,
)
from rolloutlog.controller.environments import Tool
from rolloutlog.controller.multiturn import MultiTurnConfig, TrajectoryBackend
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.sql_audit import SqlAudit
from rolloutlog.eventstore import EventStore, decode_arrays

WEIGHTS = [("w", torch.zeros(1))]
ROLLOUT = RolloutConfig(group_size=1, groups_per_step=1, lookahead=2, staleness_bound=6)
STEPS = 3
DEADLINE_S = 30.0


def script(request: GroupRequest, spec: SiblingSpec) -> list[int]:
    ctx = TOKENIZER.decode(request.prompt_token_ids)
    if "<tool>submit" in ctx:
        return TOKENIZER.encode("ok.")
    a, b = (int(x) for x in re.match(r"(\d)\+(\d)=", ctx).groups())  # type: ignore[union-attr]
    if ctx.count("<tool>add") < 2:
        return TOKENIZER.encode(f'<tool>add {{"a":{a},"b":{b}}}</tool>')
    return TOKENIZER.encode(f'<tool>submit {{"answer":{a + b}}}</tool>')


async def _until(ok: Any, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not ok():
        if loop.time() > deadline:
            raise TimeoutError(f"waited {DEADLINE_S} s for {what}")
        await asyncio.sleep(0.005)


def _setup(ctl: RolloutController, ledger: Ledger, config: MultiTurnConfig) -> Any:
    # A restored run's engine serves the published weights (as a restore loads them).
    rt, multi, inner = runtime(ctl, ledger, weight_version=ctl.state.published_version)
    inner.script = script
    multi.config = config

    async def add(a: int, b: int, idempotency_key: str) -> str:
        gid = int(idempotency_key.split("/g")[1].split("/")[0])
        turn = int(idempotency_key.split("/t")[1].split("/")[0])
        group = ctl.state.groups.get(gid)
        target = 0 if group is None or group.target_step is None else group.target_step
        need = min(turn + 1, target)
        await _until(lambda: inner.weight_version >= need, f"weights {need}")
        return ledger.add(a, b, idempotency_key)

    multi.tools = (Tool("add", add, status=ledger.status),)
    return rt, multi


def _ready_to_publish(ctl: RolloutController, multi: TrajectoryBackend, version: int) -> bool:
    groups = ctl.state.groups
    for (gid, _), traj in multi.book.items():
        group = groups.get(gid)
        if group is None or group.target_step is None or group.target_step < version:
            continue
        if not (traj.turns >= version or traj.completed or traj.abandoned):
            return False
    return True


async def _train(ctl: RolloutController, ledger: Ledger, config: MultiTurnConfig) -> Any:
    rt, multi = _setup(ctl, ledger, config)
    await rt.start()
    try:
        for step in range(ctl.state.train_step, STEPS):
            await rt.next_batch(step, timeout=60)
            await rt.report_trained(step, step + 1)
            await _until(lambda s=step: _ready_to_publish(ctl, multi, s + 1), "turns")
            await rt.publish_weights(WEIGHTS, step + 1)
    finally:
        await rt.close()
    return multi


def _start(store: EventStore) -> RolloutController:
    return RolloutController.start(
        store,
        RUN,
        ROLLOUT,
        dataset_fingerprint="multi-turn-add",
        dataset_size=10_000,
        store_config=StoreConfig(group_commit_window_ms=2, snapshot_interval=0),
    )


def _steps(rows: list[Any]) -> dict[int, int]:
    """Target step by group id (GroupAdmitted)."""
    out = {}
    for r in rows:
        if r.type == "GroupAdmitted":
            ev = CODEC.decode(r)
            out[ev.group_id] = ev.target_step  # type: ignore[attr-defined]
    return out


def _check_log(store: EventStore, ledger: Ledger, bound: int | None) -> dict[str, Any]:
    """What every policy must keep true; returns the log's pieces for the policy's checks."""
    rows = list(store.read(RUN))
    turn_events = [(r.epoch, CODEC.decode(r)) for r in rows if r.type in TURN_EVENT_TYPES]
    events = [e for _, e in turn_events]
    book = fold_trajectories(turn_events)
    # Each completion's per-token versions are its model calls', in context order.
    completed = [e for e in events if isinstance(e, TrajectoryCompleted)]
    assert completed
    for ev in completed:
        arrays = decode_arrays(store.get_payload(RUN, ev.payload_id))
        mask, versions = arrays["loss_mask"].tolist(), arrays["weight_versions"].tolist()
        traj = book[(ev.group_id, ev.sibling)]
        if traj.completed and traj.final_reward == ev.final_reward:
            assert versions == traj.token_versions() and mask == traj.loss_mask()
        used = {v for v in versions if v >= 0}
        assert (min(used), max(used)) == (ev.oldest_weight_version, ev.newest_weight_version)
        assert all((v >= 0) == bool(m) for v, m in zip(versions, mask, strict=True))
        if bound is not None:
            assert len(used) <= bound, f"group {ev.group_id} spans {sorted(used)}"
    # A model call per (trajectory, turn), again only for a turn a restart abandoned.
    started: dict[tuple[int, int], int] = {}
    calls: Counter[tuple[int, int, int, int]] = Counter()
    abandoned: Counter[tuple[int, int, int, int]] = Counter()
    turns: dict[tuple[int, int], int] = {}
    for i, ev in enumerate(events):
        key = (ev.group_id, ev.sibling)
        if isinstance(ev, TrajectoryStarted):
            started[key] = i
        elif isinstance(ev, ModelCallCompleted):
            calls[(*key, started[key], ev.turn)] += 1
            turns[key] = ev.turn + 1
        elif isinstance(ev, TrajectoryTooStale) and ev.outcome == "restarted":
            for t in range(ev.turns_kept, ev.turns_kept + ev.turns_abandoned):
                abandoned[(*key, started[key], t)] += 1
    assert all(n == 1 + abandoned[k] for k, n in calls.items()), calls
    # Each tool call ran once, under a key no other call has (abandoned ones included).
    keys = [k for k, _ in ledger.entries()]
    requested = [e.idempotency_key for e in events if isinstance(e, ToolCallRequested)]
    assert len(keys) == len(set(keys)) and len(requested) == len(set(requested))
    assert set(keys) <= set(requested)
    stale = [e for e in events if isinstance(e, TrajectoryTooStale)]
    return {"rows": rows, "events": events, "book": book, "stale": stale}


@pytest.mark.parametrize("policy", ["keep", "abort", "restart"])
def test_a_trajectory_spanning_too_many_versions_gets_its_policy(
    db_url: str, tmp_path: Path, policy: str
) -> None:
    bound = 1 if policy != "restart" else 2
    config = MultiTurnConfig(
        max_turns=6,
        max_tokens_per_turn=40,
        max_weight_versions=bound,
        on_too_many_versions=policy,  # type: ignore[arg-type]
        restart_after_turn=0,
    )
    store = EventStore.open(db_url)
    ctl = _start(store)
    ledger = Ledger(tmp_path / "ledger.tsv")
    multi = asyncio.run(_train(ctl, ledger, config))
    ctl.close()
    log = _check_log(store, ledger, None if policy == "keep" else bound)
    stale, events, rows = log["stale"], log["events"], log["rows"]
    assert stale and all(e.policy == policy and e.max_weight_versions == bound for e in stale)
    # The SQL views say the same: one too_stale row per decision, by outcome, and each
    # trajectory's newest decision and abandoned turns.
    audit = SqlAudit(db_url, allow_privileged_role=True)
    try:
        by_outcome = audit.select(
            "SELECT outcome, COUNT(*) AS n FROM turns WHERE run_id = :run_id "
            "AND kind = 'too_stale' GROUP BY outcome",
            {"run_id": RUN},
            limit=None,
        ).rows
        trajectories = audit.select(
            "SELECT group_id, stale_outcome, turns_abandoned FROM trajectories "
            "WHERE run_id = :run_id AND stale_outcome IS NOT NULL",
            {"run_id": RUN},
            limit=None,
        ).rows
    finally:
        audit.close()
    assert {r["outcome"]: r["n"] for r in by_outcome} == Counter(e.outcome for e in stale)
    assert sum(r["turns_abandoned"] for r in trajectories) == sum(e.turns_abandoned for e in stale)
    assert {r["group_id"] for r in trajectories} == {e.group_id for e in stale}
    if policy == "keep":
        assert all(e.outcome == "kept" and e.turns_abandoned == 0 for e in stale)
        assert multi.stats.trajectories_kept_stale == len(stale)
        # Once per trajectory, and on versions its calls used.
        assert len({(e.group_id, e.sibling, e.attempt) for e in stale}) == len(stale)
        assert all(e.next_version is None and len(e.versions) > bound for e in stale)
        # The group of step 2 spans versions 0, 1 and 2 and was trained.
        steps = _steps(rows)
        (done,) = [
            e for e in events if isinstance(e, TrajectoryCompleted) and steps[e.group_id] == 2
        ]
        assert (done.oldest_weight_version, done.newest_weight_version) == (0, 2)
    elif policy == "abort":
        assert all(e.outcome == "aborted" and e.turns_kept == 0 for e in stale)
        assert multi.stats.trajectories_aborted_stale == len(stale)
        aborts = [CODEC.decode(r) for r in rows if r.type == "SiblingAborted"]
        for ev in stale:
            # The attempt was aborted naming the policy, and counted as a backend abort.
            (abort,) = [
                a
                for a in aborts
                if isinstance(a, SiblingAborted)
                and (a.group_id, a.sibling, a.attempt) == (ev.group_id, ev.sibling, ev.attempt)
            ]
            assert abort.reason.startswith("aborted by the backend: too stale:")
            assert "policy abort" in abort.reason
            # The next attempt started a new trajectory: nothing of the old one resumed.
            later = [
                e
                for e in events
                if isinstance(e, TrajectoryStarted | TrajectoryResumed)
                and (e.group_id, e.sibling) == (ev.group_id, ev.sibling)
                and e.attempt > ev.attempt
            ]
            assert later and isinstance(later[0], TrajectoryStarted)
        assert not any(isinstance(e, TrajectoryResumed) for e in events)
        assert {_steps(rows)[e.group_id] for e in stale} >= {1, 2}
    else:
        restarted = [e for e in stale if e.outcome == "restarted"]
        assert restarted and all(e.turns_kept == 1 for e in restarted)
        assert multi.stats.trajectories_restarted == len(restarted)
        assert multi.stats.turns_abandoned == sum(e.turns_abandoned for e in stale)
        # The same attempt went on: turn 1 again, under the new weights, new tool keys.
        ev = restarted[0]
        after = events[events.index(ev) + 1 :]
        redo = next(
            e
            for e in after
            if isinstance(e, ModelCallCompleted) and (e.group_id, e.sibling) == (ev.group_id, 0)
        )
        assert redo.turn == 1 and redo.attempt == ev.attempt and redo.weight_version == 2
        new_keys = [
            e.idempotency_key
            for e in after
            if isinstance(e, ToolCallRequested) and e.group_id == ev.group_id
        ]
        assert new_keys and all("/r1/" in k for k in new_keys)
        # The completed trajectory holds turn 0 and the new turns only.
        done = [
            e for e in after if isinstance(e, TrajectoryCompleted) and e.group_id == ev.group_id
        ]
        arrays = decode_arrays(store.get_payload(RUN, done[0].payload_id))
        text = TOKENIZER.decode(arrays["token_ids"].tolist())
        assert text.count("<tool>add") == 2 and text.endswith("ok.")
        assert sorted({v for v in arrays["weight_versions"].tolist() if v >= 0}) == [0, 2]
    store.close()


def test_a_restore_after_a_restart_does_not_reuse_the_abandoned_turns(
    sqlite_url: str, tmp_path: Path
) -> None:
    """The run stops right after a restart is recorded (mid-conversation); the restored
    run's backend folds the log without the abandoned turns, resumes from the kept ones,
    and finishes the trajectory within the bound."""
    config = MultiTurnConfig(
        max_turns=6,
        max_tokens_per_turn=40,
        max_weight_versions=2,
        on_too_many_versions="restart",
        restart_after_turn=0,
    )
    store = EventStore.open(sqlite_url)
    ctl = _start(store)
    ledger = Ledger(tmp_path / "ledger.tsv")

    async def first() -> None:
        rt, multi = _setup(ctl, ledger, config)
        await rt.start()
        try:
            for step in range(2):
                await rt.next_batch(step, timeout=60)
                await rt.report_trained(step, step + 1)
                await _until(lambda s=step: _ready_to_publish(ctl, multi, s + 1), "turns")
                await rt.publish_weights(WEIGHTS, step + 1)
            await _until(lambda: multi.stats.trajectories_restarted > 0, "a restart")
        finally:
            await rt.close()

    asyncio.run(first())
    ctl.close()
    rows = list(store.read(RUN))
    events = [CODEC.decode(r) for r in rows if r.type in TURN_EVENT_TYPES]
    (restart,) = [e for e in events if isinstance(e, TrajectoryTooStale)]
    key = (restart.group_id, restart.sibling)
    ctl = RolloutController.open(store, RUN)
    multi = asyncio.run(_train(ctl, ledger, config))
    ctl.close()
    log = _check_log(store, ledger, 2)
    events = log["events"]
    resumed = [
        e for e in events if isinstance(e, TrajectoryResumed) and (e.group_id, e.sibling) == key
    ]
    assert resumed and multi.stats.trajectories_resumed >= 1
    # It reused turn 0 and what the restarted attempt made after it, never the abandoned.
    first_resume = events.index(resumed[0])
    made = [
        e
        for e in events[events.index(restart) + 1 : first_resume]
        if isinstance(e, ModelCallCompleted) and (e.group_id, e.sibling) == key
    ]
    assert resumed[0].model_calls_reused == restart.turns_kept + len(made)
    traj = log["book"][key]
    assert traj.completed and traj.weight_versions() <= {0, 2} and 1 not in traj.weight_versions()
    store.close()

"""``rolloutlog demo --backend fake-fleet --engines 2 --kill-engine``: the worker's fleet
of fake HTTP engines loses one engine with work in flight; its attempts are re-dispatched
on the other, the restarted engine is refit before it serves, the worker is then
SIGKILLed and resumed, and the summary (from the log) shows the engine loss and no
prompt lost or trained twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rolloutlog.controller.rollout_controller import iter_history
from rolloutlog.eventstore import EventStore

from .conftest import rolloutlog


def test_fake_fleet_demo_with_an_engine_killed(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'log.db'}"
    proc = rolloutlog(
        "demo",
        "--json",
        "--backend",
        "fake-fleet",
        "--engines",
        "2",
        "--kill-engine",
        "--steps",
        "10",
        "--checkpoint-every",
        "5",
        "--workdir",
        str(tmp_path / "work"),
        "--db",
        db,
        timeout=300,
    )
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True
    assert summary["steps_trained"] == 10
    assert summary["engines"] == 2
    assert summary["engines_lost"] == 1
    assert summary["engines_refit"] >= 1
    assert summary["siblings_redispatched_after_engine_loss"] >= 1
    assert summary["prompts_lost"] == 0 and summary["prompts_trained_twice"] == 0
    assert summary["invariant_violations"] == []
    with EventStore.open(db) as store:
        history = [ev for _row, ev in iter_history(store, summary["run_id"])]
    # Every sample carries the engine that generated it and the weight version it was
    # dispatched with (the version published at dispatch).
    dispatched = {
        (ev.group_id, ev.sibling, ev.attempt): ev.weight_version
        for ev in history
        if ev.event_type == "SiblingDispatched"
    }
    completed = [ev for ev in history if ev.event_type == "SiblingCompleted"]
    assert completed
    for ev in completed:
        if ev.salvaged_from is None:
            assert ev.engine_id in {"engine-0", "engine-1"}
            assert ev.weight_version == dispatched[(ev.group_id, ev.sibling, ev.attempt)]
    # The restarted engine served nothing between its rejoin and its refit.
    joins = [i for i, ev in enumerate(history) if ev.event_type == "EngineJoined"]
    lost_at = next(i for i, ev in enumerate(history) if ev.event_type == "EngineLost")
    rejoin = next(i for i in joins if i > lost_at and history[i].engine_id == "engine-1")
    refit = next(
        i
        for i, ev in enumerate(history)
        if i > rejoin and ev.event_type == "EngineRefit" and ev.engine_id == "engine-1"
    )
    assert not any(
        ev.event_type == "SiblingCompleted" and ev.engine_id == "engine-1"
        for ev in history[rejoin:refit]
    )


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1600)  # above the demo's own 1,500 s deadline (pytest's default is 600)
def test_vllm_fleet_demo_with_an_engine_sigkilled(tmp_path: Path) -> None:
    """Two real vLLM servers; one is SIGKILLed with work in flight and restarted."""
    pytest.importorskip("vllm")
    db = f"sqlite:///{tmp_path / 'log.db'}"
    proc = rolloutlog(
        "demo",
        "--json",
        "--backend",
        "vllm-fleet",
        "--engines",
        "2",
        "--kill-engine",
        "--steps",
        "10",
        "--checkpoint-every",
        "5",
        "--workdir",
        str(tmp_path / "work"),
        "--db",
        db,
        timeout=1500,
    )
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True and summary["steps_trained"] == 10
    assert summary["engines"] == 2 and summary["engines_lost"] >= 1
    assert summary["siblings_redispatched_after_engine_loss"] >= 1
    assert summary["prompts_lost"] == 0 and summary["prompts_trained_twice"] == 0
    with EventStore.open(db) as store:
        history = [ev for _row, ev in iter_history(store, summary["run_id"])]
    dispatched = {
        (ev.group_id, ev.sibling, ev.attempt): ev.weight_version
        for ev in history
        if ev.event_type == "SiblingDispatched"
    }
    for ev in history:
        if ev.event_type == "SiblingCompleted" and ev.salvaged_from is None:
            assert ev.weight_version == dispatched[(ev.group_id, ev.sibling, ev.attempt)]

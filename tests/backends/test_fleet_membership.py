"""Engine membership in the log: a runtime over a fleet of fake engines, one killed.

The runtime installs an EngineMembershipRecorder on the fleet: joins, the loss (with
the attempts in flight on the dead engine) and refits become events; completions carry
the engine id; the lost engine's attempts are re-dispatched and finish on the other
engine; the restarted engine serves nothing before its refit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rolloutlog.controller import replay_tool as rt
from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.backends.fake_engine import FakeEngineServer
from rolloutlog.controller.backends.fleet import EngineHealth, FleetBackend
from rolloutlog.controller.backends.vllm_server import VLLMServerBackend
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.domain.invariants import check_invariants
from rolloutlog.controller.rollout_controller import RolloutController, iter_history, replay
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.eventstore import EventStore

MAX_MODEL_LEN = 64


class _Prompts:
    fingerprint = "fleet-membership"
    num_prompts = 400

    def prompt_token_ids(self, index: int) -> list[int]:
        return [3 + index % 13, 4]

    def reward(self, index: int, completion_token_ids: Sequence[int]) -> float:
        return float(len(completion_token_ids) % 2)


def _engine(port: int = 0) -> FakeEngineServer:
    return FakeEngineServer(
        DeterministicBackend(vocab_size=55, max_model_len=MAX_MODEL_LEN, eos_token_id=2),
        latency=0.2,
        max_model_len=MAX_MODEL_LEN,
        port=port,
    )


async def _until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


def test_engine_loss_is_logged_and_its_attempts_finish_elsewhere(
    tiny_model_dir: Path, db_url: str, base_weights: dict[str, torch.Tensor]
) -> None:
    store = EventStore.open(db_url)
    ctl = RolloutController.start(
        store,
        "r",
        RolloutConfig(group_size=2, groups_per_step=2, lookahead=1, staleness_bound=1),
        dataset_fingerprint=_Prompts.fingerprint,
        dataset_size=_Prompts.num_prompts,
        store_config=StoreConfig(snapshot_interval=0, group_commit_window_ms=1),
    )

    async def go() -> None:
        servers = [_engine(), _engine()]
        for s in servers:
            await s.start()
        fleet = FleetBackend(
            [
                VLLMServerBackend(s.url, model_dir=tiny_model_dir, engine_id=f"e{i}")
                for i, s in enumerate(servers)
            ],
            model_dir=tiny_model_dir,
            health_interval=0.05,
            dead_after=2,
            # The fake servers share this loop: a stall of a loaded machine must not time
            # out e0's probes (a stopped e1 refuses connections at once).
            health_timeout=10.0,
        )
        runtime = RolloutRuntime(ctl, fleet, _Prompts(), GenerationConfig(max_tokens=3))
        await runtime.start()
        try:
            for step in range(6):
                if step == 2:
                    await _until(lambda: servers[1]._tasks, 10, "requests on e1")
                    await servers[1].stop()  # e1 dies with requests in flight
                    await _until(lambda: fleet.health()["e1"] is EngineHealth.DEAD, 10, "e1 dead")
                    servers[1] = _engine(servers[1].port)
                    await servers[1].start()  # restarted: stale until refit
                batch = await runtime.next_batch(step, timeout=30)
                assert len(batch.group_ids) == 2
                await runtime.report_trained(step, step + 1)
                await runtime.publish_weights(base_weights.items(), step + 1)
            await _until(lambda: fleet.health()["e1"] is EngineHealth.HEALTHY, 10, "e1 refit")
            assert runtime.membership is not None
            assert runtime.membership.stats.lost == 1
            assert runtime.membership.stats.rejected == 0
        finally:
            await runtime.close()
            await fleet.close()
            for s in servers:
                await s.stop()

    try:
        asyncio.run(asyncio.wait_for(go(), timeout=90))
        ctl.close()
        history = [ev for _row, ev in iter_history(store, "r")]
        joined = [ev.engine_id for ev in history if ev.event_type == "EngineJoined"]
        assert sorted(joined) == ["e0", "e1", "e1"]
        (lost,) = [ev for ev in history if ev.event_type == "EngineLost"]
        assert lost.engine_id == "e1" and lost.in_flight
        # Each attempt in flight on e1 failed retryably and a later attempt finished.
        for rid in lost.in_flight:
            g, s, a = (int(p[1:]) for p in rid.split("-"))
            failed = [
                ev
                for ev in history
                if ev.event_type in ("SiblingFailed", "SiblingAborted")
                and (ev.group_id, ev.sibling, ev.attempt) == (g, s, a)
            ]
            assert failed, f"attempt {rid} on the lost engine never ended"
            assert any(
                ev.event_type == "SiblingDispatched"
                and (ev.group_id, ev.sibling) == (g, s)
                and ev.attempt > a
                for ev in history
            ), f"{rid} was not re-dispatched"
        # The restarted e1 serves nothing between its rejoin and its refit.
        rejoin = [i for i, ev in enumerate(history) if ev.event_type == "EngineJoined"][-1]
        refits = [
            i
            for i, ev in enumerate(history)
            if ev.event_type == "EngineRefit" and ev.engine_id == "e1" and i > rejoin
        ]
        assert refits, "the restarted engine was never refit"
        assert not any(
            ev.event_type == "SiblingCompleted" and ev.engine_id == "e1"
            for ev in history[rejoin : refits[0]]
        )
        completed = [ev for ev in history if ev.event_type == "SiblingCompleted"]
        assert completed and {ev.engine_id for ev in completed} <= {"e0", "e1"}
        state = replay(store, "r").state
        check_invariants(state)
        assert state.engines["e1"].losses == 1 and not state.engines["e1"].lost
        assert state.counters.engines_lost == 1
        # The audit views answer "which engine generated this sample" and "what was in
        # flight on e1 when it died".
        with store.engine.connect() as conn:
            samples = conn.exec_driver_sql(
                "SELECT group_id, sibling, attempt, engine_id FROM sample_engines "
                "WHERE run_id = 'r'"
            ).all()
            died = conn.exec_driver_sql(
                "SELECT request_id FROM engine_lost_attempts WHERE engine_id = 'e1'"
            ).all()
            membership = conn.exec_driver_sql(
                "SELECT type, engine_id, in_flight_count FROM engine_membership ORDER BY seq"
            ).all()
        assert sorted(tuple(r) for r in samples) == sorted(
            (ev.group_id, ev.sibling, ev.attempt, ev.engine_id) for ev in completed
        )
        assert [r[0] for r in died] == lost.in_flight
        assert ("EngineLost", "e1", len(lost.in_flight)) in [tuple(r) for r in membership]
        # replay --explain of a group that lost an attempt shows the loss; re-deciding
        # every decision (engine membership included) reproduces the log.
        lost_group = int(lost.in_flight[0].split("-")[0][1:])
        explained = rt.explain(store, "r", group_id=lost_group)
        assert "EngineLost" in [e["type"] for e in explained]
        assert rt.verify_decisions(store, "r").mismatch is None
        assert rt.check_history(store, "r").violation is None
    finally:
        store.close()

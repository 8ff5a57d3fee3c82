"""Multi-turn trajectories on the real vLLM server fleet (the session's two engines):
one engine is SIGKILLed while a trajectory's model call of a later turn runs on it.
Only that call is sent again, within the same attempt, and the other engine answers it;
the turns already recorded are never generated again.

The tiny model writes garbage text, so the tool protocol is a deterministic parse:
every output calls ``count`` once; a trajectory ends at ``max_turns``."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from rolloutlog.controller.backends.fleet import EngineHealth, FleetBackend
from rolloutlog.controller.backends.vllm_server import VLLMServerBackend
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.domain.events import CODEC
from rolloutlog.controller.domain.trajectory import (
    TURN_EVENT_TYPES,
    ModelCallCompleted,
    TrajectoryCompleted,
    TrajectoryResumed,
    fold_trajectories,
)
from rolloutlog.controller.environments import Tool, ToolCall
from rolloutlog.controller.multiturn import MultiTurnConfig, MultiTurnPrompts, TrajectoryBackend
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.eventstore import EventStore, decode_arrays
from rolloutlog.grpo.multiturn_task import CalculatorPrompts, TextTokenizer
from rolloutlog.grpo.tiny_model import load_policy

from .conftest import MAX_MODEL_LEN

RUN = "mt-fleet"
VICTIM, OTHER = "engine-1", "engine-0"
_RID = re.compile(r"g(\d+)-s(\d+)-a(\d+)-")  # then a nonce and a counter


def count(n: int) -> str:
    return f" {n} chars "


def parse(text: str) -> list[ToolCall]:
    return [ToolCall("count", {"n": len(text)})]


@pytest.mark.vllm
@pytest.mark.slow
def test_an_engine_killed_mid_turn_resends_only_that_turn_on_the_other_engine(
    vllm_server_engines: Any, tiny_model_dir: Path, sqlite_url: str
) -> None:
    launcher = vllm_server_engines
    _, hf_tokenizer = load_policy(tiny_model_dir)
    prompts = CalculatorPrompts(hf_tokenizer, 64)
    store = EventStore.open(sqlite_url)
    ctl = RolloutController.start(
        store,
        RUN,
        RolloutConfig(group_size=2, groups_per_step=4, lookahead=0, staleness_bound=1),
        dataset_fingerprint=prompts.fingerprint,
        dataset_size=prompts.num_prompts,
        store_config=StoreConfig(group_commit_window_ms=2, snapshot_interval=0),
    )
    fleet = FleetBackend(
        [
            VLLMServerBackend(
                e.url, model_dir=tiny_model_dir, max_model_len=MAX_MODEL_LEN, engine_id=e.engine_id
            )
            for e in launcher.engines
        ],
        model_dir=tiny_model_dir,
        health_interval=0.2,
        dead_after=2,
        auto_refit=True,  # an engine another test left with other weights: start-up ones
    )
    multi = TrajectoryBackend(
        fleet,
        TextTokenizer(hf_tokenizer),
        tools=[Tool("count", count)],
        config=MultiTurnConfig(
            max_turns=3, max_tokens_per_turn=40, max_context_tokens=MAX_MODEL_LEN
        ),
        parse=parse,
    )
    multi.attach(ctl)
    rt = RolloutRuntime(
        ctl,
        multi,
        MultiTurnPrompts(prompts, multi),
        GenerationConfig(max_tokens=MAX_MODEL_LEN - 8, max_in_flight_siblings=8),
    )
    assert rt.membership is not None  # the wrapped fleet's engines are recorded
    killed: list[tuple[int, int, int, int]] = []  # (group, sibling, attempt, turn) in flight

    async def kill_mid_turn() -> None:
        """SIGKILL the victim as soon as it runs a model call of turn 1 or later."""
        victim = next(e for e in fleet.engines if e.engine_id == VICTIM)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            for rid in victim.backend.in_flight_request_ids():
                g, s, a = (int(x) for x in _RID.match(rid).groups())  # type: ignore[union-attr]
                traj = multi.book.get((g, s))
                if traj is not None and traj.turns >= 1 and not traj.completed:
                    killed.append((g, s, a, traj.turns))
            if killed:
                launcher.kill(VICTIM, signal.SIGKILL)
                return
            await asyncio.sleep(0.005)
        raise AssertionError("no model call of a later turn ran on the victim engine")

    async def drive() -> None:
        await rt.start()
        killer = asyncio.ensure_future(kill_mid_turn())
        try:
            # Eight trajectories of three turns, all dispatched at once (lookahead 0).
            await rt.next_batch(0, timeout=240)
            assert killer.done(), "the batch completed before a later turn ran on the victim"
            await killer
            # The probes declare the victim dead: its loss is recorded with what it held.
            deadline = time.monotonic() + 60
            while fleet.health()[VICTIM] is not EngineHealth.DEAD:
                assert time.monotonic() < deadline, "the killed engine was not declared dead"
                await asyncio.sleep(0.05)
        finally:
            killer.cancel()
            await asyncio.gather(killer, return_exceptions=True)
            await rt.close()

    try:
        asyncio.run(drive())
    finally:
        ctl.close()
        # The session's other tests expect both engines, on their start-up weights.
        launcher.restart(VICTIM)
    rows = list(store.read(RUN))
    events = [(r.epoch, CODEC.decode(r)) for r in rows if r.type in TURN_EVENT_TYPES]
    turn_events = [e for _, e in events]
    calls = [e for e in turn_events if isinstance(e, ModelCallCompleted)]
    # (a) No model call was generated twice: one ModelCallCompleted per turn.
    assert len({(e.group_id, e.sibling, e.turn) for e in calls}) == len(calls)
    # (b) The calls in flight on the victim were sent again within their attempt and
    # answered by the other engine, their failed tries recorded; no attempt failed.
    retried = [e for e in calls if e.failed_tries]
    assert retried, f"no model call was in flight on {VICTIM} at the kill ({killed})"
    assert all(e.engine_id == OTHER for e in retried)
    assert all(VICTIM in why for e in retried for why in e.failed_tries), retried
    g, s, a, turn = killed[0]
    by_turn = {e.turn: e for e in calls if (e.group_id, e.sibling) == (g, s)}
    if by_turn[turn].failed_tries:  # the call seen in flight (it may have just finished)
        assert by_turn[turn].attempt == a
        assert all(by_turn[t].attempt == a for t in range(turn))  # earlier turns: kept
    assert not [r for r in rows if r.type == "SiblingFailed"]
    assert not [e for e in turn_events if isinstance(e, TrajectoryResumed)]
    lost = [CODEC.decode(r) for r in rows if r.type == "EngineLost"]
    assert [e.engine_id for e in lost] == [VICTIM]
    # (c) Every trajectory completed, its mask and versions agreeing with its turns.
    book = fold_trajectories(events)
    completed = [e for e in turn_events if isinstance(e, TrajectoryCompleted)]
    assert {(e.group_id, e.sibling) for e in retried} <= {
        (e.group_id, e.sibling) for e in completed
    }
    for done in completed:
        arrays = decode_arrays(store.get_payload(RUN, done.payload_id))
        traj = book[(done.group_id, done.sibling)]
        mask = arrays["loss_mask"].tolist()
        assert mask == traj.loss_mask() and arrays["weight_versions"].tolist() == (
            traj.token_versions()
        )
        assert len(arrays["token_ids"]) == len(mask) == len(arrays["logprobs"])
        assert done.model_tokens == sum(mask)
        assert set(arrays["weight_versions"].tolist()) <= {-1, 0}
    store.close()

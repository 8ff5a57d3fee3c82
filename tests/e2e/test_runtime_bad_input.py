"""Bad input at the runtime level, through :class:`RolloutRuntime` on a real log: a
backend that returns the wrong number of siblings or malformed token ids, an
unreachable backend, and a trainer asking for a step out of order. Each is a clear
error naming the defect; the log stays intact (every invariant holds after every
event), and a restore from the last checkpoint with a healthy backend finishes the run
with no prompt lost and none trained twice."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import pytest
import torch

from rolloutlog.controller.backends.base import BackendUnavailableError, GroupRequest, SiblingSpec
from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.domain.errors import StepOutOfOrderError
from rolloutlog.controller.prompt_ledger import build_ledger, cross_check
from rolloutlog.controller.replay_tool import check_history
from rolloutlog.controller.rollout_controller import RolloutController, iter_history, replay
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime, RunStoppedError
from rolloutlog.eventstore import EventStore

RUN = "bad-input"
FINGERPRINT = "e2e-bad-input-v1"
RULES = RolloutConfig(
    group_size=2,
    groups_per_step=2,
    lookahead=1,
    staleness_bound=1,
    spare_pool_size=1,
    attempts_per_sibling=2,
)
WEIGHTS = [("w", torch.zeros(1))]
VOCAB = 64
STEPS = 6
T = TypeVar("T")


class Prompts:
    """A synthetic dataset with a cheap deterministic reward."""

    fingerprint = FINGERPRINT
    num_prompts = 200

    def prompt_token_ids(self, index: int) -> list[int]:
        return [1 + index % 11, 2, 3]

    def reward(self, index: int, completion_token_ids: Sequence[int]) -> float:
        return float(completion_token_ids[-1] % 3 == 0)


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def _start(store: EventStore) -> RolloutController:
    ctl = RolloutController.start(
        store,
        RUN,
        RULES,
        dataset_fingerprint=FINGERPRINT,
        dataset_size=Prompts.num_prompts,
        store_config=StoreConfig(group_commit_window_ms=1),
    )
    ctl.checkpoint(0)
    return ctl


def _restore(store: EventStore, offset: int) -> RolloutController:
    ctl, _report = RolloutController.restore(
        store,
        RUN,
        offset,
        rollout=RULES,
        dataset_fingerprint=FINGERPRINT,
        store_config=StoreConfig(group_commit_window_ms=1),
    )
    return ctl


async def _train(
    runtime: RolloutRuntime, ctl: RolloutController, upto: int, offsets: list[int]
) -> None:
    """Train up to ``upto`` steps, checkpointing after each (offsets appended)."""
    while ctl.state.train_step < upto:
        step = ctl.state.train_step
        await runtime.next_batch(step, timeout=30)
        await runtime.report_trained(step, step + 1)
        await runtime.publish_weights(WEIGHTS, step + 1)
        offsets.append(await runtime.checkpoint(step + 1))


def _healthy() -> DeterministicBackend:
    return DeterministicBackend(vocab_size=VOCAB)


def _finish_from(store: EventStore, offset: int) -> None:
    """Restore at ``offset`` with a healthy backend and train to STEPS."""
    ctl = _restore(store, offset)

    async def go() -> None:
        runtime = RolloutRuntime(ctl, _healthy(), Prompts(), GenerationConfig(max_tokens=4))
        await runtime.start()
        try:
            await runtime.sync_weights(WEIGHTS, ctl.state.weight_version)
            await _train(runtime, ctl, STEPS, [])
        finally:
            await runtime.close()

    try:
        _run(go())
    finally:
        ctl.close()


def _assert_log_intact(store: EventStore) -> None:
    result = check_history(store, RUN)
    assert result.violation is None, result.violation
    assert result.events_checked > 0


def _assert_exactly_once(store: EventStore) -> None:
    _assert_log_intact(store)
    ledger = build_ledger(store, RUN)
    check = cross_check(ledger, replay(store, RUN).state)
    assert sorted(ledger.step_rewards) == list(range(STEPS))
    assert check.prompts_lost == 0, check.lost
    assert check.prompts_trained_twice == 0, check.trained_twice
    assert check.prompts_pulled_twice == 0
    assert check.prompts_trained == STEPS * RULES.groups_per_step


def _healthy_steps_then(
    store: EventStore, backend: DeterministicBackend, arm: Callable[[], None]
) -> tuple[int, RunStoppedError, RolloutRuntime]:
    """Two healthy steps, then ``arm()`` the defect and train until the run stops.

    Returns the last checkpoint offset, the error and the runtime."""
    ctl = _start(store)
    offsets: list[int] = []
    runtime = RolloutRuntime(ctl, backend, Prompts(), GenerationConfig(max_tokens=4))

    async def go() -> RunStoppedError:
        await runtime.start()
        try:
            await _train(runtime, ctl, 2, offsets)
            arm()
            with pytest.raises(RunStoppedError) as info:
                await _train(runtime, ctl, STEPS, offsets)
            return info.value
        finally:
            await runtime.close()

    try:
        err = _run(go())
    finally:
        ctl.close()
    assert ctl.state.train_step < STEPS  # the run stopped part-way
    return offsets[-1], err, runtime


@pytest.mark.parametrize(
    ("mode", "named"),
    [
        ("missing_sibling", "asked for 2 siblings, backend returned 1"),
        ("extra_sibling", "asked for 2 siblings, backend returned 3"),
        ("token_out_of_vocab", f"token id {VOCAB} outside [0, {VOCAB})"),
        ("empty_tokens", "no tokens generated"),
        ("nan_logprob", "is not a finite value"),
    ],
)
def test_malformed_results_stop_the_run_and_it_restores(
    sqlite_url: str, mode: str, named: str
) -> None:
    armed = {"on": False}
    backend = DeterministicBackend(
        vocab_size=VOCAB, malformed=lambda _req: mode if armed["on"] else None
    )
    store = EventStore.open(sqlite_url)
    try:
        offset, err, runtime = _healthy_steps_then(store, backend, lambda: armed.update(on=True))
        assert "the rollout pump stopped" in str(err)
        assert named in str(err)
        assert runtime.stats.malformed >= 1
        _assert_log_intact(store)
        # The broken siblings were aborted in the log, naming the defect, never completed.
        reasons = [
            ev.reason  # type: ignore[attr-defined]
            for _row, ev in iter_history(store, RUN)
            if ev.event_type == "SiblingAborted"
        ]
        assert any("malformed result" in r and named in r for r in reasons)
        _finish_from(store, offset)
        _assert_exactly_once(store)
    finally:
        store.close()


def test_backend_unavailable_during_generation(sqlite_url: str) -> None:
    armed = {"on": False}

    def refuse(_req: GroupRequest, _spec: SiblingSpec) -> object:
        if armed["on"]:
            return BackendUnavailableError("connection refused: http://127.0.0.1:1/generate")
        return None

    backend = DeterministicBackend(vocab_size=VOCAB, fail=refuse)
    store = EventStore.open(sqlite_url)
    try:
        offset, err, _ = _healthy_steps_then(store, backend, lambda: armed.update(on=True))
        assert "connection refused" in str(err)
        assert isinstance(err.__cause__, BackendUnavailableError)
        _assert_log_intact(store)
        _finish_from(store, offset)
        _assert_exactly_once(store)
    finally:
        store.close()


class _Unreachable(DeterministicBackend):
    """A backend whose server cannot be reached."""

    async def start(self) -> None:
        raise BackendUnavailableError("cannot reach the generation server at 127.0.0.1:1")


def test_backend_unreachable_at_start(sqlite_url: str) -> None:
    store = EventStore.open(sqlite_url)
    try:
        ctl = _start(store)
        offset = ctl.flush()
        runtime = RolloutRuntime(ctl, _Unreachable(vocab_size=VOCAB), Prompts())
        with pytest.raises(BackendUnavailableError, match="cannot reach the generation server"):
            _run(runtime.start())
        _run(runtime.close())
        ctl.close()
        assert store.last_seq(RUN) == offset  # nothing appended
        _assert_log_intact(store)
        _finish_from(store, offset)
        _assert_exactly_once(store)
    finally:
        store.close()


def test_step_out_of_order_is_refused_and_nothing_is_appended(sqlite_url: str) -> None:
    store = EventStore.open(sqlite_url)
    try:
        ctl = _start(store)
        runtime = RolloutRuntime(ctl, _healthy(), Prompts(), GenerationConfig(max_tokens=4))
        offsets: list[int] = []

        async def go() -> None:
            await runtime.start()
            try:
                await _train(runtime, ctl, 2, offsets)
                before = ctl.state.last_seq
                # Ahead, behind (already trained), and the current one re-reported early.
                for step in (5, 3, 1, 0):
                    with pytest.raises(StepOutOfOrderError, match=f"step {step}, but the next "
                                       "train step is 2"):  # fmt: skip
                        await runtime.next_batch(step, timeout=5)
                    assert ctl.state.last_seq == before  # refused before appending
                with pytest.raises(StepOutOfOrderError, match="step 4"):
                    await runtime.report_trained(4, 5)
                with pytest.raises(StepOutOfOrderError, match="checkpoint for 7 trained steps"):
                    await runtime.checkpoint(7)
                assert ctl.state.last_seq == before
                # The run goes on from where it was.
                await _train(runtime, ctl, STEPS, offsets)
            finally:
                await runtime.close()

        try:
            _run(go())
        finally:
            ctl.close()
        selected = [
            ev.train_step  # type: ignore[attr-defined]
            for _row, ev in iter_history(store, RUN)
            if ev.event_type == "BatchSelected"
        ]
        assert selected == list(range(STEPS))
        _assert_exactly_once(store)
    finally:
        store.close()

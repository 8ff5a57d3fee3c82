"""The runtime's failure model: what stops a run, what is retried and how often.

A non-retryable backend error stops dispatch and surfaces from ``next_batch`` as the
original error (the cause of :class:`RunStoppedError`), with a bounded number of events
in the log; backend aborts and retries are capped per sibling and backed off;
``close()`` records the abort of every in-flight attempt so another runtime on the same
controller re-dispatches it, and raises a failed final flush; ``publish_weights``
drains in-flight generation with a bounded wait and aborts what did not drain.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import pytest
import torch

from rolloutlog.controller.backends._gate import DrainGate, GateReentryError
from rolloutlog.controller.backends.base import (
    BackendAbortedError,
    BackendUnavailableError,
    GroupRequest,
    MalformedResultError,
    SiblingSpec,
)
from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.domain.invariants import check_invariants
from rolloutlog.controller.domain.state import SiblingStatus
from rolloutlog.controller.rollout_controller import RolloutController, iter_history, replay
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime, RunStoppedError
from rolloutlog.eventstore import EventStore, StoreError

WEIGHTS = [("w", torch.zeros(1))]
T = TypeVar("T")


class _Prompts:
    fingerprint = "runtime-failure-model"
    num_prompts = 400

    def prompt_token_ids(self, index: int) -> list[int]:
        return [1 + index % 13, 2]

    def reward(self, index: int, completion_token_ids: Sequence[int]) -> float:
        return float(len(completion_token_ids) % 2)


def _run(coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
    """asyncio.run with a deadline: a hang fails the test instead of blocking it."""
    return asyncio.run(asyncio.wait_for(coro, timeout=timeout))


def _start(store: Any, **rules: Any) -> RolloutController:
    return RolloutController.start(
        store,
        "r",
        RolloutConfig(group_size=2, groups_per_step=2, lookahead=1, staleness_bound=1, **rules),
        dataset_fingerprint=_Prompts.fingerprint,
        dataset_size=_Prompts.num_prompts,
        store_config=StoreConfig(snapshot_interval=0, group_commit_window_ms=1),
    )


def _events(store: EventStore) -> Counter[str]:
    return Counter(ev.event_type for _row, ev in iter_history(store, "r"))


async def _stopped_run(runtime: RolloutRuntime) -> RunStoppedError:
    """next_batch until the run stops; then check the pump wrote nothing more."""
    assert runtime.failure is None
    await runtime.start()
    try:
        with pytest.raises(RunStoppedError) as info:
            await runtime.next_batch(0, timeout=20)
        # ``failure``: the error that stopped the pump, the cause next_batch raises with.
        assert runtime.failure is not None and info.value.__cause__ is runtime.failure
        await runtime.controller.aflush()
        before = runtime.controller.state.last_seq
        dispatched = runtime.stats.dispatched
        # Give a pump that still ran time to re-dispatch (it used to spin here).
        await asyncio.sleep(0.3)
        assert runtime.controller.state.last_seq == before
        assert runtime.stats.dispatched == dispatched
        # The same error again, without waiting, on every later call.
        with pytest.raises(RunStoppedError):
            await runtime.next_batch(0, timeout=1)
        return info.value
    finally:
        await runtime.close()


@pytest.mark.parametrize("kind", ["unavailable", "malformed"])
def test_a_non_retryable_backend_error_stops_the_run_with_bounded_events(
    sqlite_url: str, kind: str
) -> None:
    if kind == "unavailable":

        def refuse(_req: GroupRequest, _spec: SiblingSpec) -> object:
            return BackendUnavailableError("connection refused: http://127.0.0.1:1/generate")

        backend = DeterministicBackend(vocab_size=16, fail=refuse)
        cause: type[Exception] = BackendUnavailableError
        message = "connection refused: http://127.0.0.1:1/generate"
    else:
        backend = DeterministicBackend(vocab_size=16, malformed="missing_sibling")
        cause = MalformedResultError
        message = "group 0: asked for 2 siblings, backend returned 1"
    store = EventStore.open(sqlite_url)
    try:
        ctl = _start(store)
        runtime = RolloutRuntime(ctl, backend, _Prompts(), GenerationConfig(max_tokens=3))
        err = _run(_stopped_run(runtime))
        ctl.close()
        assert isinstance(err.__cause__, cause)
        assert str(err.__cause__) == message
        assert message in str(err)
        counts = _events(store)
        # One dispatch of the admitted siblings at most (2 steps of 2 groups of 2: the
        # lookahead), their aborts, and nothing after the error.
        siblings = 2 * 2 * 2
        assert 0 < counts["SiblingDispatched"] <= siblings, counts
        assert 0 < counts["SiblingAborted"] <= siblings, counts
        assert sum(counts.values()) < 40, counts
        check_invariants(replay(store, "r").state)
    finally:
        store.close()


class _AbortingBackend(DeterministicBackend):
    """A backend that aborts every request on its own (as an engine under pressure might)."""

    async def generate(self, request: GroupRequest) -> list[Any]:
        self.requests.append(request)
        self.times.append((request.group_id, asyncio.get_running_loop().time()))
        raise BackendAbortedError(f"group {request.group_id}: preempted (injected)")

    times: list[tuple[int, float]]


def test_backend_aborts_are_capped_per_sibling_and_backed_off(sqlite_url: str) -> None:
    backend = _AbortingBackend(vocab_size=16)
    backend.times = []
    store = EventStore.open(sqlite_url)
    gen = GenerationConfig(
        max_tokens=3,
        max_backend_aborts_per_sibling=3,
        retry_backoff_s=0.02,
        retry_backoff_max_s=0.05,
    )
    try:
        ctl = _start(store, attempts_per_sibling=2, drop_policy="fail")
        runtime = RolloutRuntime(ctl, backend, _Prompts(), gen)
        err = _run(_stopped_run(runtime))
        ctl.close()
        assert "attempts_per_sibling=2" in str(err), err
        assert "aborted by the backend 3 times (max_backend_aborts_per_sibling=3)" in str(err)
        per_sibling: Counter[tuple[int, int]] = Counter()
        for _row, ev in iter_history(store, "r"):
            if ev.event_type == "SiblingAborted":
                per_sibling[(ev.group_id, ev.sibling)] += 1  # type: ignore[attr-defined]
        # (cap - 1) aborts per attempt, attempts_per_sibling attempts, at most.
        assert per_sibling and max(per_sibling.values()) <= 2 * 2, per_sibling
        assert sum(_events(store).values()) < 200
        # Backoff: a group's consecutive dispatches are spaced out (first 0.02 s, then
        # 0.04 s, capped at 0.05 s).
        by_group: dict[int, list[float]] = {}
        for gid, at in backend.times:
            by_group.setdefault(gid, []).append(at)
        gaps = [b - a for times in by_group.values() for a, b in itertools.pairwise(times)]
        assert gaps and min(gaps) >= 0.015, gaps
    finally:
        store.close()


def test_retryable_failures_are_backed_off(sqlite_url: str) -> None:
    times: dict[int, list[float]] = {}

    def latency(request: GroupRequest) -> float:
        times.setdefault(request.group_id, []).append(asyncio.get_running_loop().time())
        return 0.0

    def fail(request: GroupRequest, spec: SiblingSpec) -> bool:
        return request.group_id == 0 and spec.attempt < 3  # fails twice, then succeeds

    backend = DeterministicBackend(vocab_size=16, latency=latency, fail=fail)
    store = EventStore.open(sqlite_url)
    try:
        ctl = _start(store, attempts_per_sibling=3)
        gen = GenerationConfig(max_tokens=3, retry_backoff_s=0.1, retry_backoff_max_s=0.15)
        runtime = RolloutRuntime(ctl, backend, _Prompts(), gen)

        async def go() -> None:
            await runtime.start()
            try:
                batch = await runtime.next_batch(0, timeout=20)
                assert 0 in batch.group_ids
            finally:
                await runtime.close()

        _run(go())
        ctl.close()
        first, second, third = times[0]
        assert second - first >= 0.09  # retry_backoff_s
        assert third - second >= 0.14  # doubled, capped at retry_backoff_max_s
    finally:
        store.close()


def test_close_records_in_flight_aborts_so_another_runtime_redispatches(
    sqlite_url: str,
) -> None:
    store = EventStore.open(sqlite_url)
    try:
        ctl = _start(store)
        slow = DeterministicBackend(vocab_size=16, latency=60.0)

        async def go() -> None:
            first = RolloutRuntime(ctl, slow, _Prompts(), GenerationConfig(max_tokens=3))
            await first.start()
            while first.stats.dispatched == 0:
                await asyncio.sleep(0.01)
            await first.close()
            in_flight = [
                s
                for g in ctl.state.groups.values()
                for s in g.siblings
                if s.status is SiblingStatus.IN_FLIGHT
            ]
            assert in_flight == []
            second = RolloutRuntime(
                ctl, DeterministicBackend(vocab_size=16), _Prompts(), GenerationConfig()
            )
            await second.start()
            try:
                batch = await second.next_batch(0, timeout=10)
                assert len(batch.group_ids) == 2
            finally:
                await second.close()

        _run(go())
        ctl.close()
        reasons = [
            ev.reason  # type: ignore[attr-defined]
            for _row, ev in iter_history(store, "r")
            if ev.event_type == "SiblingAborted"
        ]
        assert reasons and all(r == "the runtime was closed" for r in reasons)
        check_invariants(replay(store, "r").state)
    finally:
        store.close()


class _WritesFailLater:
    """A store whose appends fail once ``broken`` is set (everything else is real)."""

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.broken = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def append(self, *args: Any, **kwargs: Any) -> int:
        if self.broken:
            raise StoreError("could not write to the log: disk I/O error (injected)")
        return self.store.append(*args, **kwargs)


def test_close_raises_a_failed_final_flush(sqlite_url: str) -> None:
    real = EventStore.open(sqlite_url)
    store = _WritesFailLater(real)
    try:
        ctl = _start(store)
        ctl.flush()
        runtime = RolloutRuntime(
            ctl, DeterministicBackend(vocab_size=16, latency=60.0), _Prompts(), GenerationConfig()
        )

        async def go() -> None:
            await runtime.start()
            while runtime.stats.dispatched == 0:
                await asyncio.sleep(0.01)
            store.broken = True
            await runtime.close()

        with pytest.raises(StoreError, match=r"disk I/O error \(injected\)"):
            _run(go())
        ctl.close()  # the error was raised once, by runtime.close()
    finally:
        real.close()


def test_publish_weights_drain_is_bounded_and_aborts_stale_work(sqlite_url: str) -> None:
    slow = {"on": False}
    backend = DeterministicBackend(
        vocab_size=16, latency=lambda _req: 3600.0 if slow["on"] else 0.0
    )
    store = EventStore.open(sqlite_url)
    try:
        ctl = _start(store)
        gen = GenerationConfig(max_tokens=3, drain_timeout_s=0.2)
        runtime = RolloutRuntime(ctl, backend, _Prompts(), gen)

        async def go() -> float:
            await runtime.start()
            try:
                await runtime.next_batch(0, timeout=10)
                slow["on"] = True
                # Step 1's groups are admitted (lookahead 1): make sure some generate.
                await runtime.report_trained(0, 1)
                while not backend.in_flight_groups():
                    await asyncio.sleep(0.01)
                slow["on"] = False  # what is re-dispatched after the abort is fast
                loop = asyncio.get_running_loop()
                started = loop.time()
                await runtime.publish_weights(WEIGHTS, 1)
                took = loop.time() - started
                batch = await runtime.next_batch(1, timeout=10)
                assert len(batch.group_ids) == 2
                return took
            finally:
                await runtime.close()

        took = _run(go())
        ctl.close()
        assert took < 5
        assert backend.weight_updates and backend.weight_updates[-1][0] == 1
        reasons = [
            ev.reason  # type: ignore[attr-defined]
            for _row, ev in iter_history(store, "r")
            if ev.event_type == "SiblingAborted"
        ]
        assert any("did not drain within drain_timeout_s=0.2" in r for r in reasons), reasons
        check_invariants(replay(store, "r").state)
    finally:
        store.close()


def test_drain_gate_refuses_reentry() -> None:
    async def go() -> None:
        gate = DrainGate()
        async with gate.generating():
            with pytest.raises(GateReentryError, match="already generating"):
                async with gate.swapping():
                    pass
            with pytest.raises(GateReentryError, match="already generating"):
                async with gate.generating():
                    pass
        async with gate.swapping():
            with pytest.raises(GateReentryError, match="already swapping"):
                async with gate.generating():
                    pass
            with pytest.raises(GateReentryError, match="already swapping"):
                async with gate.swapping():
                    pass
        # The gate still works for other tasks afterwards.
        async with gate.swapping():
            pass
        assert gate.active == 0

    _run(go(), timeout=10)


class _NeverSwaps(DeterministicBackend):
    """A backend whose weight swap never completes, even after its work was aborted."""

    async def update_weights(self, named_tensors: Any, version: int) -> None:
        await asyncio.Event().wait()


def test_a_backend_that_never_swaps_stops_the_run(sqlite_url: str) -> None:
    store = EventStore.open(sqlite_url)
    try:
        ctl = _start(store)
        gen = GenerationConfig(max_tokens=3, drain_timeout_s=0.1)
        runtime = RolloutRuntime(ctl, _NeverSwaps(vocab_size=16), _Prompts(), gen)

        async def go() -> None:
            await runtime.start()
            try:
                await runtime.next_batch(0, timeout=10)
                await runtime.report_trained(0, 1)
                with pytest.raises(BackendUnavailableError, match="did not swap to weight"):
                    await runtime.publish_weights(WEIGHTS, 1)
                with pytest.raises(RunStoppedError, match="did not swap to weight"):
                    await runtime.next_batch(1, timeout=5)
            finally:
                await runtime.close()

        _run(go())
        ctl.close()
        check_invariants(replay(store, "r").state)
    finally:
        store.close()

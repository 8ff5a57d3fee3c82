"""The runtime's payload cache holds live groups only (issue 31, item 8).

Completions' payloads are kept in memory until their batch is assembled. A group that
leaves the state untrained (its prompt dropped, the group evicted) never reaches a batch:
its payloads must be forgotten too, or the cache grows with every drop and eviction for
the life of the run. A scripted run with drops, retries and evictions, on a SQLite file.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rolloutlog.controller.backends.base import BackendError
from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.domain.state import RunState
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.eventstore import EventStore, decode_arrays

WEIGHTS = [("w", torch.zeros(1))]


class _Prompts:
    fingerprint = "payload-cache"
    num_prompts = 1000

    def prompt_token_ids(self, index: int) -> list[int]:
        return [1 + index % 11, 2, 3]

    def reward(self, index: int, completion_token_ids: Sequence[int]) -> float:
        return float(completion_token_ids[-1] % 3 == 0)


def _failures(request: Any, spec: Any) -> BackendError | bool:
    """Some groups fail for good (their prompts are dropped after siblings completed),
    some fail once and retry."""
    if request.group_id % 7 == 3:
        return BackendError(f"scripted fatal failure of group {request.group_id}", retryable=False)
    return request.group_id % 5 == 1 and spec.attempt == 1


STEPS = 30


def _live_payloads(state: RunState) -> set[str]:
    return {s.payload_id for g in state.groups.values() for s in g.siblings if s.payload_id}


def _cached(runtime: RolloutRuntime) -> set[str]:
    """The payload ids the runtime holds in memory."""
    return {p for by_id in runtime._payload_cache.values() for p in by_id}


def test_payloads_of_dropped_and_evicted_groups_are_forgotten(tmp_path: Path) -> None:
    store = EventStore.open(f"sqlite:///{tmp_path / 'log.db'}")
    # A lookahead of 2 and a tight staleness bound: groups are evicted as well as dropped.
    config = RolloutConfig(
        group_size=2,
        groups_per_step=3,
        lookahead=2,
        staleness_bound=1,
        spare_pool_size=2,
        drop_policy="replace",
        attempts_per_sibling=2,
    )
    ctl = RolloutController.start(
        store,
        "r",
        config,
        dataset_fingerprint=_Prompts.fingerprint,
        dataset_size=_Prompts.num_prompts,
        store_config=StoreConfig(snapshot_interval=25, group_commit_window_ms=1),
    )
    seen: list[tuple[int, set[str], set[str]]] = []

    async def go() -> None:
        backend = DeterministicBackend(vocab_size=32, latency=0.0005, fail=_failures)
        runtime = RolloutRuntime(ctl, backend, _Prompts(), GenerationConfig(max_tokens=4))
        await runtime.start()
        try:
            await runtime.sync_weights(WEIGHTS, 0)
            for step in range(STEPS):
                await runtime.next_batch(step, timeout=30)
                await runtime.report_trained(step, step + 1)
                await runtime.publish_weights(WEIGHTS, step + 1)
                await asyncio.sleep(0.01)  # a turn of the pump after the step's evictions
                seen.append((step, _cached(runtime), _live_payloads(ctl.state)))
        finally:
            await runtime.close()

    try:
        asyncio.run(asyncio.wait_for(go(), timeout=300))
        c = ctl.state.counters
        assert c.prompts_dropped > 5 and c.groups_evicted > 5, "the run must drop and evict"
    finally:
        ctl.close()
        store.close()
    stale = {step: len(cached - live) for step, cached, live in seen if cached - live}
    assert stale == {}, f"payloads of groups no longer live (count by step): {stale}"
    # The cache is bounded by the live groups' completed siblings, not by the run's length.
    assert max(len(cached) for _, cached, _ in seen) <= 2 * 3 * 4


def test_completion_payload_reads_memory_or_the_store_and_changes_nothing(
    tmp_path: Path,
) -> None:
    """``completion_payload``: the completion's encoded arrays, the same bytes the store
    holds, whether the group is still cached (and it stays cached: a caller may read it
    from a worker thread) or its batch was assembled already (then from the store)."""
    store = EventStore.open(f"sqlite:///{tmp_path / 'log.db'}")
    config = RolloutConfig(group_size=2, groups_per_step=2, lookahead=1, staleness_bound=1)
    ctl = RolloutController.start(
        store,
        "r",
        config,
        dataset_fingerprint=_Prompts.fingerprint,
        dataset_size=_Prompts.num_prompts,
        store_config=StoreConfig(snapshot_interval=0, group_commit_window_ms=1),
    )
    checked: dict[str, int] = {"cached": 0, "assembled": 0}

    async def go() -> None:
        runtime = RolloutRuntime(
            ctl, DeterministicBackend(vocab_size=32), _Prompts(), GenerationConfig(max_tokens=4)
        )
        await runtime.start()
        try:
            batch = await runtime.next_batch(0, timeout=30)
            # Step 0's payloads were freed by assembling it: read from the store.
            for sample in batch.samples:
                pid = ctl.state.groups[sample.group_id].siblings[sample.sibling].payload_id
                assert pid is not None and pid not in _cached(runtime)
                data = runtime.completion_payload(sample.group_id, pid)
                assert data == store.get_payload("r", pid)
                ids = decode_arrays(data)["token_ids"].tolist()
                assert tuple(ids) == sample.completion_token_ids
                checked["assembled"] += 1
            # Step 1's (the lookahead) are in memory until it is assembled.
            deadline = asyncio.get_running_loop().time() + 30
            while not _cached(runtime):
                assert asyncio.get_running_loop().time() < deadline, "step 1 never finished"
                await asyncio.sleep(0.01)
            before = {g: dict(by_id) for g, by_id in runtime._payload_cache.items()}
            for gid, by_id in before.items():
                for pid, cached in by_id.items():
                    assert runtime.completion_payload(gid, pid) == cached
                    assert cached == store.get_payload("r", pid)
                    checked["cached"] += 1
            assert {p for b in before.values() for p in b} <= _cached(runtime)  # not freed
        finally:
            await runtime.close()

    try:
        asyncio.run(asyncio.wait_for(go(), timeout=60))
    finally:
        ctl.close()
        store.close()
    assert checked["assembled"] == 4 and checked["cached"] >= 1

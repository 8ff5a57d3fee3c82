"""Durability overhead: the same synthetic rollout with the log on SQLite vs in memory.

A 10k-group rollout through the real pump (RolloutRuntime) with the deterministic test
backend: admission, dispatch, completion with payloads, commit, selection, train step
and weight publish for every step, the output-commit flush before every batch. The
only difference between the two runs is where the events go.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.eventstore import EventStore, MemoryEventStore


class _Prompts:
    """A synthetic dataset: short token prompts and a cheap reward."""

    fingerprint = "synthetic-v1"

    def __init__(self, n: int) -> None:
        self.num_prompts = n

    def prompt_token_ids(self, index: int) -> list[int]:
        return [1 + index % 50, 2 + index % 7, 3]

    def reward(self, index: int, completion_token_ids: Sequence[int]) -> float:
        return sum(1 for t in completion_token_ids if t % 2 == 0) / len(completion_token_ids)


async def _rollout(store: Any, groups: int, groups_per_step: int, latency: float) -> float:
    steps = groups // groups_per_step
    rollout = RolloutConfig(
        group_size=4,
        groups_per_step=groups_per_step,
        sampler="in_order",
        lookahead=1,
        staleness_bound=1,
        spare_pool_size=2,
    )
    ctl = RolloutController.start(
        store,
        "bench",
        rollout,
        dataset_fingerprint="synthetic-v1",
        dataset_size=groups + 4 * groups_per_step,
        store_config=StoreConfig(snapshot_interval=0),
    )
    backend = DeterministicBackend(vocab_size=64, max_model_len=64, latency=latency)
    rt = RolloutRuntime(
        ctl,
        backend,
        _Prompts(groups + 4 * groups_per_step),
        GenerationConfig(max_in_flight_siblings=512, max_tokens=8),
    )
    weights = [("w", torch.zeros(1))]
    await rt.start()
    started = time.perf_counter()
    for step in range(steps):
        await rt.next_batch(step)
        await rt.report_trained(step, step + 1)
        await rt.publish_weights(weights, step + 1)
    await ctl.aflush()
    elapsed = time.perf_counter() - started
    await rt.close()
    ctl.close()
    return elapsed


def run_durability_bench(
    *,
    groups: int = 10_000,
    groups_per_step: int = 64,
    latency: float = 0.0,
    repeats: int = 3,
    synchronous: str = "FULL",
) -> dict[str, Any]:
    """Median wall time of the rollout on SQLite and in memory, and their ratio."""
    sqlite_times: list[float] = []
    memory_times: list[float] = []
    for _ in range(repeats):
        memory_times.append(
            asyncio.run(_rollout(MemoryEventStore(), groups, groups_per_step, latency))
        )
        with tempfile.TemporaryDirectory() as tmp:
            store = EventStore.open(f"sqlite:///{Path(tmp) / 'bench.db'}?synchronous={synchronous}")
            try:
                sqlite_times.append(asyncio.run(_rollout(store, groups, groups_per_step, latency)))
                events = store.last_seq("bench")
            finally:
                store.close()
    sq, mem = statistics.median(sqlite_times), statistics.median(memory_times)
    return {
        "groups": groups,
        "groups_per_step": groups_per_step,
        "backend_latency_s": latency,
        "sqlite_synchronous": synchronous,
        "events": events,
        "sqlite_seconds": sq,
        "memory_seconds": mem,
        "sqlite_runs": sqlite_times,
        "memory_runs": memory_times,
        "ratios": {"durability_overhead": sq / mem},
    }

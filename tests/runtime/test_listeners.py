"""A controller's listeners get each command's events as recorded: offsets and the row
metadata the log stores (time, epoch, train step, weight version). Live metrics take
that metadata from there; they leave the controller's clock alone."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import torch

from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.metrics import LiveMetrics
from rolloutlog.controller.recorded import RecordedEvents
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_index import read_indexed
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.eventstore import EventStore

WEIGHTS = [("w", torch.zeros(1))]


class _Prompts:
    fingerprint = "listeners"
    num_prompts = 200

    def prompt_token_ids(self, index: int) -> list[int]:
        return [1 + index % 13, 2]

    def reward(self, index: int, completion_token_ids: Sequence[int]) -> float:
        return float(len(completion_token_ids) % 2)


def _ticking_clock() -> object:
    """A clock whose every reading is one second after the last (distinct per command)."""
    start = datetime(2026, 1, 1, tzinfo=UTC)
    ticks = itertools.count()
    return lambda: start + timedelta(seconds=next(ticks))


async def _train(ctl: RolloutController, steps: int) -> None:
    runtime = RolloutRuntime(
        ctl, DeterministicBackend(vocab_size=16), _Prompts(), GenerationConfig(max_tokens=3)
    )
    await runtime.start()
    try:
        for step in range(steps):
            await runtime.next_batch(step)
            await runtime.report_trained(step, step + 1)
            await runtime.publish_weights(WEIGHTS, step + 1)
    finally:
        await runtime.close()


def test_listeners_get_the_events_with_their_row_metadata(sqlite_url: str) -> None:
    store = EventStore.open(sqlite_url)
    ctl = RolloutController.start(
        store,
        "r",
        RolloutConfig(group_size=2, groups_per_step=2, lookahead=1, staleness_bound=1),
        dataset_fingerprint=_Prompts.fingerprint,
        dataset_size=_Prompts.num_prompts,
        store_config=StoreConfig(group_commit_window_ms=5),
        clock=_ticking_clock(),  # type: ignore[arg-type]
    )
    first_listened = ctl.state.last_seq + 1
    heard: list[RecordedEvents] = []
    ctl.listeners.append(heard.append)
    asyncio.run(_train(ctl, 3))
    ctl.close()

    rows = {r.seq: r for r in read_indexed(store, "r")}
    store.close()
    offsets = [off for rec in heard for off, _ev in rec.pairs()]
    # Every event after the listener was added, once, in log order.
    assert offsets == list(range(first_listened, max(rows) + 1))
    assert len({rec.recorded_at for rec in heard}) == len(heard) > 10
    for rec in heard:
        assert rec.last_offset == rec.first_offset + len(rec.events) - 1
        for off, event in rec.pairs():
            row = rows[off]
            assert row.type == event.event_type
            assert (row.recorded_at, row.epoch) == (rec.recorded_at, rec.epoch)
            assert (row.train_step, row.weight_version) == (rec.train_step, rec.weight_version)


def test_live_metrics_leave_the_controllers_clock_alone(sqlite_url: str) -> None:
    store = EventStore.open(sqlite_url)
    clock = _ticking_clock()
    ctl = RolloutController.start(
        store,
        "r",
        RolloutConfig(group_size=2, groups_per_step=2, lookahead=1, staleness_bound=1),
        dataset_fingerprint=_Prompts.fingerprint,
        dataset_size=_Prompts.num_prompts,
        clock=clock,  # type: ignore[arg-type]
    )
    live = LiveMetrics()
    live.attach(ctl)
    assert ctl.clock is clock
    asyncio.run(_train(ctl, 2))
    live.sync_now()
    assert live.follower.projection.offset == ctl.state.last_seq
    assert live.listener_errors == 0
    live.detach()
    assert ctl.clock is clock
    ctl.close()
    store.close()

"""The pump against a trainer loop at the default demo shape (lookahead 1, staleness
bound 1): work admitted for the next step while weights are being published must be
dispatched with the new weights, not the outgoing ones, or it is stale on arrival and
evicted (each eviction costs a prompt; the 24-step demo ran out of its 256 prompts)."""

from __future__ import annotations

import asyncio

from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.rollout_controller import RolloutController, iter_history
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.eventstore import EventStore

from .test_runtime_bad_input import WEIGHTS, Prompts

STEPS = 12


def test_no_group_is_evicted_at_weight_sync(sqlite_url: str) -> None:
    rules = RolloutConfig(
        group_size=4, groups_per_step=4, lookahead=1, staleness_bound=1, spare_pool_size=2
    )
    store = EventStore.open(sqlite_url)
    try:
        ctl = RolloutController.start(
            store,
            "p",
            rules,
            dataset_fingerprint=Prompts.fingerprint,
            dataset_size=Prompts.num_prompts,
            store_config=StoreConfig(group_commit_window_ms=1),
        )
        # Generation takes a little time, as a real engine's does, so a weight swap
        # (which drains in-flight requests) overlaps the admission of the next step.
        backend = DeterministicBackend(vocab_size=64, latency=0.01)
        runtime = RolloutRuntime(ctl, backend, Prompts(), GenerationConfig(max_tokens=4))

        async def go() -> None:
            await runtime.start()
            try:
                for step in range(STEPS):
                    await runtime.next_batch(step, timeout=30)
                    await asyncio.sleep(0.02)  # "training"
                    await runtime.report_trained(step, step + 1)
                    await runtime.publish_weights(WEIGHTS, step + 1)
            finally:
                await runtime.close()

        try:
            asyncio.run(asyncio.wait_for(go(), timeout=120))
        finally:
            ctl.close()
        kinds = [ev.event_type for _row, ev in iter_history(store, "p")]
        assert kinds.count("StepTrained") == STEPS
        assert kinds.count("GroupEvicted") == 0
    finally:
        store.close()

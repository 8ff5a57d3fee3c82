"""A scripted run for the metrics tests: failures, drops, evictions, a checkpoint, a
crash after it and a restore, driven through RolloutController + RolloutRuntime with the
deterministic backend, with :class:`LiveMetrics` following it all along."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.metrics import LiveMetrics
from rolloutlog.controller.rollout_controller import RecoveryReport, RolloutController
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.eventstore import EventStore

RUN_ID = "metrics-run"


class Prompts:
    """A toy prompt source: reward = share of token 5 in the completion."""

    fingerprint = "metrics-prompts"
    num_prompts = 600

    def prompt_token_ids(self, index: int) -> list[int]:
        return [1 + (index % 7), 2, 3]

    def reward(self, index: int, completion_token_ids: Sequence[int]) -> float:
        return sum(1 for t in completion_token_ids if t % 5 == 0) / len(completion_token_ids)


ROLLOUT = RolloutConfig(
    group_size=4,
    groups_per_step=6,
    sampler="in_order",
    lookahead=2,
    staleness_bound=1,
    spare_pool_size=2,
    attempts_per_sibling=2,
)

#: (group_id, sibling, attempt) that fail: group 3 once (retried), group 5 and 20 twice
#: (attempts exhausted: their prompts are dropped and replaced).
FAILURES = {(3, 1, 1), (5, 0, 1), (5, 0, 2), (20, 2, 1), (20, 2, 2), (45, 1, 1)}


def _latency(request: object) -> float:
    gid = request.group_id  # type: ignore[attr-defined]
    # Every seventh group is slow: it is still generating at checkpoints and weight syncs.
    return 0.08 if gid % 7 == 6 else 0.001 + (gid % 5) * 0.002


@dataclass
class Scenario:
    """What the scripted run left behind."""

    url: str
    run_id: str
    live: LiveMetrics
    checkpoint_offset: int
    report: RecoveryReport | None
    rewards: dict[int, float] = field(default_factory=dict)
    final_state_values: dict[str, int] = field(default_factory=dict)


def _runtime(ctl: RolloutController) -> RolloutRuntime:
    backend = DeterministicBackend(
        vocab_size=32,
        latency=_latency,
        fail=FAILURES,
        weight_version=ctl.state.weight_version,
    )
    return RolloutRuntime(
        ctl, backend, Prompts(), GenerationConfig(max_in_flight_siblings=22, max_tokens=8)
    )


async def _train(
    rt: RolloutRuntime, steps: range, rewards: dict[int, float], ckpt_after: int | None
) -> int | None:
    offset = None
    for step in steps:
        batch = await rt.next_batch(step, timeout=30)
        rewards[step] = batch.mean_reward
        await rt.report_trained(step, step + 1)
        await rt.publish_weights([("w", torch.zeros(2))], step + 1)
        if ckpt_after is not None and step == ckpt_after:
            offset = await rt.checkpoint(step + 1)
    return offset


def run_scenario(
    url: str,
    *,
    steps_before_crash: int = 7,
    total_steps: int = 10,
    reopen: Literal["restore", "resume"] = "restore",
    on_crash: Callable[[], None] | None = None,
) -> Scenario:
    """Run the script on ``url`` and return what it did (the store is closed).

    After ``steps_before_crash`` steps (a checkpoint after step 3) the process "dies";
    ``on_crash`` runs; then the run is restored from the checkpoint (or, with
    ``reopen="resume"``, taken over where it stood) and trained to ``total_steps``.
    """
    return asyncio.run(_scenario(url, steps_before_crash, total_steps, reopen, on_crash))


async def _scenario(
    url: str,
    steps_before_crash: int,
    total_steps: int,
    reopen: Literal["restore", "resume"],
    on_crash: Callable[[], None] | None,
) -> Scenario:
    store = EventStore.open(url)
    store_cfg = StoreConfig(group_commit_window_ms=1.0, snapshot_interval=0)
    rewards: dict[int, float] = {}
    live = LiveMetrics()
    try:
        ctl = RolloutController.start(
            store,
            RUN_ID,
            ROLLOUT,
            dataset_fingerprint=Prompts.fingerprint,
            dataset_size=Prompts.num_prompts,
            store_config=store_cfg,
        )
        rt = _runtime(ctl)
        live.attach(ctl, rt)
        await rt.start()
        try:
            ckpt = await _train(rt, range(steps_before_crash), rewards, ckpt_after=3)
            # Work goes on after the checkpoint, then the process "dies".
            await asyncio.sleep(0.02)
        finally:
            await rt.close()
            ctl.close()
        assert ckpt is not None
        live.detach()
        if on_crash is not None:
            on_crash()
        report: RecoveryReport | None = None
        if reopen == "restore":
            rewards = {k: v for k, v in rewards.items() if k <= 3}
            ctl2, report = RolloutController.restore(
                store, RUN_ID, ckpt, rollout=ROLLOUT, store_config=store_cfg
            )
        else:
            ctl2 = RolloutController.open(store, RUN_ID, store_config=store_cfg)
        rt2 = _runtime(ctl2)
        live.attach(ctl2, rt2)
        if report is not None:
            live.observe_restore(report)
        await rt2.start()
        try:
            await rt2.publish_weights([("w", torch.zeros(2))], ctl2.state.weight_version)
            await _train(rt2, range(ctl2.state.train_step, total_steps), rewards, ckpt_after=7)
        finally:
            await rt2.close()
            ctl2.flush()
        state = ctl2.state
        final = {
            "groups_committed": state.counters.groups_committed,
            "groups_trained": state.counters.groups_trained,
            "groups_evicted": state.counters.groups_evicted,
            "groups_evicted_recovered": state.counters.groups_evicted_recovered,
            "prompts_dropped": state.counters.prompts_dropped,
            "replacements": state.counters.replacements,
            "borrows": state.counters.borrows,
            "tokens_generated": state.counters.tokens_generated,
            "tokens_committed": state.counters.tokens_committed,
            "siblings_completed": state.counters.siblings_completed,
            "siblings_failed": state.counters.siblings_failed,
            "siblings_aborted": state.counters.siblings_aborted,
            "shortfall": state.counters.shortfall,
            "train_step": state.train_step,
            "weight_version": state.weight_version,
            "published_version": state.published_version,
            "epoch": state.epoch,
            "last_seq": state.last_seq,
            "dataset_cursor": state.dataset_cursor,
            "spares": len(state.spares),
            "ready": sum(1 for g in state.groups.values() if g.phase.value == "ready"),
            "admitted": sum(1 for g in state.groups.values() if g.phase.value == "admitted"),
            "in_flight": sum(
                1
                for g in state.groups.values()
                for s in g.siblings
                if s.status.value == "in_flight"
            ),
        }
        ctl2.close()
        live.detach()
        return Scenario(url, RUN_ID, live, ckpt, report, rewards, final)
    finally:
        store.close()

"""RolloutlogWorker against TRL's own pieces, without a model.

The trainer's side is TRL's: ``RolloutQueueDataset`` (with its staleness drop),
``FixedCountBatcher`` and ``DataCollatorForRollout``, driven like accelerate's dispatcher
(one micro-batch fetched ahead) and transformers' loop (``gradient_accumulation_steps``
micro-batches per optimizer step, then ``on_step_end``, the weight sync, ``on_save``),
with TRL's ``TrainerState``/``TrainerControl``. Generation is the deterministic backend.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import re
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from datasets import Dataset, IterableDataset
from transformers import TrainerControl, TrainerState

# TRL is the [trl] extra, installed by the set-up (CI fails without it, never skips).
from trl.experimental.async_grpo import AsyncGRPOConfig
from trl.experimental.async_grpo.async_grpo_trainer import (
    DataCollatorForRollout,
    FixedCountBatcher,
    RolloutQueueDataset,
)

from rolloutlog.controller.backends.base import GroupRequest, SiblingSpec
from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.domain import CODEC, Phase
from rolloutlog.controller.environments import ToolCall
from rolloutlog.controller.metrics.ranges import project_history
from rolloutlog.controller.multiturn import MultiTurnConfig
from rolloutlog.controller.prompt_ledger import build_ledger, cross_check
from rolloutlog.controller.replay_tool import state_at, verify_decisions
from rolloutlog.controller.rollout_index import read_where
from rolloutlog.controller.rollout_runtime import GenerationConfig
from rolloutlog.eventstore import EventStore
from rolloutlog.grpo.tiny_model import build_tokenizer
from rolloutlog.integrations.trl import (
    CHECKPOINT_FILE,
    CheckpointStateMissingError,
    LogMismatchError,
    RolloutlogWorker,
    TrlConfigError,
    UnsupportedTrlFeatureError,
    WorkerFailedError,
    read_checkpoint,
)
from rolloutlog.integrations.trl.worker import _trl_sample_class

G = 4  # num_generations
T = TypeVar("T")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


def _dataset(n: int = 40) -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [f"q{i} add {i % 7} and {i % 5}" for i in range(n)],
            "answer": [i % 9 for i in range(n)],
        }
    )


CALLS: list[dict[str, Any]] = []


def length_reward(
    prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **kw: Any
) -> list[float]:
    CALLS.append({"prompts": prompts, "completions": completions, "ids": completion_ids, **kw})
    return [len(ids) / 8.0 for ids in completion_ids]


async def async_answer_reward(completions: list[Any], answer: list[int], **kw: Any) -> list[float]:
    await asyncio.sleep(0)
    return [float(str(a) in c) for c, a in zip(completions, answer, strict=True)]


def _args(tmp_path: Path, *, max_staleness: int = 2, ga: int = 2) -> AsyncGRPOConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AsyncGRPOConfig(
            output_dir=str(tmp_path / "out"),
            per_device_train_batch_size=G,  # one group per micro-batch
            gradient_accumulation_steps=ga,  # ga groups per optimizer step
            num_generations=G,
            max_staleness=max_staleness,
            token_budget=0,
            report_to=[],
            max_completion_length=6,
            use_cpu=True,
            bf16=False,
        )


def _worker(tokenizer: Any, url: str, args: AsyncGRPOConfig, **kw: Any) -> RolloutlogWorker:
    backend = DeterministicBackend(
        vocab_size=len(tokenizer),
        max_model_len=128,
        eos_token_id=tokenizer.eos_token_id,
        seed=0,
        latency=kw.pop("latency", 0.0),
    )
    return RolloutlogWorker(
        store=url,
        train_dataset=kw.pop("dataset", None) or _dataset(),
        processing_class=tokenizer,
        reward_funcs=[length_reward, async_answer_reward],
        backend=backend,
        args=args,
        timeout_s=60,
        **kw,
    )


class FakeTrainer:
    """TRL's data path and transformers' step/callback order, without a model."""

    def __init__(
        self,
        worker: RolloutlogWorker,
        args: AsyncGRPOConfig,
        tokenizer: Any,
        *,
        global_step: int = 0,
    ) -> None:
        self.worker, self.args = worker, args
        self.metrics: dict[str, list[Any]] = defaultdict(list)
        self.version = 0
        self.state = TrainerState(global_step=global_step)
        self.control = TrainerControl()
        dataset = RolloutQueueDataset(
            worker.rollout_buffer,
            lambda: self.version,
            worker.check_health,
            stale_after_s=30.0,
            metrics=self.metrics,
            max_staleness=args.max_staleness,
            poll_interval_s=0.05,
        )
        self.batcher = FixedCountBatcher(dataset, 1, args.per_device_train_batch_size)
        self.collate = DataCollatorForRollout(tokenizer.pad_token_id, 1, metrics=self.metrics)
        self.trained_groups: list[int] = []
        #: Every example TRL's RolloutQueueDataset yielded (what the collator packs).
        self.examples: list[dict[str, Any]] = []

    def begin(self, *, accelerate: bool = False) -> None:
        cb = self.worker.callback
        if accelerate:  # the trainer's real dataloader: accelerate's dispatcher
            from accelerate import Accelerator
            from accelerate.utils import DataLoaderConfiguration
            from torch.utils.data import DataLoader

            accelerator = Accelerator(
                cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True)
            )
            loader = accelerator.prepare(
                DataLoader(self.batcher, batch_size=1, collate_fn=self.collate, num_workers=0)
            )
            cb.on_train_begin(self.args, self.state, self.control, train_dataloader=loader)
            self._sync()
            self.worker.start()
            self._batches = ((batch, [-1]) for batch in loader)
            return
        cb.on_train_begin(self.args, self.state, self.control)
        self.collate_fn = cb.wrap_collator(self.collate)
        self._sync()  # TRL: the cold weight sync, then the worker starts
        self.worker.start()
        self._batches = self._dispatcher()

    def _dispatcher(self) -> Iterator[tuple[Any, list[int]]]:
        source = iter(self.batcher)

        def fetch() -> tuple[Any, list[int]]:
            rows = next(source)
            gids = [int(s["group_id"]) for row in rows for s in row.samples]
            self.examples.extend(s for row in rows for s in row.samples)
            return self.collate_fn([rows]), gids

        current = fetch()
        while True:
            ahead = fetch()  # accelerate's DataLoaderDispatcher fetches one ahead
            yield current
            current = ahead

    def _sync(self) -> None:
        self.version += 1
        self.worker.update_model_version(self.version)

    def step(self) -> None:
        for _ in range(self.args.gradient_accumulation_steps):
            _batch, gids = next(self._batches)
            self.trained_groups.extend(dict.fromkeys(gids))
        self.state.global_step += 1
        self.worker.callback.on_step_end(self.args, self.state, self.control)
        self._sync()

    def save(self) -> Path:
        folder = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
        folder.mkdir(parents=True, exist_ok=True)
        self.worker.callback.on_save(self.args, self.state, self.control)
        return folder


def _threads() -> set[threading.Thread]:
    # TRL's RolloutQueueDataset starts a daemon trace logger that never ends: not ours.
    return {t for t in threading.enumerate() if t.name != "rollout-trace-logger"}


def test_contract_rewards_advantages_and_hygiene(tokenizer: Any, tmp_path: Path) -> None:
    args = _args(tmp_path)
    url = f"sqlite:///{tmp_path / 'log.db'}"
    worker = _worker(tokenizer, url, args)
    trainer = FakeTrainer(worker, args, tokenizer)
    before = _threads()
    CALLS.clear()
    trainer.begin(accelerate=True)  # the callback wraps the real dataloader's collator
    try:
        for _ in range(4):
            trainer.step()
        assert worker.steps_recorded == 4
        assert worker.controller is not None
        state = worker.controller.state
        assert state.train_step == 4 and state.counters.groups_trained == 4 * 2
        # TRL's signature: prompts, completions, completion_ids and the dataset's columns
        call = CALLS[0]
        assert set(call) == {"prompts", "completions", "ids", "answer"}
        assert isinstance(call["prompts"][0], str) and isinstance(call["completions"][0], str)
        # TRL's advantages per group, from the rewards the log holds
        sample = trainer.worker.rollout_buffer.get(timeout=10)
        group = state.groups[sample.group_id]
        rewards = sorted(s.reward for s in group.siblings)
        assert sample.metrics["reward"] in rewards
        r = np.array(rewards)
        expected = (sample.metrics["reward"] - r.mean()) / (r.std() + 1e-8)
        assert sample.advantage == pytest.approx(expected)
        assert sample.model_version == group.oldest_version() + 1  # TRL's numbering
        assert "rewards/length_reward" in sample.metrics
        assert len(sample.input_ids) == len(sample.completion_mask) == len(sample.old_log_probs)
        # metrics reach TRL's format: floats or (numerator, denominator) pairs
        item = worker.metrics_queue.get_nowait()
        assert all(isinstance(v, float | tuple) for v in item.values())
        assert not trainer.metrics.get("sample/dropped_stale_total")
    finally:
        worker.stop()
    assert _threads() == before


def _jitter(request: Any) -> float:
    return 0.002 * (request.group_id % 5)  # uneven generation times


def test_staleness_is_owned_by_the_log(tokenizer: Any, tmp_path: Path) -> None:
    """max_staleness=1, generation one step ahead with uneven latencies: every group TRL
    receives is within the bound when it trains (the log's selections say so), TRL's
    RolloutQueueDataset drops none (nor does the log evict any), and a lookahead of 0 is
    refused."""
    args = _args(tmp_path, max_staleness=1)
    url = f"sqlite:///{tmp_path / 'log.db'}"
    with pytest.raises(TrlConfigError, match="lookahead=0: it must be at least 1"):
        _worker(tokenizer, url, args, lookahead=0)
    worker = _worker(tokenizer, url, args, latency=_jitter)
    trainer = FakeTrainer(worker, args, tokenizer)
    trainer.begin()
    try:
        for _ in range(8):
            trainer.step()
        assert worker.controller is not None
        evicted = worker.controller.state.counters.groups_evicted
    finally:
        worker.stop()
    assert sum(trainer.metrics.get("sample/dropped_stale_total", [])) == 0
    assert len(trainer.metrics["sample/staleness_max"]) >= 8 * 2 * G
    assert max(trainer.metrics["sample/staleness_max"]) <= 1
    store = EventStore.open(url)
    try:
        run_id = worker.run_id or ""
        selected = read_where(store, run_id, event_type="GroupSelected")
        staleness = [CODEC.decode(e).staleness for e in selected]  # type: ignore[attr-defined]
        assert len(staleness) == 8 * 2 and max(staleness) <= 1
        assert evicted == len(read_where(store, run_id, event_type="GroupEvicted")) == 0
    finally:
        store.close()


TRL_LOGGER = "trl.experimental.async_grpo.async_grpo_trainer"


def _on_loop(worker: RolloutlogWorker, fn: Callable[[], T]) -> T:
    """``fn()`` on the worker's loop (the state is the loop's: no torn reads)."""

    async def call() -> T:
        return fn()

    return worker._call(call())


def _ran_ahead(worker: RolloutlogWorker, lookahead: int) -> bool:
    """Generation is as far ahead as the lookahead lets it, and the next step is handed."""
    assert worker.controller is not None
    state = worker.controller.state
    return (
        state.dispatch_cursor > state.train_step + lookahead
        and not state.live_groups(Phase.ADMITTED)
        and worker._next_step == state.train_step + 2
    )


def _wait(what: Callable[[], bool], deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while not what():
        assert time.monotonic() < end, "generation did not run ahead within the deadline"
        time.sleep(0.01)


def _trl_drops(caplog: pytest.LogCaptureFixture, metrics: dict[str, list[Any]]) -> tuple[int, int]:
    """TRL's own count of dropped stale samples: its metric and its log lines."""
    logged = [r for r in caplog.records if "dropping stale sample" in r.getMessage()]
    return int(sum(metrics.get("sample/dropped_stale_total", []))), len(logged)


def test_generation_ahead_of_a_slow_trainer_is_evicted_by_the_log_not_dropped_by_trl(
    tokenizer: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """max_staleness=1, lookahead=2, a trainer slower than generation (each step waits
    until generation ran as far ahead as it may): every step from 2 on was generated two
    versions before it trains. rolloutlog evicts those groups (GroupEvicted in the log,
    the stale-eviction metric, the worker's metric in TRL's queue) a version before they
    are stale and refills their slots; TRL's RolloutQueueDataset drops no sample (its
    counter and its log line), every sample it sees is within max_staleness, and the
    replay tool re-decides every eviction from the log."""
    from accelerate import PartialState

    PartialState(cpu=True)  # TRL's logger (accelerate's) needs it to log a drop
    caplog.set_level(logging.INFO, logger=TRL_LOGGER)
    lookahead, steps = 2, 8
    args = _args(tmp_path, max_staleness=1)
    url = f"sqlite:///{tmp_path / 'log.db'}"
    worker = _worker(tokenizer, url, args, lookahead=lookahead, dataset=_dataset(120))
    trainer = FakeTrainer(worker, args, tokenizer)
    trainer.begin()
    try:
        for _ in range(steps):
            _wait(lambda: _on_loop(worker, lambda: _ran_ahead(worker, lookahead)))
            trainer.step()
        assert worker.steps_recorded == steps
    finally:
        worker.stop()
    pushed = 0.0
    while not worker.metrics_queue.empty():
        pushed += worker.metrics_queue.get_nowait().get("rolloutlog/groups_evicted_stale_total", 0)
    assert _trl_drops(caplog, trainer.metrics) == (0, 0)
    assert max(trainer.metrics["sample/staleness_max"]) <= 1
    assert len(trainer.metrics["sample/staleness_max"]) >= steps * 2 * G
    store = EventStore.open(url)
    try:
        run_id = worker.run_id or ""
        evicted = [CODEC.decode(e) for e in read_where(store, run_id, event_type="GroupEvicted")]
        # Steps 2..8 were generated two versions ahead (step 9's eviction may follow the
        # last publish after the trainer stopped fetching).
        steps_evicted = {e.target_step for e in evicted}  # type: ignore[attr-defined]
        assert set(range(2, steps + 1)) <= steps_evicted <= set(range(2, steps + 2))
        assert all(
            e.reason == "stale at its train step: staleness 2 > bound 1"  # type: ignore[attr-defined]
            and e.staleness == 2  # type: ignore[attr-defined]
            for e in evicted
        )
        n = len(evicted)
        assert n >= 2 * (steps - 1)
        assert worker.controller is not None
        assert worker.controller.state.counters.groups_evicted == n
        report = project_history(store, run_id)
        (family,) = [f for f in report.families() if f.name == "rollout_groups_evicted_total"]
        by_label = {tuple(sorted(dict(x.labels).items())): x.value for x in family.samples}
        assert by_label[(("reason", "stale"), ("recovered", "false"))] == n
        assert 0 < pushed <= n  # the worker's metric: evictions up to its last hand-off
        selected = read_where(store, run_id, event_type="GroupSelected")
        staleness = [CODEC.decode(e).staleness for e in selected]  # type: ignore[attr-defined]
        assert len(staleness) == steps * 2 and max(staleness) <= 1
        assert verify_decisions(store, run_id).mismatch is None
    finally:
        store.close()

    # The count above is TRL's: the same dataset drops a sample one version too old.
    sample = _trl_sample_class()(
        prompt=[],
        completion=[],
        input_ids=np.ones(4, dtype=np.int64),
        completion_mask=np.ones(4, dtype=np.int64),
        old_log_probs=np.zeros(4, dtype=np.float32),
        advantage=0.0,
        model_version=1,
        group_id=0,
        metrics={},
    )
    fresh = dataclasses.replace(sample, model_version=3)
    q: queue.Queue[Any] = queue.Queue()
    q.put(sample)
    q.put(fresh)
    metrics: dict[str, list[Any]] = defaultdict(list)
    control = RolloutQueueDataset(q, lambda: 3, lambda _s: None, 30.0, metrics, max_staleness=1)
    assert next(iter(control))["group_id"] == 0 and int(fresh.model_version) == 3
    assert _trl_drops(caplog, metrics) == (1, 1)


def test_resume_from_on_save_checkpoint(tokenizer: Any, tmp_path: Path) -> None:
    args = _args(tmp_path)
    url = f"sqlite:///{tmp_path / 'log.db'}"
    worker = _worker(tokenizer, url, args, latency=0.02)
    trainer = FakeTrainer(worker, args, tokenizer)
    trainer.begin()
    try:
        for _ in range(3):
            trainer.step()
        folder = trainer.save()
        # taken by TRL (queued, prefetched) but not trained at the save
        taken = {g for h in worker._handed for g in h.group_ids}
        trainer.step()  # trained after the checkpoint: comes back after the resume
        trainer.step()
    finally:
        worker.stop()  # the run ends here (a crash would leave the same log, less aborts)
    ckpt = read_checkpoint(folder)
    assert (folder / CHECKPOINT_FILE).is_file() and ckpt.train_step == 3
    assert taken

    resumed = _worker(tokenizer, url, args, latency=0.02)
    trainer2 = FakeTrainer(resumed, args, tokenizer, global_step=3)
    trainer2.begin()  # on_train_begin finds checkpoint-3 and restores the worker
    try:
        for _ in range(4):
            trainer2.step()
        assert resumed.recovery is not None
        report = resumed.recovery
        assert report.complete_groups_restored + report.unfinished_groups_found > 0
        assert taken <= set(trainer2.trained_groups)  # they came back and trained
    finally:
        resumed.stop()
    store = EventStore.open(url)
    try:
        run_id = resumed.run_id or ""
        ledger = build_ledger(store, run_id)
        state = state_at(store, run_id, None)
        check = cross_check(ledger, state)
        assert check.prompts_lost == 0
        assert check.prompts_trained_twice == 0
        assert check.prompts_trained == 7 * 2
        # the groups in flight at the checkpoint: their completions made after it were
        # salvaged into the new epoch, and those siblings were not generated again
        assert report.siblings_salvaged > 0
        salvaged: dict[int, set[int]] = defaultdict(set)
        for row in read_where(store, run_id, event_type="SiblingCompleted"):
            ev = CODEC.decode(row)
            if row.epoch == 2 and ev.salvaged_from is not None:  # type: ignore[attr-defined]
                salvaged[ev.group_id].add(ev.sibling)  # type: ignore[attr-defined]
        assert sum(len(v) for v in salvaged.values()) == report.siblings_salvaged
        for gid, sibs in salvaged.items():
            rows = read_where(store, run_id, group_id=gid, event_type="SiblingDispatched")
            assert any(row.epoch == 1 for row in rows)  # generated before the checkpoint
            again = {CODEC.decode(r).sibling for r in rows if r.epoch == 2}  # type: ignore[attr-defined]
            assert not sibs & again
            assert gid in trainer2.trained_groups
    finally:
        store.close()


def test_resume_refusals(tokenizer: Any, tmp_path: Path) -> None:
    args = _args(tmp_path)
    url = f"sqlite:///{tmp_path / 'log.db'}"
    worker = _worker(tokenizer, url, args)
    empty = tmp_path / "out" / "checkpoint-9"
    empty.mkdir(parents=True)
    with pytest.raises(CheckpointStateMissingError, match=r"has no rolloutlog_state\.json"):
        worker.resume_from(str(empty))
    trainer = FakeTrainer(worker, args, tokenizer)
    trainer.begin()
    try:
        trainer.step()
        folder = trainer.save()
    finally:
        worker.stop()
    other = _worker(tokenizer, url, args, dataset=_dataset(41))
    with pytest.raises(LogMismatchError, match="resume with the same train_dataset"):
        other.resume_from(str(folder))
    with pytest.raises(UnsupportedTrlFeatureError, match="not a dict of them"):
        _worker(tokenizer, url, args, environment_factory={"sum": SumEnv})
    with pytest.raises(TrlConfigError, match="no reset method"):
        _worker(tokenizer, url, args, environment_factory=object)
    with pytest.raises(TrlConfigError, match="pass named functions as tools"):
        _worker(tokenizer, url, args, tools=[lambda a: a])


def test_streaming_dataset(tokenizer: Any, tmp_path: Path) -> None:
    rows = _dataset(16).to_list()
    stream = IterableDataset.from_generator(lambda: iter(rows))
    args = _args(tmp_path)
    url = f"sqlite:///{tmp_path / 'log.db'}"
    worker = _worker(tokenizer, url, args, dataset=stream, dataset_size=16)
    trainer = FakeTrainer(worker, args, tokenizer)
    trainer.begin()
    try:
        for _ in range(3):
            trainer.step()
        assert worker.controller is not None
        keys = {(g.data_pass, g.prompt_index) for g in worker.controller.state.groups.values()}
        assert worker.controller.state.counters.groups_trained == 6
        assert all(0 <= i < 16 for _, i in keys)
    finally:
        worker.stop()


def test_weight_transfer_publishes_the_trainers_weights(tokenizer: Any, tmp_path: Path) -> None:
    """RolloutlogWeightTransfer: TRL's send_weights, then update_model_version, loads the
    trainer's tensors into the backend (strict names and shapes) and records the version;
    without a transfer, ``policy=`` is the weights the worker refits its backend from."""
    import torch

    from rolloutlog.integrations.trl import NoOpWeightTransfer, RolloutlogWeightTransfer

    policy = torch.nn.Linear(3, 2)
    shapes = {n: list(p.shape) for n, p in policy.named_parameters()}
    for use_transfer in (True, False):
        args = _args(tmp_path / str(use_transfer))
        backend = DeterministicBackend(
            vocab_size=len(tokenizer),
            max_model_len=128,
            eos_token_id=tokenizer.eos_token_id,
            weight_shapes=shapes,
        )
        worker = RolloutlogWorker(
            store=f"sqlite:///{tmp_path / f'{use_transfer}.db'}",
            train_dataset=_dataset(),
            processing_class=tokenizer,
            reward_funcs=length_reward,
            backend=backend,
            args=args,
            policy=None if use_transfer else policy,
            timeout_s=60,
        )
        transfer = RolloutlogWeightTransfer(worker) if use_transfer else NoOpWeightTransfer()
        trainer = FakeTrainer(worker, args, tokenizer)
        transfer.init_weight_transfer()
        transfer.pause()
        transfer.send_weights(iter(list(policy.named_parameters())))
        transfer.resume()
        trainer.begin()
        try:
            for _ in range(2):
                with torch.no_grad():
                    policy.weight.add_(1.0)
                transfer.pause()
                transfer.send_weights(iter(list(policy.named_parameters())))
                transfer.resume()
                trainer.step()
            assert worker.controller is not None
            assert worker.controller.state.published_version == 2
            assert [v for v, _ in backend.weight_updates] == [1, 2]
            assert set(backend.weight_updates[-1][1]) == set(shapes)  # strict names
        finally:
            worker.stop()
            transfer.destroy()


def test_data_running_out_is_one_clear_error(tokenizer: Any, tmp_path: Path) -> None:
    """One pass over 8 prompts (4 steps of 2 groups): TRL's dataset asks for more and the
    worker's health check names the cause instead of letting the trainer wait forever."""
    args = _args(tmp_path)
    url = f"sqlite:///{tmp_path / 'log.db'}"
    worker = _worker(tokenizer, url, args, dataset=_dataset(8), passes=1)
    trainer = FakeTrainer(worker, args, tokenizer)
    trainer.begin()
    try:
        for _ in range(3):
            trainer.step()
        with pytest.raises(WorkerFailedError, match="the data ran out before train step 4"):
            trainer.step()  # its prefetch asks for step 4
    finally:
        worker.stop()


def test_epochs_counted_in_the_log_stop_training(tokenizer: Any, tmp_path: Path) -> None:
    """epochs=1 over 8 prompts (2 groups a step): training stops at the 4th optimizer step,
    counted from the log (so a resumed run would stop at the same point)."""
    args = _args(tmp_path)
    url = f"sqlite:///{tmp_path / 'log.db'}"
    worker = _worker(tokenizer, url, args, dataset=_dataset(8), epochs=1)
    trainer = FakeTrainer(worker, args, tokenizer)
    trainer.begin()
    try:
        stopped_at = None
        for step in range(1, 6):
            trainer.step()
            if trainer.control.should_training_stop:
                stopped_at = step
                break
        assert stopped_at == 4 and trainer.control.should_save
        assert worker.trained_groups() == 8
        assert max(worker.callback.step_ms) < 1000
    finally:
        worker.stop()


# ---------------------------------------------------------------- multi-turn (TRL's tools)

ADD_RUNS: list[tuple[int, int]] = []


def add(a: int, b: int) -> str:
    """A plain TRL tool: each run is counted (a resume must not run it again)."""
    ADD_RUNS.append((int(a), int(b)))
    return str(int(a) + int(b))


class SumEnv:
    """A TRL environment: reset(**row), public methods as tools, get_reward."""

    def __init__(self) -> None:
        self.target: int | None = None
        self.answer: int | None = None

    def reset(self, **row: Any) -> str | None:
        self.target, self.answer = int(row["a"]) + int(row["b"]), None
        return None

    def submit(self, answer: int) -> str:
        self.answer = int(answer)
        return "received"

    def get_reward(self) -> float:
        return 1.0 if self.answer == self.target else 0.0


def _calls(text: str) -> list[ToolCall]:
    """The tiny tokenizer's tool protocol: ``call NAME(ARGS)``."""
    out = []
    for name, raw in re.findall(r"call (\w+)\(([\d,]*)\)", text):
        values = [int(v) for v in raw.split(",") if v]
        keys = ("a", "b") if name == "add" else ("answer",)
        out.append(ToolCall(name, dict(zip(keys, values, strict=False))))
    return out


def _mt_dataset(n: int = 60) -> Dataset:
    a, b = [i % 7 for i in range(n)], [(3 * i + 1) % 5 for i in range(n)]
    return Dataset.from_dict(
        {"prompt": [f"add {x} and {y}" for x, y in zip(a, b, strict=True)], "a": a, "b": b}
    )


def _mt_script(tokenizer: Any) -> Callable[[GroupRequest, SiblingSpec], list[int]]:
    """The model: calls add, then submits the sum, then says done."""

    def enc(text: str) -> list[int]:
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]

    def script(request: GroupRequest, spec: SiblingSpec) -> list[int]:
        ctx = tokenizer.decode(list(request.prompt_token_ids), skip_special_tokens=True)
        if "received" in ctx:
            return enc("done.")
        found = re.search(r"call add\((\d+),(\d+)\)(\d+)", ctx)
        if found:
            return enc(f"call submit({found.group(3)})")
        x, y = re.search(r"add (\d+) and (\d+)", ctx).groups()  # type: ignore[union-attr]
        return enc(f"call add({x},{y})")

    return script


def answer_reward(completions: list[Any], a: list[int], b: list[int], **kw: Any) -> list[float]:
    return [float(f"submit({x + y})" in c) for c, x, y in zip(completions, a, b, strict=True)]


def _cut_after_add(worker: RolloutlogWorker, step: int) -> bool:
    """Every trajectory of ``step``'s groups has its add call's result."""
    assert worker.controller is not None and worker.trajectories is not None
    state, book = worker.controller.state, worker.trajectories.book
    groups = [g for g in state.groups.values() if g.target_step == step]
    trajectories = [book.get((g.group_id, i)) for g in groups for i in range(len(g.siblings))]
    return bool(groups) and all(
        t is not None and any(c.tool == "add" and c.status == "completed" for c in t.tool_calls)
        for t in trajectories
    )


def _mt_worker(
    tokenizer: Any, url: str, args: AsyncGRPOConfig, latency: Any = 0.0
) -> RolloutlogWorker:
    backend = DeterministicBackend(
        vocab_size=len(tokenizer),
        max_model_len=256,
        eos_token_id=tokenizer.eos_token_id,
        seed=0,
        latency=latency,
        script=_mt_script(tokenizer),
    )
    return RolloutlogWorker(
        store=url,
        train_dataset=_mt_dataset(),
        processing_class=tokenizer,
        reward_funcs=[answer_reward],
        backend=backend,
        args=args,
        timeout_s=60,
        tools=[add],
        environment_factory=SumEnv,
        tool_parser=_calls,
        generation=GenerationConfig(max_tokens=96),
        multi_turn=MultiTurnConfig(max_turns=4, max_tokens_per_turn=24),
    )


def test_tools_and_environment_factory_reach_trl_masked_and_resume_reuses_tools(
    tokenizer: Any, tmp_path: Path
) -> None:
    """TRL's tools and environment_factory on the worker: each trajectory (model calls
    add, a plain tool; then submit, the environment's method; then ends) reaches TRL's
    RolloutQueueDataset and collator with the tool results masked out of the loss
    (completion_mask 0), the environment's get_reward as TRL's rewards/SumEnv column, and
    a resume from an on_save checkpoint runs no tool call a second time (trajectories cut
    after their add call resume with its recorded result)."""
    ADD_RUNS.clear()
    args = _args(tmp_path)
    url = f"sqlite:///{tmp_path / 'log.db'}"
    holder: list[RolloutlogWorker] = []

    def stall_late_submits(request: GroupRequest) -> float:
        # The first run's trajectories of step 4 (dispatched after the last publish of
        # this run) stop after their add call (the stop cuts them): the resume must
        # finish them without running add again.
        ctl = holder[0].controller
        assert ctl is not None
        group = ctl.state.groups.get(request.group_id)
        late = group is not None and (group.target_step or 0) >= 4
        ctx = tokenizer.decode(list(request.prompt_token_ids), skip_special_tokens=True)
        return 60.0 if late and "call add(" in ctx else 0.0

    worker = _mt_worker(tokenizer, url, args, latency=stall_late_submits)
    holder.append(worker)
    trainer = FakeTrainer(worker, args, tokenizer)
    trainer.begin()
    try:
        for _ in range(2):
            trainer.step()
        folder = trainer.save()
        _wait(lambda: _on_loop(worker, lambda: _cut_after_add(worker, 4)))
    finally:
        worker.stop()
    runs_before = len(ADD_RUNS)

    # What TRL got: prompt, then add's call (model), its result (tool), submit's call
    # (model), its result (environment), "done." (model).
    def enc(text: str) -> list[int]:
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]

    example = trainer.examples[0]
    ids = [int(t) for t in example["input_ids"]]
    mask = [int(m) for m in example["completion_mask"]]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    x, y = (int(v) for v in re.match(r"add (\d) and (\d)", text).groups())  # type: ignore[union-attr]
    prompt = [int(t) for t in tokenizer(f"add {x} and {y}", add_special_tokens=True)["input_ids"]]
    parts = [
        (f"call add({x},{y})", 1),
        (str(x + y), 0),
        (f"call submit({x + y})", 1),
        ("received", 0),
        ("done.", 1),
    ]
    assert ids == prompt + [t for text, _ in parts for t in enc(text)]
    assert mask == [0] * len(prompt) + [m for text, m in parts for _ in enc(text)]
    assert example["old_log_probs"][len(prompt) + len(enc(parts[0][0]))] == 0.0  # a tool token
    assert example["metrics"]["rewards/SumEnv"] == 1.0
    assert example["metrics"]["rewards/answer_reward"] == 1.0
    assert example["metrics"]["reward"] == 2.0
    # TRL's collator packed the mask: its trained tokens are the model tokens only
    assert min(trainer.metrics["sample/trained_tokens_mean"]) < len(ids) - len(prompt)
    assert all(int(e["completion_mask"].sum()) < len(e["input_ids"]) - 1 for e in trainer.examples)

    resumed = _mt_worker(tokenizer, url, args)
    resumed.resume_from(str(folder))
    trainer2 = FakeTrainer(resumed, args, tokenizer, global_step=2)
    trainer2.begin()
    try:
        for _ in range(3):
            trainer2.step()
        assert resumed.trajectories is not None
        stats = resumed.trajectories.stats
        assert stats.trajectories_resumed >= 1 and stats.tool_results_reused >= 1
    finally:
        resumed.stop()
    assert len(ADD_RUNS) > runs_before
    store = EventStore.open(url)
    try:
        requested = [
            CODEC.decode(e)
            for e in read_where(store, resumed.run_id or "", event_type="ToolCallRequested")
        ]
        add_keys = {e.idempotency_key for e in requested if e.tool == "add"}  # type: ignore[attr-defined]
        completed = [
            CODEC.decode(e).idempotency_key  # type: ignore[attr-defined]
            for e in read_where(store, resumed.run_id or "", event_type="ToolCallCompleted")
        ]
        # Each add call ran at most once, the resume included (a call the stop cut
        # between its request and its result is not run again: TRL's tools are neither
        # idempotent nor checkable), and each result is recorded once.
        assert len(ADD_RUNS) <= len(add_keys)
        assert len(completed) == len(set(completed))
        assert len(ADD_RUNS) == len([k for k in completed if k in add_keys])
        assert not [e for e in requested if e.tool not in ("add", "submit")]  # type: ignore[attr-defined]
    finally:
        store.close()
    for e in trainer2.examples:
        n = len(e["input_ids"])
        assert 0 < int(e["completion_mask"].sum()) < n


def test_checkpoint_does_not_wait_for_the_publish_in_flight(tokenizer: Any, tmp_path: Path) -> None:
    """``wait_for_publish=False`` with slow generation: each weight sync's publish runs on
    the worker's loop and waits for in-flight generation to drain. The save does not wait
    for it: the checkpoint records the steps TRL trained (and no later ones), and at its
    offset the log has not recorded the last step's publish yet. A resume from it is
    lossless and republishes the checkpoint's weight version before generating."""
    args = _args(tmp_path)
    url = f"sqlite:///{tmp_path / 'log.db'}"
    worker = _worker(tokenizer, url, args, latency=0.3, wait_for_publish=False)
    trainer = FakeTrainer(worker, args, tokenizer)
    trainer.begin()
    try:
        for _ in range(3):
            trainer.step()
        folder = trainer.save()
        trainer.step()  # trained after the checkpoint: not part of it
        trainer.step()
    finally:
        worker.stop()  # waits for the publishes and the checkpoint's file
    ckpt = read_checkpoint(folder)
    assert (ckpt.train_step, ckpt.weight_version, ckpt.trl_global_step) == (3, 3, 3)
    assert ckpt.trl_model_version == 4  # TRL's numbering: the cold sync was version 1
    run_id = worker.run_id or ""
    store = EventStore.open(url)
    try:
        at_ckpt = state_at(store, run_id, ckpt.offset)
        assert (at_ckpt.train_step, at_ckpt.weight_version) == (3, 3)
        assert at_ckpt.published_version < 3  # the publish was still draining
        published = [
            CODEC.decode(r).weight_version  # type: ignore[attr-defined]
            for r in read_where(store, run_id, event_type="WeightsPublished")
        ]
        # Coalesced publishes skip versions, but they are recorded in order, up to the
        # last step trained.
        assert published == sorted(set(published)) and published[-1] == 5
    finally:
        store.close()
    assert not trainer.metrics.get("sample/dropped_stale_total")

    resumed = _worker(tokenizer, url, args, latency=0.02, wait_for_publish=False)
    trainer2 = FakeTrainer(resumed, args, tokenizer, global_step=3)
    trainer2.begin()
    try:
        assert resumed.backend.weight_version == 3  # the checkpoint's weights, republished
        for _ in range(4):
            trainer2.step()
    finally:
        resumed.stop()
    assert not trainer2.metrics.get("sample/dropped_stale_total")
    store = EventStore.open(url)
    try:
        ledger = build_ledger(store, run_id)
        check = cross_check(ledger, state_at(store, run_id, None))
        assert check.prompts_lost == 0
        assert check.prompts_trained_twice == 0
        assert check.prompts_trained == 7 * 2
        republished = [
            CODEC.decode(r).weight_version  # type: ignore[attr-defined]
            for r in read_where(store, run_id, event_type="WeightsPublished")
            if r.epoch == 2
        ]
        assert republished[0] == 3
    finally:
        store.close()


class _ElsewhereLoaded(DeterministicBackend):
    """A backend whose weights arrive another way (as nccl_vllm_backend's): a publish
    tells it the version. Counts what it saw in flight when the version changed."""

    loads_weights_elsewhere = True

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.in_flight_at_swap: list[int] = []

    async def update_weights(self, named_tensors: Any, version: int) -> None:
        names = [n for n, _ in named_tensors]
        assert names == ["rolloutlog.weight_version_marker"]  # no weights through here
        self.in_flight_at_swap.append(len(self._inflight))
        self._weight_version = version


class _FakeNcclClient:
    """TRL's WeightTransferClient's calls, recorded (the NCCL side needs GPUs)."""

    def __init__(self, worker: RolloutlogWorker) -> None:
        self.worker = worker
        self.calls: list[str] = []
        self.generating_at_send: list[int] = []

    def init_weight_transfer(self) -> None:
        self.calls.append("init")

    def pause(self) -> None:
        self.calls.append("pause")

    def send_weights(self, iterator: Any) -> None:
        runtime = self.worker.runtime
        self.generating_at_send.append(-1 if runtime is None else runtime.generating)
        self.calls.append(f"send {sum(1 for _ in iterator)}")

    def resume(self) -> None:
        self.calls.append("resume")

    def destroy(self) -> None:
        self.calls.append("destroy")


def test_nccl_transfer_drains_generation_and_records_the_version(
    tokenizer: Any, tmp_path: Path
) -> None:
    """NcclWeightTransfer on the CPU (TRL's client faked): ``pause`` drains the worker's
    generation before the weights are sent (no completion mixes two versions), the
    backend is told each version without being sent weights, and the log records every
    publish; a backend that loads weights itself is refused with one line."""
    from rolloutlog.integrations.trl import NcclWeightTransfer

    args = _args(tmp_path)
    url = f"sqlite:///{tmp_path / 'log.db'}"
    with pytest.raises(TrlConfigError, match="needs the worker's backend from nccl_vllm_backend"):
        NcclWeightTransfer(_worker(tokenizer, url, args), _FakeNcclClient(None))  # type: ignore[arg-type]
    backend = _ElsewhereLoaded(
        vocab_size=len(tokenizer), max_model_len=128, eos_token_id=tokenizer.eos_token_id,
        latency=0.05,
    )  # fmt: skip
    worker = RolloutlogWorker(
        store=url,
        train_dataset=_dataset(),
        processing_class=tokenizer,
        reward_funcs=[length_reward],
        backend=backend,
        args=args,
        timeout_s=60,
    )
    client = _FakeNcclClient(worker)
    transfer = NcclWeightTransfer(worker, client)
    trainer = FakeTrainer(worker, args, tokenizer)
    transfer.init_weight_transfer()
    trainer.begin()
    try:
        for _ in range(3):  # FakeTrainer.step with TRL's weight sync through the transfer
            for _ in range(args.gradient_accumulation_steps):
                _batch, gids = next(trainer._batches)
                trainer.trained_groups.extend(dict.fromkeys(gids))
            trainer.state.global_step += 1
            worker.callback.on_step_end(args, trainer.state, trainer.control)
            transfer.pause()
            transfer.send_weights(iter([("w", np.zeros(2))]))
            transfer.resume()
            trainer._sync()
        assert worker.controller is not None
        assert worker.controller.state.published_version == 3
        assert backend.weight_version == 3
    finally:
        worker.stop()
        transfer.destroy()
    assert client.calls == ["init"] + ["pause", "send 1", "resume"] * 3 + ["destroy"]
    assert client.generating_at_send == [0, 0, 0]  # drained before every transfer
    assert backend.in_flight_at_swap == [0, 0, 0]
    assert not trainer.metrics.get("sample/dropped_stale_total")
    store = EventStore.open(url)
    try:
        published = [
            CODEC.decode(r).weight_version  # type: ignore[attr-defined]
            for r in read_where(store, worker.run_id or "", event_type="WeightsPublished")
        ]
        assert published == [1, 2, 3]
    finally:
        store.close()

"""``rolloutlog bench trl``: what a rollout worker costs inside TRL's ``AsyncGRPOTrainer``.

Also home of the baseline: :class:`InMemoryRolloutWorker`, a minimal worker that follows
TRL's ``RolloutWorkerProtocol`` (``trl.experimental.async_grpo``) and keeps nothing: it
generates each group on a rolloutlog :class:`GenerationBackend`, scores it with TRL's
reward-function signature, computes TRL's group advantages and puts ``RolloutSample``\\ s
on its queue. The tests train TRL's real trainer with it on CPU
(``tests/integrations/``).

The measurement (:func:`run_trl_benchmark`) drives each worker exactly as the trainer's
main process does, minus the model step: ``start()``, then TRL's own consumer path
(``RolloutQueueDataset`` -> ``FixedCountBatcher`` -> ``DataCollatorForRollout``, the real
classes) for ``steps`` optimizer steps of ``batch_size`` samples, ``update_model_version``
after each step (the trainer's weight sync), the worker's ``TrainerCallback``\\ s fired
through transformers' ``CallbackHandler`` at each step's events (``on_save`` every
``save_steps``), then ``stop()``. Rounds alternate between the worker under test and the
in-memory baseline on the same backend kind, same model, same run.

- ``samples_per_s_vs_in_memory_worker``: samples delivered per second by the worker
  under test / by the in-memory worker (best round each; target >= 0.97);
- ``callback_ms_per_step``: mean time per step spent inside the worker's own callbacks
  (target <= 1).

The worker under test is rolloutlog's, from ``rolloutlog.integrations.trl``, when that
module exists and exposes ``bench_worker_factory`` (a :data:`WorkerFactory`); otherwise
the in-memory worker is measured against itself (``worker_under_test`` says which).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import math
import queue
import shutil
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolloutlog.controller.backends import make_backend
from rolloutlog.controller.backends.base import (
    GenerationBackend,
    GroupRequest,
    SamplingConfig,
    SiblingSpec,
)
from rolloutlog.eventstore.errors import RolloutlogError

#: The module that holds rolloutlog's TRL worker (measured when present).
ROLLOUTLOG_TRL_MODULE = "rolloutlog.integrations.trl"
#: The factory that module must expose to be measured.
ROLLOUTLOG_FACTORY_NAME = "bench_worker_factory"

GOALS = {"samples_per_s_vs_in_memory_worker": 0.97, "callback_ms_per_step": 1.0}


class TrlBenchError(RolloutlogError, RuntimeError):
    """The benchmark could not run (TRL missing, a worker failed)."""


@dataclass
class WorkerContext:
    """What a worker factory gets: the run's model, data, rewards and generation settings."""

    model_dir: Path
    output_dir: Path
    #: The trainer's ``train_dataset`` (map-style here; column ``prompt`` plus reward columns).
    dataset: Any
    tokenizer: Any
    #: TRL reward functions: ``fn(prompts=, completions=, completion_ids=, **columns)``.
    reward_funcs: list[Callable[..., Any]]
    num_generations: int
    max_completion_length: int
    #: The backend kind (:func:`~rolloutlog.controller.backends.make_backend`).
    backend: str = "deterministic"
    #: Seconds each deterministic-backend request takes.
    generation_latency_s: float = 0.0
    seed: int = 0
    #: The checkpoint the trainer resumes from (``train(resume_from_checkpoint=...)``).
    resume_from_checkpoint: Path | None = None
    #: The trainer's ``AsyncGRPOConfig`` (``max_staleness``, ``save_steps``...).
    config: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def make_backend(self) -> GenerationBackend:
        """A fresh (not started) backend of ``backend`` kind on the context's model."""
        options: dict[str, Any] = {}
        if self.backend == "deterministic" and self.generation_latency_s:
            options["latency"] = self.generation_latency_s
        return make_backend(self.backend, model_dir=self.model_dir, seed=self.seed, **options)


@dataclass
class WorkerParts:
    """What a factory may return instead of a bare worker: the worker, its
    ``WeightTransferProtocol`` implementation (default: :class:`NoWeightTransfer`) and
    the ``TrainerCallback``\\ s the trainer must run."""

    rollout_worker: Any
    weight_transfer: Any = None
    callbacks: Sequence[Any] = ()


#: A factory of rollout workers: ``factory(context) -> worker | WorkerParts``.
WorkerFactory = Callable[[WorkerContext], Any]


def as_parts(built: Any) -> WorkerParts:
    """A factory's result as :class:`WorkerParts` (a bare worker gets a no-op transfer)."""
    parts = built if isinstance(built, WorkerParts) else WorkerParts(built)
    for attr in ("rollout_buffer", "metrics_queue", "start", "stop", "update_model_version"):
        if not hasattr(parts.rollout_worker, attr):
            raise TypeError(
                f"{type(parts.rollout_worker).__name__} is not a TRL rollout worker: no {attr!r}"
            )
    if parts.weight_transfer is None:
        parts.weight_transfer = NoWeightTransfer()
    return parts


class NoWeightTransfer:
    """TRL's ``WeightTransferProtocol`` doing nothing (the backend keeps its weights).

    Counts the calls, so a test can see the trainer's weight syncs happen.
    """

    def __init__(self) -> None:
        self.syncs = 0
        self.tensors = 0

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def send_weights(self, iterator: Any) -> None:
        self.syncs += 1
        self.tensors += sum(1 for _ in iterator)

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        pass


def answer_reward(
    prompts: list[Any], completions: list[str], completion_ids: list[list[int]], **columns: Any
) -> list[float]:
    """A TRL reward function for the addition prompts: 1 if the answer appears in the
    completion, plus a small share for digits (so a group's rewards differ)."""
    answers = columns.get("answer") or [""] * len(completions)
    rewards = []
    for text, answer in zip(completions, answers, strict=True):
        digits = sum(ch.isdigit() for ch in text) / max(len(text), 1)
        rewards.append(float(bool(answer) and str(answer) in text) + 0.1 * digits)
    return rewards


def group_advantages(rewards: Sequence[float | None]) -> tuple[list[float], float, float]:
    """TRL's advantages of one group (``AsyncRolloutWorker._score_group``): ``(r - mean) /
    (std + 1e-8)`` over the scored rewards (population std), 0 for an unscored one.
    Returns the advantages, the mean and the std (NaN when nothing was scored)."""
    scored = [float(r) for r in rewards if r is not None and not math.isnan(r)]
    if not scored:
        return [0.0] * len(rewards), math.nan, math.nan
    mean = statistics.fmean(scored)
    std = statistics.pstdev(scored)
    advantages = [
        0.0 if r is None or math.isnan(r) else (float(r) - mean) / (std + 1e-8) for r in rewards
    ]
    return advantages, mean, std


def _reward_name(func: Callable[..., Any]) -> str:
    return getattr(func, "__name__", type(func).__name__)


class InMemoryRolloutWorker:
    """A minimal TRL rollout worker on a rolloutlog backend: nothing persisted.

    Follows ``RolloutWorkerProtocol``: ``rollout_buffer`` and ``metrics_queue`` are
    ``queue.Queue``\\ s; ``start()`` runs the generation loop (``max_inflight_groups``
    groups at a time) on a thread of its own; ``stop()`` ends it and closes the backend;
    ``update_model_version`` sets the version new groups are tagged with;
    ``check_health`` raises when the loop failed or made no progress for
    ``stale_after_s``. Group ``g`` is prompt ``(start_index + g) % len(dataset)``, with
    ``group_id = start_index + g``. Samples are tagged with the trainer's model version
    at dispatch (the backend's own weights move only if a weight transfer moves them).
    """

    def __init__(
        self,
        *,
        dataset: Any,
        tokenizer: Any,
        backend: GenerationBackend,
        reward_funcs: Sequence[Callable[..., Any]],
        num_generations: int,
        max_completion_length: int,
        temperature: float = 1.0,
        max_inflight_groups: int = 2,
        queue_maxsize: int = 256,
        start_index: int = 0,
        prompt_column: str = "prompt",
    ) -> None:
        if num_generations < 1 or max_inflight_groups < 1:
            raise ValueError("num_generations and max_inflight_groups must be >= 1")
        if len(dataset) == 0:
            raise ValueError("the dataset is empty")
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.backend = backend
        self.reward_funcs = list(reward_funcs)
        self.num_generations = num_generations
        self.sampling = SamplingConfig(max_tokens=max_completion_length, temperature=temperature)
        self.max_inflight_groups = max_inflight_groups
        self.start_index = start_index
        self.prompt_column = prompt_column
        self.rollout_buffer: queue.Queue[Any] = queue.Queue(maxsize=queue_maxsize)
        self.metrics_queue: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=4096)
        self.model_version = 0
        self.groups_generated = 0
        self.samples_enqueued = 0
        self._next_group = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._heartbeat = time.time()

    # -- RolloutWorkerProtocol

    def start(self) -> None:
        if self._thread is not None:
            return
        self._heartbeat = time.time()
        self._thread = threading.Thread(
            target=self._run, name="rolloutlog-trl-in-memory-worker", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=60)
            if thread.is_alive():
                raise TrlBenchError("the in-memory rollout worker did not stop within 60 s")

    def update_model_version(self, model_version: int) -> None:
        self.model_version = int(model_version)

    def check_health(self, stale_after_s: float) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"in-memory rollout worker failed: {type(self._error).__name__}: {self._error}"
            ) from self._error
        age = time.time() - self._heartbeat
        if age > stale_after_s:
            raise RuntimeError(f"in-memory rollout worker made no progress for {age:.0f} s")

    # -- the loop

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self._error = exc

    async def _main(self) -> None:
        await self.backend.start()
        try:
            await asyncio.gather(*(self._produce() for _ in range(self.max_inflight_groups)))
        finally:
            await self.backend.close()

    async def _produce(self) -> None:
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        while not self._stop.is_set():
            g = self._next_group
            self._next_group += 1
            group_id = self.start_index + g
            row = self.dataset[group_id % len(self.dataset)]
            prompt = row[self.prompt_column]
            prompt_ids = self._encode(prompt)
            version = self.model_version
            request = GroupRequest(
                group_id=group_id,
                prompt_token_ids=tuple(prompt_ids),
                siblings=tuple(SiblingSpec(i, 0) for i in range(self.num_generations)),
                sampling=self.sampling,
            )
            started = time.monotonic()
            results = await self.backend.generate(request)
            self._heartbeat = time.time()
            completion_ids = [list(r.token_ids) for r in results]
            completions = [
                self.tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids
            ]
            columns = {k: [v] * len(results) for k, v in row.items() if k != self.prompt_column}
            per_func = []
            for func in self.reward_funcs:
                kwargs = dict(
                    prompts=[prompt] * len(results),
                    completions=completions,
                    completion_ids=completion_ids,
                    **columns,
                )
                out = func(**kwargs)
                if asyncio.iscoroutine(out):
                    out = await out
                per_func.append([math.nan if r is None else float(r) for r in out])
            rewards: list[float | None] = []
            for i in range(len(results)):
                values = [col[i] for col in per_func if not math.isnan(col[i])]
                rewards.append(sum(values) if values else None)
            advantages, _, std = group_advantages(rewards)
            samples = []
            for i, result in enumerate(results):
                n_prompt, n_completion = len(prompt_ids), len(result.token_ids)
                metrics = {
                    "reward": math.nan if rewards[i] is None else float(rewards[i] or 0.0),
                    "reward_std": std,
                    **{
                        f"rewards/{_reward_name(f)}": col[i]
                        for f, col in zip(self.reward_funcs, per_func, strict=True)
                    },
                }
                samples.append(
                    RolloutSample(
                        prompt=prompt,
                        completion=completions[i],
                        input_ids=_array([*prompt_ids, *result.token_ids], "int64"),
                        completion_mask=_array([0] * n_prompt + [1] * n_completion, "int64"),
                        old_log_probs=_array([0.0] * n_prompt + list(result.logprobs), "float32"),
                        advantage=float(advantages[i]),
                        model_version=version,
                        group_id=group_id,
                        metrics=metrics,
                    )
                )
            self.groups_generated += 1
            self._push_metrics({"rollout/group_s": time.monotonic() - started})
            for sample in samples:
                if not await self._put(sample):
                    return

    def _encode(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise TrlBenchError(
                "conversational prompts need a tokenizer with a chat template; "
                "this one has none (use plain-text prompts)"
            )
        return list(self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True))

    async def _put(self, sample: Any) -> bool:
        while not self._stop.is_set():
            try:
                sample.enqueued_at = time.time()
                self.rollout_buffer.put_nowait(sample)
                self.samples_enqueued += 1
                return True
            except queue.Full:
                self._heartbeat = time.time()
                await asyncio.sleep(0.01)
        return False

    def _push_metrics(self, values: dict[str, Any]) -> None:
        with contextlib.suppress(queue.Full):
            self.metrics_queue.put_nowait(values)


def _array(values: list[Any], dtype: str) -> Any:
    import numpy as np

    return np.asarray(values, dtype=dtype)


def in_memory_worker(context: WorkerContext) -> WorkerParts:
    """The :data:`WorkerFactory` of :class:`InMemoryRolloutWorker` (the baseline).

    Starts at prompt 0 on every run, resumed or not: it keeps nothing.
    """
    worker = InMemoryRolloutWorker(
        dataset=context.dataset,
        tokenizer=context.tokenizer,
        backend=context.make_backend(),
        reward_funcs=context.reward_funcs,
        num_generations=context.num_generations,
        max_completion_length=context.max_completion_length,
        max_inflight_groups=int(context.extra.get("max_inflight_groups", 2)),
        queue_maxsize=_queue_size(context),
    )
    return WorkerParts(worker, NoWeightTransfer())


def _queue_size(context: WorkerContext) -> int:
    """One optimizer step of samples (at least one group), so that what waits in the
    queue is never more than a step or two behind the trainer's version."""
    config = context.config
    if config is None:
        return 256
    per_step = int(config.per_device_train_batch_size) * int(config.gradient_accumulation_steps)
    return max(per_step, context.num_generations)


def rolloutlog_factory() -> WorkerFactory | None:
    """``rolloutlog.integrations.trl.bench_worker_factory`` when that module exists."""
    try:
        module = importlib.import_module(ROLLOUTLOG_TRL_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name is not None and ROLLOUTLOG_TRL_MODULE.startswith(exc.name):
            return None
        raise
    factory = getattr(module, ROLLOUTLOG_FACTORY_NAME, None)
    return factory if callable(factory) else None


# --------------------------------------------------------------------------- measurement


class _TimedCallbacks:
    """Wraps the worker's callbacks: the time spent inside their event methods."""

    def __init__(self, callbacks: Sequence[Any]) -> None:
        self.callbacks = list(callbacks)
        self.seconds = 0.0
        self.by_event: defaultdict[str, float] = defaultdict(float)

    def fire(self, event: str, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for cb in self.callbacks:
            method = getattr(cb, event, None)
            if method is None:
                continue
            t0 = time.perf_counter()
            result = method(args, state, control, **kwargs)
            took = time.perf_counter() - t0
            self.seconds += took
            self.by_event[event] += took
            if result is not None:
                control = result


@dataclass
class RoundResult:
    worker: str
    samples: int
    seconds: float
    callback_s: float
    steps: int
    callback_s_by_event: dict[str, float] = field(default_factory=dict)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def _measure_round(
    name: str,
    factory: WorkerFactory,
    context: WorkerContext,
    *,
    steps: int,
    batch_size: int,
    save_steps: int,
    timeout_s: float,
) -> RoundResult:
    from torch.utils.data import DataLoader
    from transformers import TrainerControl, TrainerState
    from trl.experimental.async_grpo.async_grpo_trainer import (
        DataCollatorForRollout,
        FixedCountBatcher,
        RolloutQueueDataset,
    )

    parts = as_parts(factory(context))
    worker, config = parts.rollout_worker, context.config
    callbacks = _TimedCallbacks(parts.callbacks)
    metrics: defaultdict[str, list[Any]] = defaultdict(list)
    version = {"v": 0}
    dataset = RolloutQueueDataset(
        rollout_queue=worker.rollout_buffer,
        model_version_fn=lambda: version["v"],
        check_health_fn=worker.check_health,
        stale_after_s=timeout_s,
        metrics=metrics,
        max_staleness=config.max_staleness,
        poll_interval_s=0.5,
    )
    collator = DataCollatorForRollout(context.tokenizer.pad_token_id, 1, metrics=metrics)
    loader = DataLoader(
        FixedCountBatcher(dataset, 1, batch_size), batch_size=1, collate_fn=collator, num_workers=0
    )
    state, control = TrainerState(), TrainerControl()
    state.max_steps = steps + 1
    kwargs = {"processing_class": context.tokenizer, "train_dataloader": loader}
    callbacks.fire("on_train_begin", config, state, control, **kwargs)
    parts.weight_transfer.init_weight_transfer()
    version["v"] = 1
    worker.update_model_version(1)
    worker.start()
    samples = 0
    try:
        batches = iter(loader)
        # Step 0 is the warm-up (backend start, first groups): not timed, not counted.
        started = time.perf_counter()
        for step in range(steps + 1):
            if step == 1:
                started, samples, callbacks.seconds = time.perf_counter(), 0, 0.0
                callbacks.by_event.clear()
            callbacks.fire("on_step_begin", config, state, control, **kwargs)
            batch = next(batches)
            samples += int(batch["global_n_forward_tokens"][0] / batch["mean_seq_len"][0] + 0.5)
            callbacks.fire("on_pre_optimizer_step", config, state, control, **kwargs)
            callbacks.fire("on_optimizer_step", config, state, control, **kwargs)
            state.global_step += 1
            callbacks.fire("on_step_end", config, state, control, **kwargs)
            # The trainer's weight sync after each step (weight_sync_steps=1).
            parts.weight_transfer.pause()
            parts.weight_transfer.resume()
            version["v"] += 1
            worker.update_model_version(version["v"])
            if save_steps and state.global_step % save_steps == 0:
                callbacks.fire("on_save", config, state, control, **kwargs)
        seconds = time.perf_counter() - started
        callbacks.fire("on_train_end", config, state, control, **kwargs)
    finally:
        worker.stop()
        parts.weight_transfer.destroy()
    dropped = len(metrics.get("sample/dropped_stale_total", []))
    if dropped:
        raise TrlBenchError(f"{name}: TRL dropped {dropped} stale samples during the round")
    return RoundResult(name, samples, seconds, callbacks.seconds, steps, dict(callbacks.by_event))


def run_trl_benchmark(
    *,
    backend: str = "deterministic",
    steps: int = 20,
    batch_size: int = 8,
    num_generations: int = 4,
    max_completion_length: int = 16,
    save_steps: int = 5,
    rounds: int = 3,
    generation_latency_s: float = 0.05,
    in_flight_groups: int | None = None,
    model_dir: Path | None = None,
    worker_factory: WorkerFactory | None = None,
    timeout_s: float = 300.0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure the worker under test against :class:`InMemoryRolloutWorker`; see the module doc.

    ``worker_factory`` defaults to rolloutlog's (:func:`rolloutlog_factory`) and, when
    that does not exist yet, to the in-memory worker itself. ``in_flight_groups`` (default:
    one step's groups, ``batch_size // num_generations``) bounds the groups each worker
    generates at once (``context.extra["max_inflight_groups"]``), so that both keep the
    same number in flight and the ratio compares their own costs.
    """
    try:
        import trl
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise TrlBenchError(f"bench trl needs TRL: pip install 'trl' ({exc})") from exc
    from rolloutlog.grpo.tiny_model import build_tiny_model

    if steps < 1 or rounds < 1 or batch_size < 1 or num_generations < 1:
        raise ValueError("steps, rounds, batch_size and num_generations must be >= 1")
    if in_flight_groups is None:
        in_flight_groups = max(1, batch_size // num_generations)
    if in_flight_groups < 1:
        raise ValueError(f"in_flight_groups={in_flight_groups}: it must be >= 1")
    say = progress or (lambda _msg: None)
    under_test_name = "rolloutlog"
    if worker_factory is None:
        worker_factory = rolloutlog_factory()
        if worker_factory is None:
            under_test_name = "in_memory"
            worker_factory = in_memory_worker
    else:
        under_test_name = getattr(worker_factory, "__name__", type(worker_factory).__name__)

    workdir = Path(tempfile.mkdtemp(prefix="rolloutlog-bench-trl-"))
    try:
        model = build_tiny_model(workdir / "model") if model_dir is None else Path(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model)
        config = _bench_config(workdir, num_generations, max_completion_length, save_steps)
        dataset = _dataset(max(64, steps * batch_size // num_generations + 8))
        results: dict[str, list[RoundResult]] = {"baseline": [], "under_test": []}
        for r in range(rounds):
            order = [("baseline", in_memory_worker), ("under_test", worker_factory)]
            if r % 2:
                order.reverse()
            for role, factory in order:
                out = workdir / f"{role}-{r}"
                out.mkdir()
                context = WorkerContext(
                    model_dir=model, output_dir=out, dataset=dataset, tokenizer=tokenizer,
                    reward_funcs=[answer_reward], num_generations=num_generations,
                    max_completion_length=max_completion_length, backend=backend,
                    generation_latency_s=generation_latency_s, config=config,
                    extra={"max_inflight_groups": in_flight_groups},
                )  # fmt: skip
                res = _measure_round(
                    role, factory, context, steps=steps, batch_size=batch_size,
                    save_steps=save_steps, timeout_s=timeout_s,
                )  # fmt: skip
                results[role].append(res)
                say(
                    f"round {r + 1}/{rounds} {role}: {res.samples_per_s:.1f} samples/s, "
                    f"callbacks {1000 * res.callback_s / res.steps:.3f} ms/step"
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    best_base = max(results["baseline"], key=lambda x: x.samples_per_s)
    best_test = max(results["under_test"], key=lambda x: x.samples_per_s)
    callback_ms = statistics.fmean(1000 * x.callback_s / x.steps for x in results["under_test"])
    events = sorted({e for x in results["under_test"] for e in x.callback_s_by_event})
    by_event = {
        e: statistics.fmean(
            1000 * x.callback_s_by_event.get(e, 0.0) / x.steps for x in results["under_test"]
        )
        for e in events
    }
    return {
        "trl_version": trl.__version__,
        "worker_under_test": under_test_name,
        "backend": backend,
        "steps": steps,
        "batch_size": batch_size,
        "num_generations": num_generations,
        "max_completion_length": max_completion_length,
        "rounds": rounds,
        "in_flight_groups": in_flight_groups,
        "samples_per_s_in_memory_worker": best_base.samples_per_s,
        "samples_per_s_worker_under_test": best_test.samples_per_s,
        "samples_per_s_vs_in_memory_worker": best_test.samples_per_s / best_base.samples_per_s,
        "callback_ms_per_step": callback_ms,
        #: The same time split by TrainerCallback event (on_save every ``save_steps``).
        "callback_ms_per_step_by_event": by_event,
        "goals": dict(GOALS),
    }


def _bench_config(
    workdir: Path, num_generations: int, max_completion_length: int, save_steps: int
) -> Any:
    from trl.experimental.async_grpo import AsyncGRPOConfig

    return AsyncGRPOConfig(
        output_dir=str(workdir / "trainer"),
        use_cpu=True,
        bf16=False,
        token_budget=0,
        num_generations=num_generations,
        max_completion_length=max_completion_length,
        save_steps=save_steps,
        report_to="none",
    )


def _dataset(num_prompts: int) -> Any:
    from datasets import Dataset

    pairs = [(i % 10, (i * 3 + 1) % 10) for i in range(num_prompts)]
    return Dataset.from_dict(
        {
            "prompt": [f"q: {a}+{b}=? a:" for a, b in pairs],
            "answer": [str(a + b) for a, b in pairs],
        }
    )


def print_report(result: dict[str, Any]) -> None:
    """The human-readable report of :func:`run_trl_benchmark`."""
    print(
        f"TRL {result['trl_version']}, backend {result['backend']}, worker under test: "
        f"{result['worker_under_test']}"
    )
    print(
        f"samples/s: in-memory {result['samples_per_s_in_memory_worker']:.1f}, under test "
        f"{result['samples_per_s_worker_under_test']:.1f}"
    )
    for key, goal in GOALS.items():
        op = ">=" if key.startswith("samples") else "<="
        print(f"{key}: {result[key]:.3f} (goal {op} {goal})")

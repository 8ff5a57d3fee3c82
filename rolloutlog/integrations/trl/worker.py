"""``RolloutlogWorker``: TRL's ``RolloutWorkerProtocol`` with a RolloutRuntime underneath.

TRL's ``AsyncGRPOTrainer`` drains ``rollout_buffer`` and ``metrics_queue``; this worker
fills them from rolloutlog's runtime, on a thread of its own running an asyncio loop:

- admission, generation, retries, rewards and staleness are the runtime's (the log keeps
  each prompt's ``(pass, index)`` identity, every completion and its reward);
- the groups of rolloutlog train step ``s`` (``in_order`` sampler: the groups stamped for
  ``s``) are handed to TRL as one contiguous run of samples, in step order, each only once
  its completions are durable (flushed) and only if it cannot become stale before it
  trains (TRL's ``max_staleness`` is rolloutlog's ``staleness_bound``): a group that would
  (generated more than ``max_staleness`` versions ahead) is held back and evicted by
  rolloutlog (``EvictDoomed``) once a replacement generated now would be in bound, so
  TRL's ``RolloutQueueDataset`` never drops one;
- with TRL's ``tools`` / ``environment_factory``, each sibling is a multi-turn trajectory
  (``TrajectoryBackend``): TRL gets the whole conversation, tool and environment tokens
  masked out of the loss (``completion_mask`` 0), from the trajectory's record in the log;
- one rolloutlog train step is one TRL optimizer step: the callback
  (:class:`RolloutlogCallback`) records a step as trained when the optimizer step that
  consumed its samples ends, and ``on_save`` writes the log's checkpoint offset into the
  TRL checkpoint, from which a resume restores the worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import multiprocessing.queues
import os
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from rolloutlog.controller.backends.base import GenerationBackend
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.domain import MarkCheckpoint, SelectBatch
from rolloutlog.controller.domain.admission import data_exhausted
from rolloutlog.controller.domain.errors import RestoreError
from rolloutlog.controller.domain.state import GroupState, Phase, SiblingStatus
from rolloutlog.controller.environments import ToolCall, parse_tool_calls, tool_of
from rolloutlog.controller.multiturn import MultiTurnConfig, TrajectoryBackend
from rolloutlog.controller.rollout_controller import RecoveryReport, RolloutController
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.eventstore import EventStore, EventStoreProtocol, decode_arrays

from .checkpoint import RolloutlogCheckpoint, read_checkpoint, write_checkpoint
from .errors import LogMismatchError, TrlConfigError, UnsupportedTrlFeatureError, WorkerFailedError
from .prompts import RewardFunc, TrlPrompts

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Handed:
    """A rolloutlog train step handed to TRL: its groups and their samples not yet trained."""

    step: int
    group_ids: tuple[int, ...]
    untrained: dict[int, int] = field(default_factory=dict)  # group id -> samples left


@dataclass
class _Mark:
    """A checkpoint TRL asked for, in order with the trained steps to record: marked in
    the log after the steps before it, whoever records them (a publish or the save)."""

    marked: tuple[int, int, int] | None = None  # (offset, train step, weight version)


def _trl_sample_class() -> Any:
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    return RolloutSample


class _HfTokens:
    """A TRL tokenizer as the trajectory backend's :class:`Tokenizer` (text enters a
    context once, without special tokens)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=True))


def _tool_name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__name__", None)
    if not name or name == "<lambda>":
        raise TrlConfigError(f"tool {fn!r} has no name: pass named functions as tools")
    return str(name)


def _environment_reward_name(factory: Any) -> str | None:
    """The name of TRL's reward column for ``factory``'s environments (the class's name)
    when they define ``get_reward``; refuses one without ``reset`` as TRL does."""
    if factory is None:
        return None
    probe = factory()
    if not callable(getattr(type(probe), "reset", None)):
        raise TrlConfigError(
            f"the environment_factory's {type(probe).__name__} has no reset method: TRL's "
            "environments define reset(**row)"
        )
    if callable(getattr(type(probe), "get_reward", None)):
        return type(probe).__name__
    return None


class RolloutlogWorker:
    """A TRL rollout worker backed by rolloutlog (``rollout_worker=`` of AsyncGRPOTrainer).

    Args:
        store: the log (a URL such as ``sqlite:///runs/rolloutlog.db`` or an open store,
            which the worker does not close).
        train_dataset: the trainer's dataset (map-style, or streaming with ``dataset_size``).
        processing_class: the trainer's tokenizer.
        reward_funcs: TRL reward functions (callables; sync or async).
        backend: any rolloutlog generation backend, not started (the worker starts and
            closes it).
        args: the trainer's ``AsyncGRPOConfig``: ``num_generations``, ``max_staleness`` and
            the optimizer step's size (``per_device_train_batch_size`` x
            ``gradient_accumulation_steps`` x processes) give the log's group size,
            staleness bound and groups per step, unless given explicitly.
        run_id: the log's run id (new run: a fresh one if omitted; a resume uses the
            checkpoint's, and a different one here is refused).
        lookahead: train steps generation may run ahead, at least 1 (default
            ``max_staleness``): a group is generated no earlier than ``lookahead`` weight
            versions before the step that trains it, so up to ``max_staleness`` none can go
            stale before it trains. Beyond it, generation runs further ahead of a slow
            trainer, and a group that would train too stale is evicted by the log (and
            replaced) a version before it is stale, never handed to TRL.
        rollout: further RolloutConfig fields (``spare_pool_size``, ``drop_policy``, ...).
        extra_reward: rolloutlog's own reward ``(prompt index, completion ids) -> float``,
            added to the TRL functions' sum.
        passes: passes over the dataset the log may admit (TRL's own worker cycles the
            dataset without end; stop training with ``max_steps`` or ``epochs``).
        epochs: stop training once this many passes' worth of groups have trained, counted
            in the log (so a resumed run stops at the same point as an uninterrupted one).
        timeout_s: the deadline of every wait on the worker's thread (start, commands, stop).
        policy: the trainer's model: with ``NoOpWeightTransfer``, each publish loads its
            parameters into the backend (the worker refits its engines itself).
        wait_for_publish: ``update_model_version`` returns once the publish is recorded
            and the backend serves the new weights (default). ``False``: it returns at once
            (TRL's own worker only stores the number): the record and publish run on the
            worker's loop, in order with the checkpoints, off the trainer's step (publishes
            queued behind a slow one are coalesced into one of the newest version); a
            failure surfaces at the next ``update_model_version``, ``check_health`` or save.
        tools: TRL's plain tool functions (named; ``rolloutlog.controller.environments.
            idempotent`` marks one safe to run again after a crash).
        environment_factory: TRL's environment factory (one callable): an object per
            trajectory, ``reset(**row)``, its public methods as tools, ``get_reward()``
            added to the reward as TRL's ``rewards/<class name>`` column. With ``tools``
            or an environment, each sibling is a multi-turn trajectory
            (:class:`~rolloutlog.controller.multiturn.TrajectoryBackend` around
            ``backend``): every model call and tool result is in the log, tool and
            environment tokens reach TRL with ``completion_mask`` 0, and a resume reuses
            recorded model calls and tool results instead of running them again.
        multi_turn: turns and tokens per model call (default: ``max_tokens`` per turn).
        tool_parser: the tool calls of a model output (default: rolloutlog's
            ``<tool>NAME {json}</tool>``; pass one for your chat template's format).
    """

    def __init__(
        self,
        *,
        store: str | EventStoreProtocol,
        train_dataset: Any,
        processing_class: Any,
        backend: GenerationBackend,
        reward_funcs: Sequence[RewardFunc] | RewardFunc | None = None,
        args: Any | None = None,
        run_id: str | None = None,
        num_generations: int | None = None,
        groups_per_step: int | None = None,
        max_staleness: int | None = None,
        lookahead: int | None = None,
        rollout: dict[str, Any] | None = None,
        generation: GenerationConfig | None = None,
        store_config: StoreConfig | None = None,
        extra_reward: Callable[[int, Sequence[int]], float] | None = None,
        dataset_size: int | None = None,
        fingerprint: str | None = None,
        passes: int = 1000,
        epochs: float | None = None,
        queue_maxsize: int = 0,
        timeout_s: float = 120.0,
        policy: Any = None,
        wait_for_publish: bool = True,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment_factory: Any = None,
        multi_turn: MultiTurnConfig | None = None,
        tool_parser: Callable[[str], list[ToolCall]] = parse_tool_calls,
    ) -> None:
        if isinstance(environment_factory, dict):
            raise UnsupportedTrlFeatureError(
                "the rolloutlog worker takes one environment_factory, not a dict of them "
                "(TRL's multi-environment mode): pass a single factory"
            )
        num_generations = num_generations or (args.num_generations if args else None)
        if not num_generations:
            raise TrlConfigError("pass args= (the trainer's AsyncGRPOConfig) or num_generations=")
        if groups_per_step is None:
            if args is None:
                raise TrlConfigError(
                    "pass args= (the trainer's AsyncGRPOConfig) or groups_per_step="
                )
            samples = args.per_device_train_batch_size * args.gradient_accumulation_steps
            samples *= max(1, getattr(args, "world_size", 1))
            if samples % num_generations:
                raise TrlConfigError(
                    f"an optimizer step trains {samples} samples, not a whole number of "
                    f"groups of num_generations={num_generations}: make "
                    "per_device_train_batch_size x gradient_accumulation_steps a multiple "
                    "of num_generations"
                )
            groups_per_step = samples // num_generations
        if max_staleness is None:
            max_staleness = int(args.max_staleness) if args is not None else 4
        if max_staleness < 1:
            raise TrlConfigError(
                f"max_staleness={max_staleness}: the rolloutlog worker needs max_staleness >= 1 "
                "(TRL fetches the next step's first micro-batch before it trains the current one)"
            )
        if lookahead is None:
            lookahead = max_staleness
        if lookahead < 1:
            raise TrlConfigError(
                f"lookahead={lookahead}: it must be at least 1 (TRL fetches the next step's "
                "first micro-batch before it trains the current one)"
            )
        fields = {
            "group_size": int(num_generations),
            "groups_per_step": int(groups_per_step),
            "sampler": "in_order",
            "staleness_bound": int(max_staleness),
            "lookahead": int(lookahead),
            **(rollout or {}),
        }
        if fields["sampler"] != "in_order":
            raise TrlConfigError(
                "the TRL worker hands TRL whole train steps in order: the sampler must be "
                f"in_order, not {fields['sampler']!r}"
            )
        self.rules = RolloutConfig(**fields)
        if generation is None:
            max_tokens = int(getattr(args, "max_completion_length", 16) or 16) if args else 16
            generation = GenerationConfig(max_tokens=max_tokens)
        #: The multi-turn backend (``tools`` / ``environment_factory``), wrapping ``backend``.
        self.trajectories: TrajectoryBackend | None = None
        env_reward_name: str | None = None
        if tools or environment_factory is not None:
            env_reward_name = _environment_reward_name(environment_factory)
            self.trajectories = TrajectoryBackend(
                backend,
                _HfTokens(processing_class),
                environment_factory=environment_factory,
                tools=[tool_of(_tool_name(fn), fn) for fn in tools or ()],
                # TRL's rule: reset(**row), the dataset row's columns.
                reset_kwargs=lambda index: self.prompts.rows[index],
                config=multi_turn or MultiTurnConfig(max_tokens_per_turn=generation.max_tokens),
                parse=tool_parser,
            )
            backend = self.trajectories
        self.prompts = TrlPrompts(
            train_dataset,
            processing_class,
            reward_funcs,
            extra_reward=extra_reward,
            dataset_size=dataset_size,
            fingerprint=fingerprint,
            env_reward=None if env_reward_name is None else self._environment_reward,
            env_reward_name=env_reward_name or "environment",
        )
        self.backend = backend
        self.policy = policy
        self.wait_for_publish = wait_for_publish
        self.store_spec = store
        self.store_config = store_config
        self.generation = generation
        self.run_id = run_id
        self._run_id_given = run_id is not None
        self.passes = passes
        self.epochs = epochs
        self.timeout_s = timeout_s
        self.max_staleness = int(max_staleness)
        #: TRL's side: the trainer drains these.
        # Typed as TRL's RolloutWorkerProtocol declares them (thread queues here).
        self.rollout_buffer: queue.Queue[Any] | multiprocessing.queues.Queue[Any] = queue.Queue(
            maxsize=queue_maxsize
        )
        self.metrics_queue: queue.Queue[Any] | multiprocessing.queues.Queue[Any] = queue.Queue(
            maxsize=4096
        )
        from .callback import RolloutlogCallback

        #: Pass it in the trainer's ``callbacks``: it records trained steps and checkpoints.
        self.callback = RolloutlogCallback(self)
        #: The restore's report after a resume (``None`` on a fresh run).
        self.recovery: RecoveryReport | None = None
        self.resumed_from: RolloutlogCheckpoint | None = None
        self.controller: RolloutController | None = None
        self.runtime: RolloutRuntime | None = None
        # Thread and loop
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        # On the loop: a command's log writes (a publish's record, a checkpoint) run one at
        # a time, in call order; publishes run one at a time, in call order, and hold the
        # command lock only until their weight swap has begun, so a checkpoint waits for
        # no generation to drain.
        self._commands: asyncio.Lock | None = None
        self._publishing: asyncio.Lock | None = None
        self._publishes_open = 0  # publishes started on the loop and not finished
        self._dispatch_held = False  # a checkpoint recorded steps whose publish is to come
        self._generation_held = False  # hold_generation(): until the next publish
        #: The weights reach the engine another way (NcclWeightTransfer): a publish tells
        #: the backend the version and loads nothing.
        self.weights_sent_elsewhere = False
        self._publishes: deque[concurrent.futures.Future[None]] = deque()
        # Checkpoints TRL saved whose rolloutlog file is not written yet.
        self._saves: deque[concurrent.futures.Future[RolloutlogCheckpoint]] = deque()
        # Versions: TRL's model_version = the log's weight version + offset.
        self._trl_version: int | None = None
        self._version_offset = 0
        # The trainer's weights for TRL version ``_pending_for`` (the next one at receipt).
        self._pending_weights: list[tuple[str, Any]] | None = None
        self._pending_for = 0
        self._publish_queued = False
        # Hand-off
        self._next_step = 0
        self._handed: deque[_Handed] = deque()
        # Steps TRL finished and checkpoints it asked for, in call order, to be recorded.
        self._to_record: list[_Handed | _Mark] = []
        self._held_since: float | None = None
        self._held: tuple[int, int] | None = None  # (step, groups held back)
        self._doomed_checked: tuple[int, int, int] | None = None
        self._exhausted: str | None = None
        self._last_counts = (0, 0)  # (evicted, dropped) last pushed
        self._heartbeat = time.time()
        #: Counters (tests, the bench): groups handed to TRL, steps recorded trained.
        self.groups_handed = 0
        self.samples_handed = 0
        self.steps_recorded = 0

    def _environment_reward(self, index: int, completion_ids: Sequence[int]) -> float | None:
        """The environment's ``get_reward`` of the trajectory that produced ``completion_ids``."""
        assert self.trajectories is not None
        prompt = [int(t) for t in self.prompts.prompt_token_ids(index)]
        return self.trajectories.trajectory_reward(prompt, completion_ids)

    # ------------------------------------------------------------------ protocol
    def start(self) -> None:
        """Open (or restore) the run, start the backend and the pump; returns once the
        worker serves (deadline ``timeout_s``)."""
        if self._thread is not None:
            return
        if self.run_id is None:
            self.run_id = f"trl-{uuid.uuid4().hex[:12]}"
        self._thread = threading.Thread(
            target=self._thread_main, name="rolloutlog-trl-worker", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(self.timeout_s):
            self.stop()
            raise WorkerFailedError(f"the rolloutlog worker did not start within {self.timeout_s}s")
        if self._error is not None:
            error = self._error
            self.stop()
            raise WorkerFailedError(f"the rolloutlog worker failed to start: {error}") from error

    def stop(self) -> None:
        """Stop the pump (in-flight attempts recorded as aborted), flush the log, close the
        backend and the store; the worker's threads are gone when this returns. Waits for
        the checkpoints' files first, and raises (after stopping) if one failed."""
        thread = self._thread
        if thread is None:
            return
        # The publishes and checkpoints TRL asked for are in the log before the loop ends.
        with contextlib.suppress(WorkerFailedError):
            self._wait_publishes()
        save_error: WorkerFailedError | None = None
        try:
            self.wait_saves()
        except WorkerFailedError as exc:  # raised once the worker has stopped
            save_error = exc
        self._stopping.set()
        loop = self._loop
        if loop is not None and self._wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended already
                loop.call_soon_threadsafe(self._wake.set)
        thread.join(self.timeout_s)
        if thread.is_alive():
            raise WorkerFailedError(f"the rolloutlog worker did not stop within {self.timeout_s}s")
        self._thread = None
        if self._error is not None and not isinstance(self._error, asyncio.CancelledError):
            log.warning("the rolloutlog worker had stopped with an error: %s", self._error)
        if save_error is not None:  # a TRL checkpoint lacks its rolloutlog file
            raise save_error

    def update_model_version(self, model_version: int) -> None:
        """TRL published ``model_version``: record the publish in the log (and load the
        weights a :class:`RolloutlogWeightTransfer` received into the backend)."""
        self._trl_version = int(model_version)
        if self._loop is None or not self._ready.is_set() or self._error is not None:
            return
        self._raise_failed_commands()
        if self.wait_for_publish:
            self._call(self._publish(int(model_version)))
            return
        if self.policy is not None:
            with self._lock:
                have = self._pending_weights is not None and self._pending_for == model_version
            if not have:  # a snapshot now: the trainer changes the policy at its next step
                self.receive_weights(self.policy.named_parameters())
                with self._lock:
                    self._pending_for = int(model_version)
        loop, thread = self._loop, self._thread
        if thread is None or not thread.is_alive():
            raise WorkerFailedError("the rolloutlog worker is not running")
        with self._lock:
            if self._publish_queued:  # that publish, not started yet, takes this version
                return
            self._publish_queued = True
        future = asyncio.run_coroutine_threadsafe(self._publish(None), loop)
        with self._lock:
            self._publishes.append(future)

    def _raise_failed_commands(self) -> None:
        """Forget the publishes and checkpoints that are done; raise if one failed."""
        with self._lock:
            for futures, what in (
                (self._publishes, "publish weights"),
                (self._saves, "write a checkpoint"),
            ):
                while futures and futures[0].done():
                    future = futures.popleft()
                    error = None if future.cancelled() else future.exception()
                    if error is not None:
                        raise WorkerFailedError(
                            f"the rolloutlog worker failed to {what}: {error}"
                        ) from error

    def wait_saves(self) -> None:
        """Wait (at most ``timeout_s`` each) until the checkpoints asked for are written;
        raise if one failed."""
        with self._lock:
            pending = list(self._saves)
        _done, not_done = concurrent.futures.wait(pending, self.timeout_s)
        if not_done:
            raise WorkerFailedError(
                f"{len(not_done)} checkpoint(s) were not written within {self.timeout_s}s"
            )
        self._raise_failed_commands()

    def _wait_publishes(self) -> None:
        """Wait (at most ``timeout_s`` each) for the publishes in flight; raise if one failed."""
        with self._lock:
            pending = list(self._publishes)
        _done, not_done = concurrent.futures.wait(pending, self.timeout_s)
        if not_done:
            raise WorkerFailedError(
                f"{len(not_done)} weight publish(es) did not finish within {self.timeout_s}s"
            )
        self._raise_failed_commands()

    def check_health(self, stale_after_s: float) -> None:
        """Raise if the worker failed, or cannot feed the trainer (named in the message)."""
        if self._error is not None:
            raise WorkerFailedError(
                f"the rolloutlog worker stopped: {self._error}"
            ) from self._error
        self._raise_failed_commands()
        if self._exhausted is not None and self.rollout_buffer.empty():
            raise WorkerFailedError(self._exhausted)
        thread = self._thread
        if thread is not None and not thread.is_alive() and not self._stopping.is_set():
            raise WorkerFailedError("the rolloutlog worker's thread ended unexpectedly")
        held_since = self._held_since
        if (
            held_since is not None
            and self.rollout_buffer.empty()
            and time.monotonic() - held_since > stale_after_s
        ):
            step, count = self._held or (-1, 0)
            raise WorkerFailedError(
                f"train step {step} cannot be handed to TRL: {count} of its groups would "
                f"exceed max_staleness={self.max_staleness} when they train and rolloutlog "
                "has not evicted them (no replacement could be in bound yet); set lookahead "
                "to at most max_staleness"
            )
        age = time.time() - self._heartbeat
        if self._thread is not None and age > stale_after_s:
            raise WorkerFailedError(
                f"the rolloutlog worker's loop has not turned for {age:.0f}s "
                f"(> {stale_after_s:.0f}s)"
            )

    # ------------------------------------------------------------------ resume
    def resume_from(self, checkpoint_dir: str) -> RolloutlogCheckpoint:
        """Restore the worker from a TRL checkpoint folder written with the callback
        (before ``start``). Refuses a folder without the rolloutlog file, and a log of
        another run or dataset, with one clear line."""
        if self._thread is not None:
            raise TrlConfigError("resume_from() must be called before the worker starts")
        ckpt = read_checkpoint(checkpoint_dir)
        if self._run_id_given and self.run_id != ckpt.run_id:
            raise LogMismatchError(
                f"checkpoint {checkpoint_dir} belongs to rollout log run {ckpt.run_id!r}, "
                f"but this worker was given run_id={self.run_id!r}"
            )
        if ckpt.dataset_fingerprint != self.prompts.fingerprint:
            raise LogMismatchError(
                f"checkpoint {checkpoint_dir} was written for dataset {ckpt.dataset_fingerprint}, "
                f"but this trainer's dataset and rewards are {self.prompts.fingerprint}: resume "
                "with the same train_dataset and reward_funcs"
            )
        self.run_id = ckpt.run_id
        self.resumed_from = ckpt
        return ckpt

    # ------------------------------------------------------------------ weights
    def receive_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Keep a CPU copy of the trainer's weights for the next publish (the weight
        transfer calls this; the next ``update_model_version`` loads them)."""
        weights = [(n, t.detach().to("cpu").clone()) for n, t in named_tensors]
        with self._lock:
            self._pending_weights = weights
            self._pending_for = (self._trl_version or 0) + 1

    def _take_weights(self, trl_version: int | None = None) -> list[tuple[str, Any]] | None:
        """What a publish of ``trl_version`` loads (``None``: any, at start): the weights a
        transfer (or ``policy``, copied at ``update_model_version``) handed over, else a
        one-value version marker (for a backend that ignores weights, like the
        deterministic one). ``None`` when newer weights than ``trl_version``'s arrived
        already: that publish is skipped, the next one carries them."""
        with self._lock:
            weights, tag = self._pending_weights, self._pending_for
            if weights is not None and trl_version is not None and tag > trl_version:
                return None
            self._pending_weights = None
        if weights and not self.weights_sent_elsewhere:
            return weights
        if self.policy is not None and not self.weights_sent_elsewhere:
            return [(n, p.detach().to("cpu").clone()) for n, p in self.policy.named_parameters()]
        import torch

        return [("rolloutlog.weight_version_marker", torch.zeros(1))]

    # ------------------------------------------------------------------ the thread
    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            if self._error is None:
                self._error = exc
            log.error("rolloutlog worker stopped: %s", exc)
        finally:
            self._ready.set()

    def _open_controller(self, store: EventStoreProtocol) -> RolloutController:
        assert self.run_id is not None
        if self.resumed_from is not None:
            try:
                controller, report = RolloutController.restore(
                    store,
                    self.run_id,
                    self.resumed_from.offset,
                    rollout=self.rules,
                    dataset_fingerprint=self.prompts.fingerprint,
                    store_config=self.store_config,
                )
            except RestoreError as exc:
                raise LogMismatchError(
                    f"the rollout log does not match checkpoint {self.resumed_from.path}: {exc}"
                ) from exc
            self.recovery = report
            return controller
        return RolloutController.start(
            store,
            self.run_id,
            self.rules,
            dataset_fingerprint=self.prompts.fingerprint,
            dataset_size=self.prompts.num_prompts,
            passes=self.passes,
            store_config=self.store_config,
        )

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._commands = asyncio.Lock()
        self._publishing = asyncio.Lock()
        own_store = isinstance(self.store_spec, str)
        store = (
            EventStore.open(self.store_spec)
            if isinstance(self.store_spec, str)
            else self.store_spec
        )
        try:
            controller = self._open_controller(store)
            self.controller = controller
            loop = self._loop
            wake = self._wake

            def on_durable(_recorded: Any) -> None:  # the committer's thread
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(wake.set)

            controller.listeners.append(on_durable)
            if self.trajectories is not None:
                # The trajectories a dispatch can still reach (a resume reuses their turns).
                self.trajectories.attach(controller)
            try:
                runtime = RolloutRuntime(controller, self.backend, self.prompts, self.generation)
                self.runtime = runtime
                try:
                    state = controller.state
                    base = (
                        self._trl_version if self._trl_version is not None else state.weight_version
                    )
                    self._version_offset = base - state.weight_version
                    # The trainer's weights before the pump dispatches anything (a fresh
                    # backend serves version 0; a resume continues at the log's version).
                    await self.backend.start()
                    weights = self._take_weights()
                    assert weights is not None  # no version given: never skipped
                    await runtime.sync_weights(weights, state.weight_version)
                    await runtime.start()
                    self._next_step = state.train_step
                    self._ready.set()
                    await self._serve(runtime, controller)
                finally:
                    await runtime.close()
            finally:
                controller.listeners.remove(on_durable)
                try:
                    await self.backend.close()
                finally:
                    controller.close()
        finally:
            self.prompts.close()
            if own_store:
                store.close()

    async def _serve(self, runtime: RolloutRuntime, controller: RolloutController) -> None:
        wake = self._wake
        assert wake is not None
        while not self._stopping.is_set():
            self._heartbeat = time.time()
            pump_error = runtime.failure
            if pump_error is not None:
                raise WorkerFailedError(f"the rollout pump stopped: {pump_error}") from pump_error
            if controller.failure is not None:
                raise WorkerFailedError(f"the rollout log failed: {controller.failure}")
            if await self._hand_next(runtime, controller):
                continue
            wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=0.05)

    def _step_groups(self, controller: RolloutController, s: int) -> list[GroupState] | None:
        """The groups of train step ``s`` if it can be handed over now, else None."""
        state = controller.state
        if s >= state.dispatch_cursor and data_exhausted(state):
            self._exhausted = (
                f"the data ran out before train step {s}: all {state.dataset_size} prompts x "
                f"{state.passes} pass(es) were pulled; set more passes or stop earlier "
                "(max_steps, epochs)"
            )
            return None
        if s > state.train_step + self.rules.lookahead or s >= state.dispatch_cursor:
            return None
        if s in state.batches:  # selected before a checkpoint (not by this worker)
            return [state.groups[g] for g in state.batches[s]]
        groups = sorted(
            (
                g
                for g in state.groups.values()
                if g.target_step == s and g.phase in (Phase.ADMITTED, Phase.READY)
            ),
            key=lambda g: g.group_id,
        )
        if any(g.phase is Phase.ADMITTED for g in groups):
            return None
        # The weight version this step trains at: a group older than max_staleness then
        # would be evicted by rolloutlog after TRL got it. Hold it back: the log evicts it
        # at the next publish and its drop policy fills the slot.
        at = state.weight_version + (s - state.train_step)
        risky = [
            g
            for g in groups
            if (oldest := g.oldest_version()) is not None
            and at - oldest > self.rules.staleness_bound
        ]
        if risky:
            if self._held is None or self._held[0] != s:
                self._held_since = time.monotonic()
            self._held = (s, len(risky))
            return None
        return groups

    async def _hand_next(self, runtime: RolloutRuntime, controller: RolloutController) -> bool:
        s = self._next_step
        groups = self._step_groups(controller, s)
        if groups is None:
            if self._held is None or self._held[0] != s:
                return False
            # Groups that will be stale when step s trains: the log evicts them as soon
            # as a replacement generated now would be in bound (a version before they
            # are stale), so the slot refills before TRL (fetching a micro-batch ahead)
            # waits for it.
            state = controller.state
            key = (s, state.train_step, state.published_version)
            if key == self._doomed_checked:
                return False
            self._doomed_checked = key
            return await runtime.evict_doomed() > 0
        await controller.aflush()  # the output commit: durable before TRL sees it
        again = self._step_groups(controller, s)  # a publish may have run meanwhile
        if again is None or [g.group_id for g in again] != [g.group_id for g in groups]:
            return True
        self._held = None
        self._held_since = None
        masks = self._loss_masks(again)  # on the loop: the book is the loop's
        cache: dict[int, dict[str, bytes]] = getattr(runtime, "_payload_cache", {})
        if all(
            s.payload_id in cache.get(g.group_id, ())
            for g in again
            for s in g.siblings
            if s.status is SiblingStatus.DONE
        ):  # in memory: cheaper here than a hop to a thread and back
            samples = self._build_samples(runtime, controller, again, masks)
        else:  # database reads (after a restore) stay off the loop
            samples = await asyncio.to_thread(
                self._build_samples, runtime, controller, again, masks
            )
        counts: dict[int, int] = {}
        for sample in samples:
            counts[sample.group_id] = counts.get(sample.group_id, 0) + 1
        with self._lock:
            self._handed.append(_Handed(s, tuple(g.group_id for g in again), counts))
        for sample in samples:
            while True:
                try:
                    sample.enqueued_at = time.time()
                    self.rollout_buffer.put_nowait(sample)
                    break
                except queue.Full:
                    if self._stopping.is_set():
                        return False
                    self._heartbeat = time.time()
                    await asyncio.sleep(0.01)
        self._next_step = s + 1
        self.groups_handed += len(again)
        self.samples_handed += len(samples)
        self._push_metrics(controller, samples)
        return True

    def _loss_masks(self, groups: list[GroupState]) -> dict[tuple[int, int], list[int]] | None:
        """Multi-turn: each finished sibling's loss mask (1 model token, 0 tool or
        environment token) from its trajectory; None for single-turn rollouts."""
        if self.trajectories is None:
            return None
        masks = {}
        for group in groups:
            for i, sib in enumerate(group.siblings):
                if sib.status is not SiblingStatus.DONE:
                    continue
                traj = self.trajectories.book.get((group.group_id, i))
                if traj is None or not traj.completed:
                    raise WorkerFailedError(
                        f"group {group.group_id} sibling {i} has no completed trajectory in "
                        "the log: its loss mask is unknown"
                    )
                masks[(group.group_id, i)] = traj.loss_mask()
        return masks

    def _build_samples(
        self,
        runtime: RolloutRuntime,
        controller: RolloutController,
        groups: list[GroupState],
        masks: dict[tuple[int, int], list[int]] | None = None,
    ) -> list[Any]:
        sample_cls = _trl_sample_class()
        out = []
        for group in groups:
            prompt_ids = self.prompts.prompt_token_ids(group.prompt_index)
            messages = self.prompts.messages(group.prompt_index)
            done_at = [i for i, s in enumerate(group.siblings) if s.status is SiblingStatus.DONE]
            done = [group.siblings[i] for i in done_at]
            rewards = np.array(
                [s.reward if s.reward is not None else math.nan for s in done], dtype=float
            )
            # TRL's advantage: per group, (r - mean) / (std + 1e-8) over the scored
            # completions (population std), 0 for an unscored one.
            advantages = np.zeros_like(rewards)
            scored = ~np.isnan(rewards)
            if scored.any():
                vals = rewards[scored]
                advantages[scored] = (vals - vals.mean()) / (vals.std() + 1e-8)
                reward_std = float(vals.std())
            else:
                reward_std = math.nan
            oldest = group.oldest_version() or 0
            for index, sib, adv, reward in zip(done_at, done, advantages, rewards, strict=True):
                assert sib.payload_id is not None
                arrays = decode_arrays(runtime.completion_payload(group.group_id, sib.payload_id))
                ids = [int(t) for t in arrays["token_ids"]]
                logprobs = [float(x) for x in arrays["logprobs"]]
                mask = [1] * len(ids) if masks is None else masks[(group.group_id, index)]
                if len(mask) != len(ids):
                    raise WorkerFailedError(
                        f"group {group.group_id} sibling {index}: the trajectory holds "
                        f"{len(mask)} response tokens, the completion {len(ids)}"
                    )
                metrics = {"reward": float(reward), "reward_std": reward_std}
                per_func = self.prompts.per_func.pop((group.prompt_index, tuple(ids)), None)
                if per_func is not None:
                    for name, value in zip(self.prompts.reward_names, per_func, strict=True):
                        metrics[f"rewards/{name}"] = float(value)
                out.append(
                    sample_cls(
                        prompt=messages,
                        completion=self.prompts.completion_messages(ids),
                        input_ids=np.asarray(prompt_ids + ids, dtype=np.int64),
                        # Tool and environment tokens are context (TRL's multi-turn rows).
                        completion_mask=np.asarray([0] * len(prompt_ids) + mask, dtype=np.int64),
                        old_log_probs=np.asarray(
                            [0.0] * len(prompt_ids) + logprobs, dtype=np.float32
                        ),
                        advantage=float(adv),
                        model_version=int(oldest + self._version_offset),
                        group_id=int(group.group_id),
                        metrics=metrics,
                    )
                )
        return out

    def _push_metrics(self, controller: RolloutController, samples: list[Any]) -> None:
        c = controller.state.counters
        evicted, dropped = c.groups_evicted, c.prompts_dropped
        lengths = [int(s.completion_mask.sum()) for s in samples]
        payload: dict[str, Any] = {
            "rolloutlog/groups_handed_total": float(len({s.group_id for s in samples})),
            "rolloutlog/groups_evicted_stale_total": float(evicted - self._last_counts[0]),
            "rolloutlog/prompts_dropped_total": float(dropped - self._last_counts[1]),
            "rolloutlog/train_step": float(controller.state.train_step),
        }
        self._last_counts = (evicted, dropped)
        if lengths:
            payload["completions/mean_length"] = (float(sum(lengths)), float(len(lengths)))
            payload["completions/max_length"] = float(max(lengths))
            payload["completions/min_length"] = float(min(lengths))
        with contextlib.suppress(queue.Full):  # never block generation on metrics
            self.metrics_queue.put_nowait(payload)

    # ------------------------------------------------------------------ commands
    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the worker's loop; wait at most ``timeout_s``."""
        loop = self._loop
        if loop is None or self._thread is None or not self._thread.is_alive():
            coro.close()
            raise WorkerFailedError(
                "the rolloutlog worker is not running"
                + (f": {self._error}" if self._error is not None else "")
            )
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(self.timeout_s)
        except TimeoutError as exc:
            future.cancel()
            raise WorkerFailedError(
                f"a rolloutlog command did not finish within {self.timeout_s}s"
            ) from exc

    def record_trained(self, group_ids: Iterable[int]) -> int:
        """Count ``group_ids``'s samples (one id per sample) as trained by the optimizer
        step that just ended. Every handed step now fully trained is recorded in the log
        with the weight publish TRL makes next (``update_model_version``: one command on
        the worker's loop, so no generation is dispatched between the two at the old
        version), or at the next checkpoint. Returns how many steps completed."""
        done: list[_Handed] = []
        with self._lock:
            for gid in group_ids:
                for handed in self._handed:
                    if handed.untrained.get(gid, 0) > 0:
                        handed.untrained[gid] -= 1
                        break
            while self._handed and not any(self._handed[0].untrained.values()):
                done.append(self._handed.popleft())
            self._to_record.extend(done)
        return len(done)

    async def _record(self) -> int:
        """Select and record as trained the steps TRL has trained, and mark the
        checkpoints it asked for between them, in call order; returns how many steps.
        No await suspends it: nothing is dispatched in between."""
        controller, runtime = self.controller, self.runtime
        assert controller is not None and runtime is not None
        with self._lock:
            done, self._to_record = self._to_record, []
        state = controller.state
        steps = 0
        for handed in done:
            if isinstance(handed, _Mark):
                step = state.train_step
                applied = controller.execute(MarkCheckpoint(train_step=step))
                handed.marked = (applied[-1][0], step, state.weight_version)
                continue
            s = handed.step
            while s not in state.batches:
                applied = controller.execute(SelectBatch(s))
                evicted = {
                    ev.group_id  # type: ignore[attr-defined]
                    for _, ev in applied
                    if ev.event_type == "GroupEvicted"
                }
                if evicted & set(handed.group_ids):
                    raise WorkerFailedError(
                        f"rolloutlog evicted groups {sorted(evicted & set(handed.group_ids))} "
                        f"of step {s} after TRL trained them"
                    )
            if sorted(state.batches[s]) != sorted(handed.group_ids):
                raise WorkerFailedError(
                    f"rolloutlog's batch of step {s} is {sorted(state.batches[s])}, but TRL "
                    f"trained groups {sorted(handed.group_ids)}"
                )
            await runtime.report_trained(s, state.weight_version + 1)
            self.steps_recorded += 1
            steps += 1
        if self._wake is not None:
            self._wake.set()
        return steps

    async def _publish(self, trl_version: int | None) -> None:
        """Record the trained steps and publish ``trl_version`` (``None``: the newest TRL
        announced, the publishes queued behind a slow one coalesced into one).

        The record and the start of the weight swap happen without a suspension between
        them (``publish_weights`` stops dispatch before its first await), so nothing is
        dispatched at the old version once the new train step is recorded. The command
        lock is released then: a checkpoint does not wait for the swap, which waits for
        in-flight generation to drain.
        """
        controller, runtime = self.controller, self.runtime
        assert controller is not None and runtime is not None
        assert self._publishing is not None and self._commands is not None
        self._publishes_open += 1
        try:
            async with self._publishing:
                async with self._commands:
                    if trl_version is None:
                        with self._lock:
                            self._publish_queued = False
                            trl_version = self._trl_version
                        assert trl_version is not None
                    await self._record()
                    state = controller.state
                    version = min(trl_version - self._version_offset, state.weight_version)
                    if version <= state.published_version:
                        return
                    weights = self._take_weights(trl_version)
                    if weights is None:
                        return
                # Released without a suspension: publish_weights holds dispatch first.
                await runtime.publish_weights(weights, version)
        finally:
            self._publishes_open -= 1
            if self._dispatch_held and not self._publishes_open:
                self._dispatch_held = False
                runtime.release_dispatch()
            if self._generation_held and not self._publishes_open:
                self._generation_held = False
                runtime.release_dispatch()

    def hold_generation(self) -> None:
        """Stop dispatching and wait until no generation is in flight (deadline: the
        generation config's ``drain_timeout_s``); dispatch resumes once the next publish
        (``update_model_version``) is recorded. For a weight transfer that swaps the
        engine's weights itself: every completion then comes from one weight version.
        Does nothing before the worker serves (TRL's first weight sync)."""
        if self._loop is None or not self._ready.is_set() or self._error is not None:
            return
        self._call(self._hold_generation())

    async def _hold_generation(self) -> None:
        runtime = self.runtime
        assert runtime is not None
        if not self._generation_held:
            runtime.hold_dispatch()
            self._generation_held = True
        timeout = self.generation.drain_timeout_s
        deadline = time.monotonic() + timeout
        while runtime.generating:
            if time.monotonic() > deadline:
                raise WorkerFailedError(
                    f"in-flight generation did not finish within drain_timeout_s={timeout} "
                    "before a weight transfer"
                )
            await asyncio.sleep(0.01)

    def _ask_checkpoint(self) -> tuple[_Mark, asyncio.AbstractEventLoop]:
        """Queue a checkpoint after the steps TRL finished so far (none later)."""
        self._raise_failed_commands()
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            raise WorkerFailedError(
                "the rolloutlog worker is not running"
                + (f": {self._error}" if self._error is not None else "")
            )
        mark = _Mark()
        with self._lock:
            self._to_record.append(mark)
        return mark, loop

    async def _checkpoint(self, mark: _Mark) -> tuple[int, int, int]:
        """Mark ``mark`` (unless a publish's record did already) and make it durable,
        without waiting for a publish in flight.

        The checkpoint needs every step TRL trained before it recorded at or before its
        offset and none after (a resume must not hand a trained group again, nor skip
        one), and the weight version it names is the one those steps produced, i.e. the
        trainer's weights saved with it. Whether their publish is in the log before the
        offset does not matter: a resumed worker loads the trainer's weights and records
        the publish the log lacks (``RolloutRuntime.sync_weights``). When this records
        steps whose publish is still queued, dispatch is held until that publish is
        done, as the publish's own record would have.
        """
        controller, runtime = self.controller, self.runtime
        assert controller is not None and runtime is not None and self._commands is not None
        started = time.perf_counter()
        async with self._commands:
            recorded = await self._record()
            if recorded and self._publishes_open and not self._dispatch_held:
                runtime.hold_dispatch()
                self._dispatch_held = True
        if mark.marked is None:  # a record before this one failed part-way
            raise WorkerFailedError("the checkpoint was not marked: recording the steps failed")
        await controller.aflush()
        runtime.checkpoint_seconds.append(time.perf_counter() - started)
        return mark.marked

    def checkpoint(self) -> tuple[int, int, int]:
        """Mark a checkpoint in the log (durable): ``(offset, train step, weight version)``,
        after every step TRL finished before this call; a weight publish still draining
        is not waited for."""
        mark, _loop = self._ask_checkpoint()
        return self._call(self._checkpoint(mark))

    def save_checkpoint(
        self, folder: str | os.PathLike[str], trl_global_step: int
    ) -> concurrent.futures.Future[RolloutlogCheckpoint]:
        """Checkpoint the log for TRL's checkpoint ``folder``; returns at once.

        The checkpoint is marked after the steps TRL finished before this call (and
        before any it finishes later) and, once it is durable, its
        ``rolloutlog_state.json`` is written into ``folder`` (atomically) on the
        worker's thread, so a folder never names an offset the log may lack. A crash
        before that leaves the folder without the file, which a resume refuses with one
        line (an earlier checkpoint still resumes). :meth:`wait_saves` and :meth:`stop`
        (TRL's trainer calls it when training ends) wait for the writes; a failure
        surfaces there or at the next ``update_model_version``, ``check_health`` or save.
        """
        mark, loop = self._ask_checkpoint()
        with self._lock:
            trl_version = self._trl_version
        coro = self._save(mark, Path(folder), int(trl_global_step), trl_version)
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        with self._lock:
            self._saves.append(future)
        return future

    async def _save(
        self, mark: _Mark, folder: Path, trl_global_step: int, trl_version: int | None
    ) -> RolloutlogCheckpoint:
        offset, step, version = await self._checkpoint(mark)
        assert self.run_id is not None
        ckpt = RolloutlogCheckpoint(
            run_id=self.run_id,
            offset=offset,
            train_step=step,
            weight_version=version,
            trl_global_step=trl_global_step,
            trl_model_version=trl_version,
            dataset_fingerprint=self.prompts.fingerprint,
        )
        await asyncio.to_thread(write_checkpoint, folder, ckpt)
        return ckpt

    def trained_groups(self) -> int:
        """Groups trained: those the log records (survives a resume) and those of the
        steps TRL finished whose record waits for the next publish."""
        controller = self.controller
        recorded = 0 if controller is None else controller.state.counters.groups_trained
        with self._lock:
            pending = sum(len(h.group_ids) for h in self._to_record if isinstance(h, _Handed))
        return recorded + pending

    def data_exhausted(self) -> bool:
        """Every prompt of every pass was pulled and nothing is left to hand over."""
        controller = self.controller
        if controller is None:
            return False
        state = controller.state
        return state.dataset_cursor >= state.walk_size and not any(
            g.phase in (Phase.ADMITTED, Phase.READY) for g in state.groups.values()
        )

"""The asyncio rollout pump and the training-loop API around a RolloutController.

The pump admits steps ahead of training (within the lookahead), dispatches pending
siblings to a generation backend with a bound on siblings in flight, records
completions (token ids and logprobs as payloads), failures with retries, replacements,
borrows, evictions and aborts, all through the controller's decide/append/apply path.

The trainer calls :meth:`RolloutRuntime.next_batch`, which returns only once the
batch's events are durable (the output commit rule), then :meth:`report_trained`,
:meth:`publish_weights` and :meth:`checkpoint`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pydantic import BaseModel, ConfigDict, Field

from rolloutlog.eventstore import PayloadPut, decode_arrays, encode_arrays
from rolloutlog.eventstore.errors import RolloutlogError

from .backends.base import (
    BackendAbortedError,
    BackendError,
    BackendUnavailableError,
    GroupRequest,
    MalformedResultError,
    RecordsEngineMembership,
    SamplingConfig,
    SiblingSpec,
    validate_results,
)
from .domain import commands
from .domain.admission import admission_blocker
from .domain.errors import (
    BatchNotReadyError,
    IllegalTransitionError,
    RunFailedError,
    StaleAttemptError,
)
from .domain.events import FailureCause, RolloutEvent, SiblingAborted
from .domain.state import Phase, SiblingStatus
from .rollout_controller import RolloutController

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # torch is the [torch] extra; only annotations need it here
    import torch

    from .backends.base import GenerationBackend, SiblingResult
    from .engine_membership import EngineMembershipRecorder


class GenerationConfig(BaseModel):
    """How the pump drives generation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_in_flight_siblings: int = Field(
        64, ge=1, description="Bound on siblings generating at once."
    )
    max_tokens: int = Field(16, ge=1, description="Most tokens generated per sibling.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_backend_aborts_per_sibling: int = Field(
        3,
        ge=1,
        description="Aborts of one sibling by the backend (not by the pump) before the next "
        "one is recorded as a retryable failure, which counts toward attempts_per_sibling.",
    )
    retry_backoff_s: float = Field(
        0.05,
        ge=0,
        description="Wait before re-dispatching a group after a failed or aborted request; "
        "doubles with each consecutive one.",
    )
    retry_backoff_max_s: float = Field(
        2.0, ge=0, description="Cap of the exponential re-dispatch backoff."
    )
    drain_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest publish_weights waits for in-flight generation to finish before "
        "it aborts that (stale) work and swaps the weights.",
    )


class PromptSource(Protocol):
    """The dataset and reward as the pump needs them (token level)."""

    @property
    def fingerprint(self) -> str:
        """Identifies dataset and reward."""
        ...

    @property
    def num_prompts(self) -> int:
        """Prompts in dataset order."""
        ...

    def prompt_token_ids(self, index: int) -> list[int]:
        """Token ids of prompt ``index``."""
        ...

    def reward(self, index: int, completion_token_ids: Sequence[int]) -> float:
        """Reward of a completion of prompt ``index``; one that raises fails that sibling
        without retry (its group is dropped), never the run, unless it raises
        :class:`RunStoppedError`: then the sibling fails and the run stops with it."""
        ...


@dataclass(frozen=True, slots=True)
class RolloutSample:
    """One sibling of a selected group, ready for the trainer."""

    group_id: int
    prompt_index: int
    sibling: int
    prompt_token_ids: tuple[int, ...]
    completion_token_ids: tuple[int, ...]
    old_logprobs: tuple[float, ...]
    reward: float
    weight_version: int


@dataclass(frozen=True)
class Batch:
    """The durable batch of one train step."""

    train_step: int
    group_ids: tuple[int, ...]
    shortfall: int
    samples: tuple[RolloutSample, ...]

    @property
    def mean_reward(self) -> float:
        """Mean reward over the batch's samples."""
        return sum(s.reward for s in self.samples) / max(1, len(self.samples))


class RunStoppedError(RolloutlogError, RuntimeError):
    """The pump stopped because of an error; the message names it. The log is intact."""


class DataExhaustedError(RunStoppedError):
    """A train step can never be formed because every prompt of every pass was pulled:
    the run has used up its data (the log is intact; more passes would continue it)."""


@dataclass
class PumpStats:
    """What the pump has done (for progress display and tests)."""

    dispatched: int = 0
    completed: int = 0
    failed: int = 0
    aborted: int = 0
    fenced_results: int = 0
    malformed: int = 0
    #: Completions whose reward raised (each recorded as a failed sibling, no retry).
    reward_failures: int = 0


@dataclass
class _Flight:
    task: asyncio.Task[None]
    siblings: dict[int, int] = field(default_factory=dict)  # sibling -> attempt


class RolloutRuntime:
    """Runs the rollout pump for one controller and serves batches to a training loop."""

    def __init__(
        self,
        controller: RolloutController,
        backend: GenerationBackend,
        prompts: PromptSource,
        generation: GenerationConfig | None = None,
    ) -> None:
        self.controller = controller
        self.backend = backend
        self.prompts = prompts
        self.generation = generation or GenerationConfig()
        self.stats = PumpStats()
        self._flights: dict[int, _Flight] = {}
        self._changed = asyncio.Event()
        self._pump_task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._closing = False
        #: Completions' payloads by group, then payload id, until their batch is assembled;
        #: a group that leaves the state untrained (dropped, evicted) is forgotten by the
        #: pump (:meth:`_forget_gone_groups`), so the cache holds live groups only.
        self._payload_cache: dict[int, dict[str, bytes]] = {}
        #: (groups dropped, evicted, trained) when the cache was last pruned.
        self._gone_mark = (-1, -1, -1)
        self._prompt_cache: dict[int, tuple[int, ...]] = {}
        #: Weight swaps in progress (publish/sync). Dispatch waits meanwhile: the version
        #: stamped on a dispatch would be the outgoing one, and work admitted for the next
        #: step would be stale on arrival (and evicted, costing a prompt each).
        self._swapping = 0
        #: Seconds each checkpoint() took until its marker was durable (for metrics; one
        #: float per checkpoint, so it stays small).
        self.checkpoint_seconds: list[float] = []
        #: Backend-initiated aborts per (group, sibling): capped by
        #: ``max_backend_aborts_per_sibling`` so a backend that aborts everything cannot
        #: make the pump re-dispatch the same sibling forever.
        self._backend_aborts: dict[tuple[int, int], int] = {}
        #: Consecutive failed or aborted requests per group, and the loop time before
        #: which the group is not re-dispatched (exponential backoff).
        self._retry_streak: dict[int, int] = {}
        self._not_before: dict[int, float] = {}
        #: Records a fleet's engine membership in the log: installed as the fleet's
        #: listener here (unless the caller installed its own), before the fleet starts,
        #: so the engines' joins are recorded too.
        self.membership: EngineMembershipRecorder | None = None
        if isinstance(backend, RecordsEngineMembership):
            # Imported only here: the recorder needs the fleet's modules ([fleet] extra).
            from .engine_membership import EngineMembershipRecorder

            recorder = EngineMembershipRecorder(controller, on_error=self._fail)
            if backend.adopt_membership_recorder(recorder):
                self.membership = recorder

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the backend and the pump."""
        await self.backend.start()
        self._pump_task = asyncio.create_task(self._pump(), name="rolloutlog-pump")

    async def close(self) -> None:
        """Stop the pump, abort in-flight generation, record the aborts, flush the log.

        Every attempt still in flight is recorded as aborted, so another runtime on the
        same controller re-dispatches it (an attempt left in flight would never come
        back). Raises the error of recording those aborts or of the final flush: a close
        that could not make the log durable must not look like a clean one.
        """
        self._closing = True
        self._changed.set()
        if self._pump_task is not None:
            self._pump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pump_task
        for gid, flight in list(self._flights.items()):
            try:
                await self.backend.abort(gid)
            except Exception:  # the engine may be gone already; the log still records it
                log.exception("aborting group %s in the backend failed", gid)
            flight.task.cancel()
        for flight in list(self._flights.values()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await flight.task
        self._flights.clear()
        error: BaseException | None = None
        try:
            self._abort_all_in_flight("the runtime was closed")
        except Exception as exc:
            error = exc
        try:
            await self.controller.aflush()
        except Exception as exc:
            error = error or exc
        if error is not None:
            raise error

    def _abort_all_in_flight(self, reason: str) -> None:
        """Record the abort of every sibling attempt the log holds in flight."""
        if self.controller.state.failure is not None:
            return  # a failed run takes no command; its in-flight work dies with it
        for group in self.controller.state.live_groups(Phase.ADMITTED):
            for index, sib in enumerate(group.siblings):
                if sib.status is SiblingStatus.IN_FLIGHT:
                    self.controller.execute(
                        commands.AbortSibling(group.group_id, index, sib.attempt, reason)
                    )
                    self.stats.aborted += 1

    @property
    def failure(self) -> BaseException | None:
        """The error that stopped the pump (a backend that cannot be reached, a log that
        failed, ...), None while it runs. Once set it stays: the pump dispatches nothing
        more, and :meth:`next_batch` and the other calls raise :class:`RunStoppedError`."""
        return self._error

    def completion_payload(self, group_id: int, payload_id: str) -> bytes:
        """The encoded arrays (``token_ids``, ``logprobs``) of one completion of
        ``group_id``: from memory while the group is live, else read from the log's store.

        It changes nothing (unlike assembling a :class:`Batch`, which frees what it
        reads), so a caller building its own samples may call it from a worker thread
        while the pump runs."""
        cached = self._payload_cache.get(group_id)
        data = None if cached is None else cached.get(payload_id)
        if data is None:
            data = self.controller.store.get_payload(self.controller.run_id, payload_id)
        return data

    def _raise_if_failed(self) -> None:
        if isinstance(self._error, RunStoppedError):
            raise self._error  # already says why the run stopped
        if self._error is not None:
            raise RunStoppedError(f"the rollout pump stopped: {self._error}") from self._error

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
            log.error("rollout pump stopping: %s", exc)
        self._changed.set()

    # ------------------------------------------------------------------ the pump
    async def _pump(self) -> None:
        try:
            # A failure stops dispatch for good: re-dispatching after a non-retryable
            # error would write an abort/dispatch pair per sibling as fast as the loop spins.
            while not self._closing and self._error is None:
                self._changed.clear()
                self._forget_gone_groups()
                self._admit()
                self._dispatch()
                await self._changed.wait()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(exc)

    def _forget_gone_groups(self) -> None:
        """Drop the cached payloads of groups that left the state. Groups leave only by
        being dropped, evicted or trained, so the cache is scanned only when one of those
        counters moved (not at every turn of the pump)."""
        state = self.controller.state
        c = state.counters
        mark = (c.prompts_dropped, c.groups_evicted, c.groups_trained)
        if mark == self._gone_mark:
            return
        self._gone_mark = mark
        groups = state.groups
        for gid in [gid for gid in self._payload_cache if gid not in groups]:
            del self._payload_cache[gid]

    def _admit(self) -> None:
        state = self.controller.state
        while admission_blocker(state) is None:
            self.controller.execute(commands.AdmitStep())

    def _in_flight(self) -> int:
        return sum(len(f.siblings) for f in self._flights.values())

    def _dispatch(self) -> None:
        state = self.controller.state
        budget = self.generation.max_in_flight_siblings - self._in_flight()
        if budget <= 0 or self._swapping or self._error is not None or self._closing:
            return
        now = asyncio.get_running_loop().time()
        # Oldest target step first, so the next batch fills before later ones.
        candidates = sorted(
            state.live_groups(Phase.ADMITTED),  # rows scanned, a view per admitted group
            key=lambda g: (g.target_step if g.target_step is not None else 0, g.group_id),
        )
        for group in candidates:
            if budget <= 0:
                break
            if group.group_id in self._flights:
                continue
            if self._not_before.get(group.group_id, 0.0) > now:
                continue  # backing off after a failed or aborted request
            pending = [
                i for i, s in enumerate(group.siblings) if s.status is SiblingStatus.PENDING
            ][:budget]
            if not pending:
                continue
            version = self.backend.weight_version
            applied = self.controller.execute(
                commands.DispatchSiblings(group.group_id, tuple(pending), version)
            )
            specs = tuple(SiblingSpec(ev.sibling, ev.attempt) for _, ev in applied)  # type: ignore[attr-defined]
            request = GroupRequest(
                group_id=group.group_id,
                prompt_token_ids=self._prompt(group.prompt_index),
                siblings=specs,
                sampling=SamplingConfig(
                    max_tokens=self.generation.max_tokens,
                    temperature=self.generation.temperature,
                    top_p=self.generation.top_p,
                ),
            )
            flight = _Flight(
                task=asyncio.create_task(self._generate(request, group.prompt_index)),
                siblings={s.sibling: s.attempt for s in specs},
            )
            self._flights[group.group_id] = flight
            self.stats.dispatched += len(specs)
            budget -= len(specs)

    def _prompt(self, index: int) -> tuple[int, ...]:
        ids = self._prompt_cache.get(index)
        if ids is None:
            ids = tuple(int(t) for t in self.prompts.prompt_token_ids(index))
            self._prompt_cache[index] = ids
        return ids

    async def _generate(self, request: GroupRequest, prompt_index: int) -> None:
        try:
            try:
                results = await self.backend.generate(request)
                validate_results(request, results, self.backend.vocab_size)
            except BackendAbortedError as exc:
                if self._record_backend_aborts(request, exc.sibling_reasons):
                    self._back_off(request.group_id)
                return
            except MalformedResultError as exc:
                # A contract breach is a bug in the backend, not a transient failure.
                self.stats.malformed += 1
                self._record_aborts(request, f"malformed result: {exc}")
                self._fail(exc)
                return
            except BackendError as exc:
                if isinstance(exc, BackendUnavailableError):
                    self._record_aborts(request, f"backend unavailable: {exc}")
                    self._fail(exc)
                    return
                if self._record_failures(request, exc):
                    self._back_off(request.group_id)
                return
            self._retry_streak.pop(request.group_id, None)
            self._not_before.pop(request.group_id, None)
            self._record_results(request, prompt_index, results)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(exc)
        finally:
            self._flights.pop(request.group_id, None)
            self._changed.set()

    def _record_results(
        self, request: GroupRequest, prompt_index: int, results: Sequence[SiblingResult]
    ) -> None:
        epoch = self.controller.epoch
        for res in results:
            payload_id = f"e{epoch}-g{res.group_id}-s{res.sibling}-a{res.attempt}"
            data = encode_arrays({"token_ids": res.token_ids, "logprobs": res.logprobs})
            try:
                reward = float(self.prompts.reward(prompt_index, res.token_ids))
            except RunStoppedError as exc:
                # The prompt source stops the run (too many reward failures): this
                # sample's reward failed too; record it, then stop.
                self._record_reward_failure(res, f"reward failed: {exc}")
                self._fail(exc)
                return
            except Exception as exc:
                # A reward that raises is this sample's failure, not the run's: the sibling
                # fails without retry (SiblingFailed carries the message) and the drop
                # policy fills the group's slot.
                self._record_reward_failure(res, f"reward failed: {type(exc).__name__}: {exc}")
                continue
            try:
                self.controller.execute(
                    commands.CompleteSibling(
                        res.completion(
                            prompt_tokens=len(request.prompt_token_ids),
                            reward=reward,
                            payload_id=payload_id,
                        )
                    ),
                    payload_puts=(PayloadPut(payload_id, "sibling", data),),
                )
            except (StaleAttemptError, IllegalTransitionError) as exc:
                # Fencing: the attempt was superseded (abort, eviction, restore); drop it.
                self.stats.fenced_results += 1
                log.debug("rejected result: %s", exc)
                continue
            self._payload_cache.setdefault(res.group_id, {})[payload_id] = data
            self._backend_aborts.pop((res.group_id, res.sibling), None)
            self.stats.completed += 1

    def _still_in_flight(self, group_id: int, sibling: int, attempt: int) -> bool:
        group = self.controller.state.groups.get(group_id)
        if group is None or not 0 <= sibling < len(group.siblings):
            return False
        sib = group.siblings[sibling]
        return sib.attempt == attempt and sib.status is SiblingStatus.IN_FLIGHT

    def _back_off(self, group_id: int) -> None:
        """Hold the group back before its next dispatch (exponential, capped)."""
        streak = self._retry_streak.get(group_id, 0) + 1
        self._retry_streak[group_id] = streak
        gen = self.generation
        delay = min(gen.retry_backoff_max_s, gen.retry_backoff_s * 2 ** (streak - 1))
        if delay <= 0:
            return
        loop = asyncio.get_running_loop()
        self._not_before[group_id] = loop.time() + delay
        loop.call_later(delay, self._changed.set)  # wake the pump when it may dispatch

    def _record_backend_aborts(
        self, request: GroupRequest, reasons: Mapping[int, str] | None = None
    ) -> int:
        """Record a request the backend aborted on its own; return how many were recorded.

        Aborts the pump asked for (publish, eviction, close) were recorded already, so
        their siblings are no longer in flight and are skipped here. Past
        ``max_backend_aborts_per_sibling`` the abort is recorded as a retryable failure,
        so ``attempts_per_sibling`` bounds the sibling's attempts.
        """
        cap = self.generation.max_backend_aborts_per_sibling
        recorded = 0
        for spec in self._in_flight_specs(request):
            key = (request.group_id, spec.sibling)
            count = self._backend_aborts.get(key, 0) + 1
            self._backend_aborts[key] = count
            why = (reasons or {}).get(spec.sibling)
            because = f": {why}" if why else ""
            if count < cap:
                self._abort_sibling(request.group_id, spec, f"aborted by the backend{because}")
            else:
                self._backend_aborts.pop(key, None)
                self._fail_sibling(
                    request.group_id,
                    spec,
                    retryable=True,
                    reason=f"aborted by the backend {count} times "
                    f"(max_backend_aborts_per_sibling={cap}){because}",
                )
                self.stats.failed += 1
            recorded += 1
        return recorded

    def _record_failures(self, request: GroupRequest, exc: BackendError) -> int:
        recorded = 0
        for spec in self._in_flight_specs(request):
            self._fail_sibling(request.group_id, spec, retryable=exc.retryable, reason=str(exc))
            self.stats.failed += 1
            recorded += 1
        return recorded

    def _record_reward_failure(self, res: SiblingResult, reason: str) -> None:
        if not self._still_in_flight(res.group_id, res.sibling, res.attempt):
            return
        self._fail_sibling(res.group_id, res, retryable=False, reason=reason, cause="reward")
        self.stats.reward_failures += 1

    def _record_aborts(self, request: GroupRequest, reason: str) -> None:
        for spec in self._in_flight_specs(request):
            self._abort_sibling(request.group_id, spec, reason)

    def _in_flight_specs(self, request: GroupRequest) -> Iterator[SiblingSpec]:
        """The request's sibling attempts still in flight (each checked as it is reached)."""
        for spec in request.siblings:
            if self._still_in_flight(request.group_id, spec.sibling, spec.attempt):
                yield spec

    def _abort_sibling(self, group_id: int, spec: SiblingSpec | SiblingResult, reason: str) -> None:
        self.controller.execute(
            commands.AbortSibling(
                group_id=group_id, sibling=spec.sibling, attempt=spec.attempt, reason=reason
            )
        )
        self.stats.aborted += 1

    def _fail_sibling(
        self,
        group_id: int,
        spec: SiblingSpec | SiblingResult,
        *,
        retryable: bool,
        reason: str,
        cause: FailureCause = "generation",
    ) -> None:
        self.controller.execute(
            commands.FailSibling(
                group_id=group_id,
                sibling=spec.sibling,
                attempt=spec.attempt,
                retryable=retryable,
                reason=reason,
                cause=cause,
            )
        )

    # ------------------------------------------------------------------ trainer API
    async def next_batch(self, train_step: int, *, timeout: float | None = None) -> Batch:
        """The batch of ``train_step``, once selected and durable.

        Raises :class:`RunStoppedError` if the pump failed, and the domain's
        StepOutOfOrderError for a step other than the next one.
        """
        state = self.controller.state
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while train_step not in state.batches:
            self._raise_if_failed()
            try:
                self.controller.execute(commands.SelectBatch(train_step))
                self._changed.set()  # evictions may free slots for the pump
                continue
            except RunFailedError as exc:
                # The run failed (drop policy "fail") before the pump noticed: the same
                # stop, with the same error, whoever sees it first.
                self._fail(exc)
                self._raise_if_failed()
            except BatchNotReadyError as exc:
                if not self._flights and self._nothing_can_arrive():
                    if state.dataset_cursor >= state.walk_size:
                        raise DataExhaustedError(
                            f"the data ran out before step {train_step}: all "
                            f"{state.dataset_size} prompts of {state.passes} pass(es) were "
                            "pulled (dropped and evicted prompts use up data too); set more "
                            "passes or fewer steps"
                        ) from exc
                    raise RunStoppedError(f"step {train_step} can never be formed: {exc}") from exc
            self._changed.set()
            waiter = asyncio.ensure_future(self._wait_change())
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            done, _ = await asyncio.wait({waiter}, timeout=remaining)
            if not done:
                waiter.cancel()
                raise TimeoutError(f"batch of step {train_step} not ready after {timeout}s")
        await self.controller.aflush()  # output commit: durable before the trainer sees it
        await self._load_payloads(train_step)
        return self._assemble(train_step)

    async def _load_payloads(self, train_step: int) -> None:
        """Read the batch's payloads that are not in memory (after a restore, all of them)
        on a worker thread: a thousand database reads must not stop the event loop."""
        state = self.controller.state
        cache = self._payload_cache
        missing = [
            (gid, sib.payload_id)
            for gid in state.batches[train_step]
            for sib in state.groups[gid].siblings
            if sib.payload_id is not None and sib.payload_id not in cache.get(gid, ())
        ]
        if not missing:
            return
        store, run_id = self.controller.store, self.controller.run_id
        found = await asyncio.to_thread(
            lambda: [(gid, p, store.get_payload(run_id, p)) for gid, p in missing]
        )
        for gid, payload_id, data in found:
            cache.setdefault(gid, {})[payload_id] = data

    async def _wait_change(self) -> None:
        # The pump clears the event at the top of its loop; poll briefly as a backstop.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout=0.05)
        await asyncio.sleep(0)

    def _nothing_can_arrive(self) -> bool:
        state = self.controller.state
        generating = bool(state.live_groups(Phase.ADMITTED))
        return not generating and admission_blocker(state) is not None

    def _assemble(self, train_step: int) -> Batch:
        state = self.controller.state
        gids = state.batches[train_step]
        samples: list[RolloutSample] = []
        for gid in gids:
            group = state.groups[gid]
            prompt = self._prompt(group.prompt_index)
            for index, sib in enumerate(group.siblings):
                assert sib.payload_id is not None and sib.weight_version is not None
                arrays = decode_arrays(self._payload(gid, sib.payload_id))
                samples.append(
                    RolloutSample(
                        group_id=gid,
                        prompt_index=group.prompt_index,
                        sibling=index,
                        prompt_token_ids=prompt,
                        # tolist: Python ints and floats, converted in C.
                        completion_token_ids=tuple(arrays["token_ids"].tolist()),
                        old_logprobs=tuple(arrays["logprobs"].tolist()),
                        reward=float(sib.reward if sib.reward is not None else 0.0),
                        weight_version=sib.weight_version,
                    )
                )
        return Batch(
            train_step=train_step,
            group_ids=tuple(gids),
            shortfall=state.batch_shortfall.get(train_step, 0),
            samples=tuple(samples),
        )

    def _payload(self, group_id: int, payload_id: str) -> bytes:
        cached = self._payload_cache.get(group_id)
        data = None if cached is None else cached.pop(payload_id, None)
        if cached is not None and not cached:
            del self._payload_cache[group_id]
        if data is None:
            data = self.controller.store.get_payload(self.controller.run_id, payload_id)
        return data

    async def report_trained(self, train_step: int, weight_version: int) -> None:
        """Record that ``train_step`` trained and produced ``weight_version``."""
        self._raise_if_failed()
        self.controller.execute(commands.RecordTrainStep(train_step, weight_version))
        self._changed.set()

    async def evict_doomed(self) -> int:
        """Evict the ``in_order`` groups that will be stale at their target step, once a
        replacement generated now would not be (``EvictDoomed``); returns how many."""
        self._raise_if_failed()
        applied = self.controller.execute(commands.EvictDoomed())
        events = [ev for _, ev in applied]
        if events:
            await self._abort_in_backend(events)
            self._changed.set()
        return sum(1 for ev in events if ev.event_type == "GroupEvicted")

    @property
    def generating(self) -> int:
        """Groups with a generation request in flight."""
        return len(self._flights)

    def hold_dispatch(self) -> None:
        """Dispatch nothing until :meth:`release_dispatch` (calls nest).

        For a caller that recorded a train step whose publish is still to come: work
        dispatched meanwhile would be stamped with the outgoing weight version while
        admission already runs ``lookahead`` steps past the new train step, so it would
        be stale before it trains.
        """
        self._swapping += 1

    def release_dispatch(self) -> None:
        """End one :meth:`hold_dispatch`."""
        if self._swapping <= 0:
            raise RuntimeError("release_dispatch() without hold_dispatch()")
        self._swapping -= 1
        self._changed.set()

    async def publish_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int
    ) -> None:
        """Load new weights into the backend, record the publish, abort stale work.

        Output commit: the train step behind these weights is durable before generation
        sees them.
        """
        self._raise_if_failed()
        self._swapping += 1
        try:
            await self.controller.aflush()
            await self._update_weights_drained(named_tensors, weight_version)
        finally:
            self._swapping -= 1
        applied = self.controller.execute(commands.PublishWeights(weight_version))
        await self._abort_in_backend([ev for _, ev in applied])
        self._changed.set()

    async def _update_weights_drained(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int
    ) -> None:
        """``update_weights`` with a bounded drain (``drain_timeout_s``).

        The backend swaps only once in-flight generation has finished. If it has not
        within the timeout, that work is stale anyway: its aborts are recorded, the
        backend is told to abort it, and the swap gets one more timeout to go through.
        """
        timeout = self.generation.drain_timeout_s
        update = asyncio.ensure_future(self.backend.update_weights(named_tensors, weight_version))
        try:
            done, _ = await asyncio.wait({update}, timeout=timeout)
            if not done:
                reason = (
                    f"in-flight generation did not drain within drain_timeout_s={timeout} "
                    f"for the publish of weight version {weight_version}"
                )
                log.warning("%s: aborting it", reason)
                self._abort_all_in_flight(reason)
                for gid in list(self._flights):
                    await self.backend.abort(gid)
                done, _ = await asyncio.wait({update}, timeout=timeout)
                if not done:
                    err = BackendUnavailableError(
                        f"the backend did not swap to weight version {weight_version}: "
                        f"aborted generation still had not drained after {2 * timeout}s"
                    )
                    self._fail(err)  # a backend that cannot swap stops the run
                    raise err
            update.result()
        finally:
            if not update.done():
                update.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await update

    async def sync_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int
    ) -> None:
        """Bring a fresh backend to the trainer's weights (after a restore or a takeover).

        Loads ``weight_version`` into the backend if it serves another version, and
        records the publish if the log has not recorded it yet.
        """
        if self.backend.weight_version != weight_version:
            self._swapping += 1
            try:
                await self._update_weights_drained(named_tensors, weight_version)
            finally:
                self._swapping -= 1
        if self.controller.state.published_version < weight_version:
            applied = self.controller.execute(commands.PublishWeights(weight_version))
            await self._abort_in_backend([ev for _, ev in applied])
        self._changed.set()

    async def _abort_in_backend(self, events: list[RolloutEvent]) -> None:
        groups = {ev.group_id for ev in events if isinstance(ev, SiblingAborted)}
        groups |= {
            ev.group_id  # type: ignore[attr-defined]
            for ev in events
            if ev.event_type == "GroupEvicted"
        }
        for gid in sorted(groups):
            if gid in self._flights:
                await self.backend.abort(gid)

    async def checkpoint(self, train_step: int) -> int:
        """Mark a checkpoint after ``train_step`` trained steps; return its durable offset."""
        self._raise_if_failed()
        started = time.perf_counter()
        applied = self.controller.execute(commands.MarkCheckpoint(train_step=train_step))
        await self.controller.aflush()
        self.checkpoint_seconds.append(time.perf_counter() - started)
        return applied[-1][0]

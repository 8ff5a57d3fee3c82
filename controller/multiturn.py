"""Multi-turn rollouts on the rollout runtime: each sibling is a trajectory of turns.

:class:`TrajectoryBackend` is a :class:`~rolloutlog.controller.backends.base.GenerationBackend`
that wraps another one (deterministic, torch, vLLM): the runtime dispatches siblings to
it as usual, and for each sibling it runs a trajectory turn by turn on the inner backend,
recording every model call, tool call and environment step through the controller
(``controller/domain/trajectory.py`` has the events and the rules). When the trajectory
ends it returns one result per sibling: the whole response (model, tool and environment
tokens; the loss mask and the per-token weight versions are in ``TrajectoryCompleted``),
and the runtime records the sibling's completion as for any backend.

Durability, turn by turn:

- a tool call is durable (``ToolCallRequested``, flushed) **before** the tool runs;
- token ids are the source of truth: the context is the prompt's ids followed by the
  recorded token arrays; a tool or environment text is tokenised once, as it enters the
  context, and a model output is only decoded (to parse tool calls), never re-encoded;
- a restore (or a retry) dispatches the sibling under a new attempt: the backend
  records ``TrajectoryResumed``, reuses every durable model call (never regenerated) and
  tool result (fed back), and resolves tool calls left open (the tool's status check,
  an idempotent re-run, or a recorded refusal to run a non-idempotent tool twice);
- a model output or tool result of an attempt that is no longer the live one is refused
  and recorded (``LateResultRefused``).

The book of trajectories is the fold of the trajectory events of the groups a dispatch
can still reach, all epochs included (a tool that ran in an abandoned branch still ran):
:meth:`attach` reads them through the rollout index when the backend is put on a
(restored) controller, at the cost of those trajectories, not of the run's history.

The runtime's ``max_tokens`` bounds a whole trajectory's response (model, tool and
environment tokens); :class:`MultiTurnConfig` bounds each model call and the turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rolloutlog.eventstore import PayloadPut, decode_arrays, encode_arrays

from .backends.base import (
    BackendAbortedError,
    BackendError,
    GenerationBackend,
    GroupRequest,
    SamplingConfig,
    SiblingResult,
    SiblingSpec,
)
from .domain.errors import StaleAttemptError
from .domain.events import CODEC
from .domain.trajectory import (
    TURN_EVENT_TYPES,
    EnvironmentStepped,
    LateKind,
    LateResultRefused,
    ModelCallCompleted,
    RecordTurn,
    StalenessPolicy,
    ToolCallCompleted,
    ToolCallFailed,
    ToolCallRequested,
    TrajectoryBook,
    TrajectoryCompleted,
    TrajectoryResumed,
    TrajectoryStarted,
    TrajectoryState,
    TrajectoryTooStale,
    TurnEvent,
    decide_staleness,
    evolve_trajectory,
)
from .environments import (
    EnvironmentCallError,
    EnvironmentSession,
    Tokenizer,
    Tool,
    ToolCall,
    parse_tool_calls,
)
from .rollout_index import read_groups

if TYPE_CHECKING:
    import torch

    from .rollout_controller import RolloutController
    from .rollout_runtime import Batch, PromptSource

log = logging.getLogger(__name__)


class MultiTurnConfig(BaseModel):
    """How a trajectory runs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_turns: int = Field(8, ge=1, description="Most model calls per trajectory.")
    max_tokens_per_turn: int = Field(16, ge=1, description="Most tokens one model call generates.")
    max_context_tokens: int | None = Field(
        None,
        ge=2,
        description="Longest context (prompt and every turn) a model call may read plus the "
        "tokens it generates: the engine's max_model_len. A trajectory that reaches it ends "
        "(finish 'context_full'); None: only the response budget (max_tokens) bounds it.",
    )
    model_call_retries: int = Field(
        2,
        ge=0,
        description="Times one model call that failed retryably (its engine lost, "
        "unreachable or stale) is sent again within the same sibling attempt: the inner "
        "backend routes it to another engine and the turns already recorded stay; each "
        "failed try is recorded on the call's ModelCallCompleted (failed_tries). Past it "
        "the attempt fails (retryable) and the runtime's next attempt resumes the "
        "trajectory after its last durable turn.",
    )
    tool_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Deadline of one tool call (and of one status check), in seconds. A "
        "tool past it is recorded as failed (ToolCallFailed, outcome 'timeout'; the reason "
        "enters the context) and is never run again for that call (it may have had "
        "effects); so is a call whose status check does not answer in time. An async tool is "
        "cancelled at the deadline; a synchronous one runs in a daemon thread, abandoned "
        "at the deadline (Python cannot stop a thread; a late result is dropped). None: "
        "no deadline, and a synchronous tool runs on the event loop.",
    )
    environment_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Deadline of one call of the environment (reset, step, get_reward, "
        "close), in seconds. A call past it, or one that raises, fails the sibling attempt "
        "(SiblingFailed, retryable, its reason naming the call, its turn and the deadline); "
        "the next attempt resumes the trajectory after its last durable turn, up to "
        "attempts_per_sibling. An async call is cancelled at the deadline; a synchronous one "
        "runs in a daemon thread, abandoned at the deadline (a late result is dropped). A "
        "close past it is logged only. None: no deadline, and a synchronous call runs on the "
        "event loop.",
    )
    max_weight_versions: int | None = Field(
        None,
        ge=1,
        description="Most distinct weight versions one trajectory's model calls may span "
        "(counting the engine's version for its next model call); past it, "
        "on_too_many_versions decides. None: unbounded (every trajectory kept).",
    )
    on_too_many_versions: Literal["keep", "abort", "restart"] = Field(
        "keep",
        description="What a trajectory that would span more than max_weight_versions gets: "
        "keep (recorded, per-token versions say which weights made each turn), abort (every "
        "turn abandoned, the sibling attempt aborted; its next attempt starts anew), restart "
        "(turns after restart_after_turn abandoned; it goes on under the current weights).",
    )
    restart_after_turn: int = Field(
        0,
        ge=0,
        description="For on_too_many_versions restart: the last turn kept (turns "
        "0..restart_after_turn stay, with their tool results and environment steps).",
    )

    @model_validator(mode="after")
    def _policy_needs_a_bound(self) -> MultiTurnConfig:
        if self.on_too_many_versions != "keep" and self.max_weight_versions is None:
            raise ValueError(
                f"on_too_many_versions {self.on_too_many_versions!r} needs max_weight_versions"
            )
        return self

    @property
    def staleness(self) -> StalenessPolicy:
        """The per-trajectory staleness policy (the domain's)."""
        return StalenessPolicy(
            self.max_weight_versions, self.on_too_many_versions, self.restart_after_turn
        )


@dataclass
class MultiTurnStats:
    """What the trajectory backend did (for tests, the demo and the report)."""

    model_calls: int = 0
    model_calls_reused: int = 0
    model_calls_retried: int = 0
    tool_calls_run: int = 0
    tool_results_reused: int = 0
    tool_calls_status_checked: int = 0
    tool_calls_not_rerun: int = 0
    tool_calls_timed_out: int = 0
    environment_calls_timed_out: int = 0
    environment_calls_failed: int = 0
    trajectories_resumed: int = 0
    trajectories_completed: int = 0
    late_results_refused: int = 0
    trajectories_kept_stale: int = 0
    trajectories_aborted_stale: int = 0
    trajectories_restarted: int = 0
    turns_abandoned: int = 0


#: ``environment_factory``: a new environment object per trajectory (TRL's interface).
EnvironmentFactory = Callable[[], object]
#: Keyword arguments of an environment's ``reset`` for a prompt index (TRL passes the
#: dataset row's columns).
ResetKwargs = Callable[[int], dict[str, Any]]


#: A payload to record with its event, and its token arrays as Python lists (what the
#: backend keeps: encoded once, never decoded back).
_Payload = tuple[PayloadPut, dict[str, list[Any]]]


def _payload(payload_id: str, kind: str, arrays: dict[str, list[Any]]) -> _Payload:
    return PayloadPut(payload_id, kind, encode_arrays(arrays)), arrays


class _Late(Exception):
    """The attempt lost the sibling while it ran; the result was refused and recorded."""


class _Deadline(Exception):
    """A tool or environment call did not answer within its deadline."""


class EnvironmentFailedError(BackendError):
    """A call of a trajectory's environment raised or did not answer within
    ``environment_timeout_s``: the sibling attempt fails (retryably: the next one resumes
    the trajectory after its last durable turn)."""


class _TooStale(Exception):
    """The staleness policy abandoned the trajectory (recorded): abort the attempt."""


class TrajectoryBackend:
    """A generation backend running each sibling as a multi-turn trajectory (see module)."""

    name = "multi-turn"
    adopt_membership_recorder: Callable[[Any], bool]

    def __init__(
        self,
        inner: GenerationBackend,
        tokenizer: Tokenizer,
        *,
        environment_factory: EnvironmentFactory | None = None,
        tools: Sequence[Tool] = (),
        reset_kwargs: ResetKwargs | None = None,
        config: MultiTurnConfig | None = None,
        parse: Callable[[str], list[ToolCall]] = parse_tool_calls,
    ) -> None:
        self.inner = inner
        self.tokenizer = tokenizer
        self.environment_factory = environment_factory
        self.tools = tuple(tools)
        self.reset_kwargs = reset_kwargs
        self.config = config or MultiTurnConfig()
        self.parse = parse
        self.stats = MultiTurnStats()
        self.book: TrajectoryBook = {}
        self._controller: RolloutController | None = None
        #: Final rewards of the results handed to the runtime, by (prompt token ids, response
        #: token ids), each popped when :class:`MultiTurnPrompts` scores that result; and
        #: those of results still being assembled, by (group, sibling, attempt).
        self._rewards: dict[tuple[tuple[int, ...], tuple[int, ...]], list[float]] = {}
        self._pending: dict[tuple[int, int, int], float] = {}
        #: Token arrays of payloads this process wrote or read (payload id -> arrays), and
        #: the payload ids each trajectory holds there (dropped with the trajectory).
        self._arrays: dict[str, dict[str, list[Any]]] = {}
        self._held: dict[tuple[int, int], list[str]] = {}
        self._generates = 0
        # A wrapped fleet's engines join and leave during the run: the runtime offers its
        # membership recorder to whatever it drives (``RecordsEngineMembership``), so the
        # inner backend's hook is exposed here (an instance attribute: only when it has one).
        adopt = getattr(inner, "adopt_membership_recorder", None)
        if adopt is not None:
            self.adopt_membership_recorder = adopt

    # ------------------------------------------------------------ wiring
    def attach(self, controller: RolloutController) -> None:
        """Record through ``controller``; fold into the book the trajectory events (every
        epoch: what ran in an abandoned branch ran) of the groups a dispatch can still
        reach: those live in the run state, and those with ids the run has not admitted
        yet (an abandoned branch's, which the run admits again under the same ids).

        The events come through the rollout index's group index: the cost is that of the
        trajectories read, not of the run's history (trained groups are never read)."""
        self._controller = controller
        self.book = {}
        state = controller.state
        rows = read_groups(
            controller.store,
            controller.run_id,
            list(state.groups),
            TURN_EVENT_TYPES,
            from_group=state.next_group_id,
        )
        book = self.book
        for row in rows:
            evolve_trajectory(book, CODEC.decode(row), row.epoch)  # type: ignore[arg-type]

    @property
    def controller(self) -> RolloutController:
        if self._controller is None:
            raise BackendError(
                "the trajectory backend is not attached to a controller", retryable=False
            )
        return self._controller

    # ------------------------------------------------------------ GenerationBackend
    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    async def start(self) -> None:
        self.controller  # noqa: B018 - refuses to start unattached
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def abort(self, group_id: int) -> None:
        await self.inner.abort(group_id)

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        await self.inner.update_weights(named_tensors, version)

    async def generate(self, request: GroupRequest) -> list[SiblingResult]:
        """Run every requested sibling's trajectory; one result per sibling, in order."""
        self._generates += 1
        if self._generates % 64 == 0:
            self._forget_gone()
        dispatched = self.inner.weight_version
        runs = [self._run(request, spec, dispatched) for spec in request.siblings]
        outcomes = await asyncio.gather(*runs, return_exceptions=True)
        rewards = [
            self._pending.pop((request.group_id, spec.sibling, spec.attempt), None)
            for spec in request.siblings
        ]
        stale = {
            spec.sibling: str(out)
            for spec, out in zip(request.siblings, outcomes, strict=True)
            if isinstance(out, _TooStale)
        }
        for out in outcomes:
            if isinstance(out, _Late | _TooStale):
                raise BackendAbortedError(f"group {request.group_id}: {out}", sibling_reasons=stale)
            if isinstance(out, BaseException):
                raise out
        results = [out for out in outcomes if isinstance(out, SiblingResult)]
        for res, reward in zip(results, rewards, strict=True):
            if reward is not None:  # the runtime scores each result once: popped then
                key = (request.prompt_token_ids, res.token_ids)
                self._rewards.setdefault(key, []).append(reward)
        return results

    def _forget_gone(self) -> None:
        """Drop the trajectories (and their cached token arrays) of groups that left the
        run state (trained, evicted, dropped): no attempt can resume them any more. A
        restore reads the book again from the log (:meth:`attach`)."""
        state = self.controller.state
        groups, admitted = state.groups, state.next_group_id
        # (Ids not admitted yet keep theirs: an abandoned branch's, admitted again later.)
        for key in [k for k in self.book if k[0] not in groups and k[0] < admitted]:
            del self.book[key]
            for pid in self._held.pop(key, ()):
                self._arrays.pop(pid, None)

    # ------------------------------------------------------------ one trajectory
    def _record(self, event: TurnEvent, *payloads: _Payload) -> TrajectoryState:
        """Decide and append ``event`` with its payloads (a late one is recorded as
        refused: :class:`_Late`; a staleness decision of a superseded attempt is no result:
        it is only dropped); keep their token arrays."""
        ctl = self.controller
        key = (event.group_id, event.sibling)
        traj = self.book.get(key)
        try:
            ctl.execute(RecordTurn(event, traj), payload_puts=tuple(p for p, _ in payloads))
        except StaleAttemptError as exc:
            if not isinstance(event, TrajectoryTooStale):
                self._refuse(event, str(exc))
            raise _Late(str(exc)) from exc
        for put, arrays in payloads:
            self._arrays[put.payload_id] = arrays
            self._held.setdefault(key, []).append(put.payload_id)
        out = evolve_trajectory(self.book, event, ctl.epoch)
        assert out is not None
        return out

    def _refuse(self, event: TurnEvent, reason: str) -> None:
        state = self.controller.state
        group = state.groups.get(event.group_id)
        current = 0 if group is None else group.sibling(event.sibling).attempt
        kind: LateKind = (
            "model_call"
            if isinstance(event, ModelCallCompleted)
            else "environment_step"
            if isinstance(event, EnvironmentStepped)
            else "tool_call"
        )
        refusal = LateResultRefused(
            group_id=event.group_id,
            sibling=event.sibling,
            attempt=event.attempt,
            turn=getattr(event, "turn", -1),
            kind=kind,
            current_attempt=current,
            reason=reason[:500],
        )
        self.controller.execute(RecordTurn(refusal, self.book.get((event.group_id, event.sibling))))
        evolve_trajectory(self.book, refusal, self.controller.epoch)
        self.stats.late_results_refused += 1

    def _payload_id(self, spec: SiblingSpec, group_id: int, what: str) -> str:
        traj = self.book.get((group_id, spec.sibling))
        # After a restart the same attempt writes turns again: their payloads are new ones.
        again = f"-r{traj.restarts}" if traj is not None and traj.restarts else ""
        epoch = self.controller.epoch
        return f"e{epoch}-g{group_id}-s{spec.sibling}-a{spec.attempt}{again}-{what}"

    def _call_key(self, traj: TrajectoryState, turn: int, index: int) -> str:
        """A new tool call's idempotency key (after a restart, one no abandoned call has)."""
        again = f"/r{traj.restarts}" if traj.restarts else ""
        return f"{self.controller.run_id}/g{traj.group_id}/s{traj.sibling}{again}/t{turn}/c{index}"

    def _tokens(self, payload_id: str, key: tuple[int, int]) -> dict[str, list[Any]]:
        arrays = self._arrays.get(payload_id)
        if arrays is None:
            data = self.controller.store.get_payload(self.controller.run_id, payload_id)
            arrays = {k: v.tolist() for k, v in decode_arrays(data).items()}
            self._arrays[payload_id] = arrays
            self._held.setdefault(key, []).append(payload_id)
        return arrays

    def _context(self, prompt: tuple[int, ...], traj: TrajectoryState) -> list[int]:
        ids = list(prompt)
        for seg in traj.segments:
            if seg.payload_id is not None and seg.tokens:
                key = (traj.group_id, traj.sibling)
                ids.extend(self._tokens(seg.payload_id, key)["token_ids"])
        return ids

    def _prompt_index(self, group_id: int) -> int:
        return self.controller.state.groups[group_id].prompt_index

    def _session(self, group_id: int) -> EnvironmentSession:
        env = None if self.environment_factory is None else self.environment_factory()
        return EnvironmentSession(env, self.tools, runner=self._run_environment)

    async def _run_environment(self, what: str, call: Callable[[], Any], is_async: bool) -> Any:
        """Run one call of an environment within ``environment_timeout_s``; its error or
        missed deadline becomes an :class:`EnvironmentCallError` naming the call."""
        timeout = self.config.environment_timeout_s
        try:
            return await self._call_by_deadline(call, is_async, f"environment-{what}", timeout)
        except _Deadline:
            self.stats.environment_calls_timed_out += 1
            raise EnvironmentCallError(
                f"the environment's {what} did not answer within {timeout} s "
                "(environment_timeout_s)"
            ) from None
        except Exception as exc:
            self.stats.environment_calls_failed += 1
            raise EnvironmentCallError(
                f"the environment's {what} raised {type(exc).__name__}: {exc}"
            ) from exc

    async def _reset(self, session: EnvironmentSession, group_id: int) -> str | None:
        kwargs = (
            {} if self.reset_kwargs is None else self.reset_kwargs(self._prompt_index(group_id))
        )
        return await session.reset(**kwargs)

    async def _run(
        self, request: GroupRequest, spec: SiblingSpec, dispatched: int
    ) -> SiblingResult:
        session = self._session(request.group_id)
        try:
            return await self._run_session(request, spec, dispatched, session)
        except EnvironmentCallError as exc:
            raise EnvironmentFailedError(
                f"group {request.group_id} sibling {spec.sibling} attempt {spec.attempt}: {exc}"
            ) from exc
        finally:
            await session.close()

    async def _run_session(
        self, request: GroupRequest, spec: SiblingSpec, dispatched: int, session: EnvironmentSession
    ) -> SiblingResult:
        gid, key = request.group_id, (request.group_id, spec.sibling)
        prompt = request.prompt_token_ids
        budget = request.sampling.max_tokens
        traj = self.book.get(key)
        group = self.controller.state.groups[gid]
        if traj is not None and (
            traj.prompt != (group.data_pass, group.prompt_index) or traj.abandoned
        ):
            # An abandoned branch's trajectory of another prompt, or one the staleness
            # policy abandoned (its turns are never reused): start anew.
            traj = None
        if traj is None:
            observation = await self._reset(session, gid)
            obs_ids = self._encode(observation)[: max(0, budget - 1)] if observation else []
            pid = self._payload_id(spec, gid, "start") if obs_ids else None
            puts = (_payload(pid, "observation", {"token_ids": obs_ids}),) if pid else ()
            traj = self._record(
                TrajectoryStarted(
                    group_id=gid,
                    sibling=spec.sibling,
                    attempt=spec.attempt,
                    prompt_index=group.prompt_index,
                    data_pass=group.data_pass,
                    prompt_tokens=len(prompt),
                    observation=observation,
                    observation_tokens=len(obs_ids),
                    payload_id=pid,
                ),
                *puts,
            )
        elif traj.completed:
            # Every turn is durable and the trajectory finished: nothing is run again.
            traj = self._record(self._resumed(spec, gid, traj))
            self.stats.trajectories_resumed += 1
            self.stats.model_calls_reused += traj.turns
            return self._result_of(request, spec, traj, dispatched, None)
        else:
            traj = await self._resume(spec, gid, traj, session)
        while True:
            if self.book[key].turns:
                finish = await self._answer(request, spec, session)
                if finish is not None:
                    break
            traj = self.book[key]
            if traj.turns >= self.config.max_turns:
                finish = "max_turns"
                break
            if await self._staleness(spec, traj, self.inner.weight_version, session):
                continue  # the newest kept turn is answered already: on to its next call
            left = budget - (traj.context_tokens - len(prompt))
            limit = self.config.max_context_tokens
            if limit is not None:
                left = min(left, limit - traj.context_tokens)
            if left < 1:
                finish = "context_full"
                break
            await self._model_call(request, spec, traj, left)
            # The call may have used other weights than the engine announced (a publish
            # while it ran): decide again on what it used, before its tools run.
            await self._staleness(spec, self.book[key], None, session)
        traj = self.book[key]
        reward = await session.reward()
        return self._complete(request, spec, self.book[key], reward, dispatched, finish)

    @staticmethod
    def _resumed(spec: SiblingSpec, gid: int, traj: TrajectoryState) -> TrajectoryResumed:
        """The event of attempt ``spec`` taking ``traj`` over."""
        return TrajectoryResumed(
            group_id=gid,
            sibling=spec.sibling,
            attempt=spec.attempt,
            from_epoch=traj.owner[0],
            from_attempt=traj.owner[1],
            model_calls_reused=traj.turns,
            tool_results_reused=sum(1 for c in traj.tool_calls if c.status != "requested"),
            tool_calls_open=len(traj.open_tool_calls()),
        )

    async def _staleness(
        self,
        spec: SiblingSpec,
        traj: TrajectoryState,
        next_version: int | None,
        session: EnvironmentSession,
    ) -> bool:
        """Apply the staleness policy to ``traj`` (see :func:`decide_staleness`): record
        its decision if any; raise :class:`_TooStale` when it aborted the trajectory;
        True when it restarted it (``session`` then rebuilt from the kept turns)."""
        event = decide_staleness(traj, self.config.staleness, spec.attempt, next_version)
        if event is None:
            return False
        traj = self._record(event)
        self.stats.turns_abandoned += event.turns_abandoned
        if event.outcome == "kept":
            self.stats.trajectories_kept_stale += 1
            return False
        if event.outcome == "aborted":
            self.stats.trajectories_aborted_stale += 1
            raise _TooStale(f"too stale: {event.reason}")
        self.stats.trajectories_restarted += 1
        # The environment's memory may hold effects of the abandoned turns: build it again
        # from the kept ones, as a resume does (released first: verl-style instances).
        await session.close()
        await self._reset(session, traj.group_id)
        await self._replay_idempotent(session, traj)
        return True

    async def _resume(
        self, spec: SiblingSpec, gid: int, traj: TrajectoryState, session: EnvironmentSession
    ) -> TrajectoryState:
        """Take the trajectory over under this attempt; rebuild the environment's memory
        by replaying its recorded idempotent tool calls (safe by definition)."""
        reused = sum(1 for c in traj.tool_calls if c.status != "requested")
        traj = self._record(self._resumed(spec, gid, traj))
        self.stats.trajectories_resumed += 1
        self.stats.model_calls_reused += traj.turns
        self.stats.tool_results_reused += reused
        await self._reset(session, gid)
        await self._replay_idempotent(session, traj)
        return traj

    async def _replay_idempotent(self, session: EnvironmentSession, traj: TrajectoryState) -> None:
        """Rebuild the environment's memory: replay the trajectory's recorded idempotent
        tool calls (safe by definition; their recorded results stand), each within
        ``tool_timeout_s``."""
        for call in traj.tool_calls:
            tool = session.tools.get(call.tool)
            if call.status == "completed" and tool is not None and tool.idempotent:
                replay = functools.partial(tool, call.arguments, call.idempotency_key)
                try:
                    await self._call_tool(replay, inspect.iscoroutinefunction(tool.fn), call.tool)
                except Exception:  # its recorded result stands; the replay only rebuilds memory
                    log.debug("replaying idempotent tool %s failed", call.tool, exc_info=True)

    async def _model_call(
        self, request: GroupRequest, spec: SiblingSpec, traj: TrajectoryState, left: int
    ) -> None:
        context = self._context(request.prompt_token_ids, traj)
        sampling = SamplingConfig(
            max_tokens=min(self.config.max_tokens_per_turn, left),
            temperature=request.sampling.temperature,
            top_p=request.sampling.top_p,
        )
        turn_request = GroupRequest(request.group_id, tuple(context), (spec,), sampling)
        failed: list[str] = []
        while True:
            try:
                (res,) = await self.inner.generate(turn_request)
                break
            except BackendAbortedError:
                raise  # asked for (a publish, an eviction, close): not the engine's fault
            except BackendError as exc:
                # The engine was lost mid-call (or could not be reached): only this turn's
                # call goes again, within the attempt; the recorded turns stay as they are.
                if not exc.retryable or len(failed) >= self.config.model_call_retries:
                    raise
                failed.append(f"{type(exc).__name__}: {exc}"[:500])
                self.stats.model_calls_retried += 1
                log.info(
                    "group %d sibling %d turn %d: model call failed (%s); sent again",
                    request.group_id,
                    spec.sibling,
                    traj.turns,
                    exc,
                )
        pid = self._payload_id(spec, request.group_id, f"t{traj.turns}")
        output: dict[str, list[Any]] = {
            "token_ids": list(map(int, res.token_ids)),
            "logprobs": list(map(float, res.logprobs)),
        }
        self._record(
            ModelCallCompleted(
                group_id=request.group_id,
                sibling=spec.sibling,
                attempt=spec.attempt,
                turn=traj.turns,
                context_tokens=len(context),
                output_tokens=len(res.token_ids),
                weight_version=res.weight_version,
                payload_id=pid,
                finish_reason=res.finish_reason,
                engine_id=res.engine_id,
                failed_tries=tuple(failed),
            ),
            _payload(pid, "model_call", output),
        )
        self.stats.model_calls += 1

    async def _answer(
        self, request: GroupRequest, spec: SiblingSpec, session: EnvironmentSession
    ) -> str | None:
        """Answer the newest turn (again after a resume: what is recorded is skipped):
        its tool calls, each requested durably before it runs (or resolved if an earlier
        attempt left it open), else an environment step. Returns why the trajectory
        ends, or None to go on with the next model call."""
        gid, key = request.group_id, (request.group_id, spec.sibling)
        prompt, budget = request.prompt_token_ids, request.sampling.max_tokens
        traj = self.book[key]
        turn = traj.turns - 1
        text = self._output_text(traj)
        calls = self.parse(text)
        for index, call in enumerate(calls):
            traj = self.book[key]
            known = next((c for c in traj.turn_calls(turn) if c.call == index), None)
            ikey = self._call_key(traj, turn, index) if known is None else known.idempotency_key
            if known is not None and known.status != "requested":
                continue  # its result is recorded: fed back, not run again
            left = budget - (traj.context_tokens - len(prompt))
            if left < 1:
                return "context_full"  # no room for its result
            tool = session.tools.get(call.name)
            if known is None:
                self._record(
                    ToolCallRequested(
                        group_id=gid,
                        sibling=spec.sibling,
                        attempt=spec.attempt,
                        turn=turn,
                        call=index,
                        tool=call.name,
                        arguments=call.arguments,
                        idempotency_key=ikey,
                        idempotent=tool is not None and tool.idempotent,
                        status_check=tool is not None and tool.status is not None,
                    )
                )
                # The request is durable before the tool runs.
                await self.controller.aflush()
                await self._run_tool(spec, gid, turn, ikey, call, tool, left)
            else:
                await self._resolve_open(spec, gid, turn, ikey, call, tool, known.idempotent, left)
        if calls:
            return None
        if not session.steps:
            return "no_tool_call"
        traj = self.book[key]
        if not traj.stepped:
            left = budget - (traj.context_tokens - len(prompt))
            observation, reward, done = await session.step(text, f"step of turn {turn}")
            ids = self._encode(observation)[: max(0, left)] if observation else []
            pid = self._payload_id(spec, gid, f"t{turn}-env") if ids else None
            puts = (_payload(pid, "observation", {"token_ids": ids}),) if pid else ()
            traj = self._record(
                EnvironmentStepped(
                    group_id=gid,
                    sibling=spec.sibling,
                    attempt=spec.attempt,
                    turn=turn,
                    observation=observation,
                    observation_tokens=len(ids),
                    payload_id=pid,
                    reward=reward,
                    done=done,
                ),
                *puts,
            )
        return "done" if traj.done else None

    def _output_text(self, traj: TrajectoryState) -> str:
        """The newest model output as text (decoded, never re-encoded)."""
        seg = next(s for s in reversed(traj.segments) if s.kind == "model")
        key = (traj.group_id, traj.sibling)
        return self.tokenizer.decode(self._tokens(seg.payload_id or "", key)["token_ids"])

    async def _resolve_open(
        self,
        spec: SiblingSpec,
        gid: int,
        turn: int,
        key: str,
        call: ToolCall,
        tool: Tool | None,
        was_idempotent: bool,
        left: int,
    ) -> None:
        """A call requested by an earlier attempt without a recorded result: ask the
        tool's status, re-run an idempotent tool, or refuse to run it twice."""
        if tool is not None and tool.status is not None:
            started = time.perf_counter()
            status = tool.status
            try:
                result = await self._call_tool(
                    lambda: status(key), inspect.iscoroutinefunction(status), f"{call.name}-status"
                )
            except _Deadline:
                self.stats.tool_calls_timed_out += 1
                reason = (
                    f"the status check of tool {call.name!r} did not answer within "
                    f"{self.config.tool_timeout_s} s (tool_timeout_s); the call may have run, "
                    "so it is not run again"
                )
                self._tool_failure(spec, gid, turn, key, reason, "timeout", started, left)
                return
            self.stats.tool_calls_status_checked += 1
            if result is not None:
                self._tool_result(spec, gid, turn, key, str(result), started, left, "status_check")
                return
            await self._run_tool(spec, gid, turn, key, call, tool, left)  # it never ran
            return
        if tool is not None and (was_idempotent or tool.idempotent):
            await self._run_tool(spec, gid, turn, key, call, tool, left)
            return
        reason = (
            f"tool {call.name!r} was interrupted between its request and its result; it is "
            "neither idempotent nor has a status check, so it is not run a second time"
        )
        self.stats.tool_calls_not_rerun += 1
        self._tool_failure(spec, gid, turn, key, reason, "not_rerun", time.perf_counter(), left)

    async def _run_tool(
        self,
        spec: SiblingSpec,
        gid: int,
        turn: int,
        key: str,
        call: ToolCall,
        tool: Tool | None,
        left: int,
    ) -> None:
        started = time.perf_counter()
        if tool is None:
            self._tool_failure(
                spec, gid, turn, key, f"unknown tool {call.name!r}", "error", started, left
            )
            return
        try:
            result = await self._call_tool(
                lambda: tool(call.arguments, key), inspect.iscoroutinefunction(tool.fn), call.name
            )
        except _Deadline:
            self.stats.tool_calls_run += 1
            self.stats.tool_calls_timed_out += 1
            reason = (
                f"tool {call.name!r} did not answer within {self.config.tool_timeout_s} s "
                "(tool_timeout_s); it may have had effects, so it is not run again"
            )
            self._tool_failure(spec, gid, turn, key, reason, "timeout", started, left)
            return
        except Exception as exc:
            self.stats.tool_calls_run += 1
            self._tool_failure(
                spec, gid, turn, key, f"{type(exc).__name__}: {exc}", "error", started, left
            )
            return
        self.stats.tool_calls_run += 1
        self._tool_result(spec, gid, turn, key, str(result), started, left, "call")

    async def _call_tool(self, fn: Callable[[], Any], is_async: bool, name: str) -> Any:
        """Run ``fn`` (a tool call or status check); with ``tool_timeout_s``, raise
        :class:`_Deadline` past it."""
        return await self._call_by_deadline(
            fn, is_async, f"tool-{name}", self.config.tool_timeout_s
        )

    async def _call_by_deadline(
        self, fn: Callable[[], Any], is_async: bool, name: str, timeout: float | None
    ) -> Any:
        """Run ``fn`` (user code: a tool, a status check, an environment's call); with a
        ``timeout``, raise :class:`_Deadline` past it."""
        if timeout is None:
            result = fn()
            return await result if inspect.isawaitable(result) else result
        if is_async:
            return await self._by_deadline(asyncio.ensure_future(fn()), timeout)
        # A synchronous tool cannot be interrupted: it runs in a daemon thread, so one that
        # hangs neither blocks the loop nor keeps the process alive at exit.
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def settle(value: Any, error: BaseException | None) -> None:
            if done.done():  # abandoned at the deadline: the late result is dropped
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(value)

        def run() -> None:
            value, error = None, None
            try:
                value = fn()
            except BaseException as exc:  # handed to the awaiting coroutine
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop closed: no one waits
                loop.call_soon_threadsafe(settle, value, error)

        threading.Thread(target=run, name=f"rolloutlog-{name}", daemon=True).start()
        result = await self._by_deadline(done, timeout)
        if inspect.isawaitable(result):  # a wrapper that returned a coroutine
            result = await self._by_deadline(asyncio.ensure_future(result), timeout)
        return result

    @staticmethod
    async def _by_deadline(running: asyncio.Future[Any], timeout: float) -> Any:
        """``running``'s result, or :class:`_Deadline` (``running`` cancelled) past
        ``timeout`` (a TimeoutError the call raises itself stays an error)."""
        try:
            done, _ = await asyncio.wait({running}, timeout=timeout)
        except BaseException:  # this coroutine was cancelled: so is the tool
            running.cancel()
            raise
        if not done:
            running.cancel()
            await asyncio.wait({running}, timeout=timeout)  # let it unwind, within a deadline
            raise _Deadline
        return running.result()

    def _encode(self, text: str) -> list[int]:
        """``text``'s token ids as plain ints (what the payload holds once read back)."""
        return [int(t) for t in self.tokenizer.encode(text)]

    def _observation(
        self, spec: SiblingSpec, gid: int, turn: int, key: str, text: str, left: int
    ) -> tuple[list[int], _Payload]:
        ids = (self._encode(text) or self._encode(" "))[: max(1, left)]
        pid = self._payload_id(spec, gid, f"t{turn}-c{key.rsplit('/c', 1)[-1]}")
        return ids, _payload(pid, "observation", {"token_ids": ids})

    def _tool_result(
        self,
        spec: SiblingSpec,
        gid: int,
        turn: int,
        key: str,
        result: str,
        started: float,
        left: int,
        source: Any,
    ) -> None:
        ids, put = self._observation(spec, gid, turn, key, result, left)
        self._record(
            ToolCallCompleted(
                group_id=gid,
                sibling=spec.sibling,
                attempt=spec.attempt,
                turn=turn,
                idempotency_key=key,
                result=result,
                seconds=time.perf_counter() - started,
                observation_tokens=len(ids),
                payload_id=put[0].payload_id,
                source=source,
            ),
            put,
        )

    def _tool_failure(
        self,
        spec: SiblingSpec,
        gid: int,
        turn: int,
        key: str,
        reason: str,
        outcome: Any,
        started: float,
        left: int,
    ) -> None:
        ids, put = self._observation(spec, gid, turn, key, f"error: {reason}", left)
        self._record(
            ToolCallFailed(
                group_id=gid,
                sibling=spec.sibling,
                attempt=spec.attempt,
                turn=turn,
                idempotency_key=key,
                reason=reason,
                outcome=outcome,
                seconds=time.perf_counter() - started,
                observation_tokens=len(ids),
                payload_id=put[0].payload_id,
            ),
            put,
        )

    def _complete(
        self,
        request: GroupRequest,
        spec: SiblingSpec,
        traj: TrajectoryState,
        reward: float | None,
        dispatched: int,
        finish: Any,
    ) -> SiblingResult:
        if reward is None:
            reward = traj.last_reward
        arrays = self._flatten(traj)
        pid = self._payload_id(spec, request.group_id, "trajectory")
        versions = [s.weight_version for s in traj.segments if s.weight_version is not None]
        traj = self._record(
            TrajectoryCompleted(
                group_id=request.group_id,
                sibling=spec.sibling,
                attempt=spec.attempt,
                turns=traj.turns,
                final_reward=reward,
                model_tokens=sum(arrays["loss_mask"]),
                observation_tokens=len(arrays["loss_mask"]) - sum(arrays["loss_mask"]),
                payload_id=pid,
                oldest_weight_version=min(versions),
                newest_weight_version=max(versions),
                finish=finish,
            ),
            _payload(pid, "trajectory", arrays),
        )
        self.stats.trajectories_completed += 1
        return self._result_of(request, spec, traj, dispatched, reward, arrays)

    def _flatten(self, traj: TrajectoryState) -> dict[str, list[Any]]:
        ids: list[int] = []
        logprobs: list[float] = []
        for seg in traj.segments:
            if not seg.tokens or seg.payload_id is None:
                continue
            arrays = self._tokens(seg.payload_id, (traj.group_id, traj.sibling))
            ids.extend(arrays["token_ids"])
            if seg.kind == "model":
                logprobs.extend(arrays["logprobs"])
            else:
                logprobs.extend([0.0] * seg.tokens)
        return {
            "token_ids": ids,
            "logprobs": logprobs,
            "loss_mask": traj.loss_mask(),
            "weight_versions": traj.token_versions(),
        }

    def _result_of(
        self,
        request: GroupRequest,
        spec: SiblingSpec,
        traj: TrajectoryState,
        dispatched: int,
        reward: float | None,
        arrays: dict[str, list[Any]] | None = None,
    ) -> SiblingResult:
        """The sibling's result (``arrays``: the trajectory flattened, if at hand)."""
        if arrays is None:
            arrays = self._flatten(traj)
        versions = [s.weight_version for s in traj.segments if s.weight_version is not None]
        ids = tuple(arrays["token_ids"])
        final = traj.final_reward if reward is None else reward
        if final is not None:
            self._pending[(request.group_id, spec.sibling, spec.attempt)] = final
        return SiblingResult(
            group_id=request.group_id,
            sibling=spec.sibling,
            attempt=spec.attempt,
            # The sibling's version: the newest weights it holds tokens of, kept within the
            # dispatch's and the trainer's (a restore may have rolled the trainer back
            # below turns it reuses); the exact per-token versions are in
            # TrajectoryCompleted's payload.
            weight_version=min(
                max([dispatched, *versions]),
                max(dispatched, self.controller.state.weight_version),
            ),
            token_ids=ids,
            logprobs=tuple(arrays["logprobs"]),
            finish_reason="length" if len(ids) >= request.sampling.max_tokens else "stop",
        )

    def sample_masks(self, batch: Batch) -> list[tuple[list[int], list[int]]]:
        """For each sample of ``batch`` (in order): its loss mask (1 model token, 0 tool or
        environment token) and the weight version of each token (-1: not a model token),
        from its trajectory. The runtime's samples carry the token ids and logprobs; a
        trainer multiplies its loss by this mask. Call it before ``report_trained`` (a
        trained group's trajectories are forgotten)."""
        out = []
        for sample in batch.samples:
            traj = self.book.get((sample.group_id, sample.sibling))
            if traj is None or not traj.completed:
                raise BackendError(
                    f"group {sample.group_id} sibling {sample.sibling} has no completed "
                    "trajectory in this backend's book",
                    retryable=False,
                )
            mask, versions = traj.loss_mask(), traj.token_versions()
            if len(mask) != len(sample.completion_token_ids):
                raise BackendError(
                    f"group {sample.group_id} sibling {sample.sibling}: the trajectory holds "
                    f"{len(mask)} response tokens, the sample {len(sample.completion_token_ids)}",
                    retryable=False,
                )
            out.append((mask, versions))
        return out

    def trajectory_reward(self, prompt: Sequence[int], response: Sequence[int]) -> float | None:
        """The final reward recorded for this prompt and response, handed out once per
        result (None: not a trajectory this backend finished, or one without a reward)."""
        key = (tuple(prompt), tuple(response))
        stack = self._rewards.get(key)
        if not stack:
            return None
        reward = stack.pop()
        if not stack:
            del self._rewards[key]
        return reward


class MultiTurnPrompts:
    """A :class:`~rolloutlog.controller.rollout_runtime.PromptSource` whose reward is the
    trajectory's final reward (the environment's ``get_reward``, or its last step's
    reward), falling back to ``prompts``' own reward for a trajectory without one."""

    def __init__(self, prompts: PromptSource, backend: TrajectoryBackend) -> None:
        self.prompts = prompts
        self.backend = backend

    @property
    def fingerprint(self) -> str:
        return self.prompts.fingerprint

    @property
    def num_prompts(self) -> int:
        return self.prompts.num_prompts

    def prompt_token_ids(self, index: int) -> list[int]:
        return self.prompts.prompt_token_ids(index)

    def reward(self, index: int, completion_token_ids: Sequence[int]) -> float:
        prompt = tuple(int(t) for t in self.prompts.prompt_token_ids(index))
        found = self.backend.trajectory_reward(prompt, completion_token_ids)
        if found is not None:
            return found
        return self.prompts.reward(index, completion_token_ids)

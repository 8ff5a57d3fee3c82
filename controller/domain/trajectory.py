"""Trajectories: a sibling as a sequence of turns (multi-turn, agentic rollouts). Pure.

A multi-turn sibling is a **trajectory**: its context starts as the prompt's token ids
(plus the environment's first observation, if any) and grows by appending token ids,
turn by turn. A **turn** is one model call (its output tokens, loss mask 1) and what
answers it: the results of the tool calls the output asked for and/or one environment
step (their tokens, loss mask 0). Every append is an event; token arrays are payloads
(``eventstore/payloads.py``), referenced by id:

- :class:`TrajectoryStarted` the context before turn 0 (prompt + first observation);
- :class:`ModelCallCompleted` turn ``t``'s model output (token ids and logprobs by
  payload, the weights and engine that generated it, and the context length it read);
- :class:`ToolCallRequested` made durable *before* the tool runs (tool, arguments,
  idempotency key, whether the tool is idempotent or has a status check);
- :class:`ToolCallCompleted` / :class:`ToolCallFailed` the result, its tokens and seconds;
- :class:`EnvironmentStepped` the environment's observation, reward and done flag;
- :class:`TrajectoryCompleted` the final reward and the flattened trajectory (token ids,
  logprobs, per-token loss mask, per-token weight version) as one payload;
- :class:`TrajectoryResumed` a new attempt took over an unfinished trajectory after a
  restore or a retry: what it reused and how it resolved tool calls left open;
- :class:`LateResultRefused` a model output or tool result of a superseded attempt
  arrived and was refused (recorded, never merged);
- :class:`TrajectoryTooStale` the trajectory's model calls span (or its next model call
  would make them span) more weight versions than the :class:`StalenessPolicy` allows,
  and what the policy did: kept it, abandoned it whole (the sibling attempt is aborted
  and the next one starts anew), or abandoned the turns after turn ``k``
  (:func:`decide_staleness` makes the event; :func:`decide_turn` checks it).

Logs written before these events existed hold none: they replay unchanged (every
sibling a single-turn completion), so there is nothing to upcast; a later schema of one
of these events registers its upcaster beside it, as ``SiblingFailed`` does.

The run state (:mod:`.state`) is about groups; these events leave it untouched (their
evolvers on it are no-ops). What a trajectory holds is the fold of its events into a
:class:`TrajectoryState`, kept by whoever drives the turns in a :data:`TrajectoryBook`
(:func:`evolve_trajectory`), and checked by :func:`decide_turn`, which the decider
routes the :class:`RecordTurn` command to. Fencing uses both: the run state's live
attempt of the sibling, and the trajectory's owner ``(epoch, attempt)`` (attempt
numbers restart from the checkpoint's after a restore, so an attempt alone does not
name an owner across epochs).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from .errors import IllegalTransitionError, StaleAttemptError
from .events import CODEC, AuditKeys, RolloutEvent
from .state import RunState, SiblingStatus

# ---------------------------------------------------------------------- events


class TurnEvent(RolloutEvent):
    """Base of the trajectory events: which sibling attempt wrote it."""

    group_id: int
    sibling: int
    attempt: int

    def audit_keys(self) -> AuditKeys:
        return AuditKeys(group_id=self.group_id)


@CODEC.register
class TrajectoryStarted(TurnEvent):
    """A trajectory of prompt ``(data_pass, prompt_index)`` began: its context is the
    prompt's ``prompt_tokens`` token ids, then the environment's first observation
    (``observation_tokens`` token ids, the payload ``payload_id``; none when the
    environment's ``reset`` returned nothing).

    A group id names the same prompt in every branch of the log that admitted it from
    the same state; where an abandoned branch used the id for another prompt, a new
    start supersedes that branch's trajectory of the id.
    """

    event_type = "TrajectoryStarted"
    prompt_index: int
    data_pass: int = 0  # the pass over the data (``pass`` is a keyword)
    prompt_tokens: int
    observation: str | None = None
    observation_tokens: int = 0
    payload_id: str | None = None

    def audit_keys(self) -> AuditKeys:
        return AuditKeys(group_id=self.group_id, prompt_index=self.prompt_index)


@CODEC.register
class ModelCallCompleted(TurnEvent):
    """Turn ``turn``'s model call finished. Its input is the trajectory's context, the
    first ``context_tokens`` token ids (by reference: the prompt and the payloads of the
    earlier turns); its output token ids and logprobs are the payload ``payload_id``."""

    event_type = "ModelCallCompleted"
    turn: int
    context_tokens: int
    output_tokens: int
    weight_version: int
    payload_id: str
    finish_reason: str
    engine_id: str | None = None
    #: Why each earlier try of this model call (same turn, same attempt) failed
    #: retryably, in order: its engine was lost or unreachable, and the call was sent
    #: again (to another engine); nothing of a failed try entered the trajectory. Empty
    #: in logs written before retries existed (the default decodes them unchanged).
    failed_tries: tuple[str, ...] = ()


@CODEC.register
class ToolCallRequested(TurnEvent):
    """The model output of ``turn`` asked for a tool call; durable before the tool runs.

    ``idempotency_key`` names the call across attempts and restores. ``idempotent``: the
    tool may run again with the same effect; ``status_check``: the tool can be asked by
    key whether (and with what result) the call ran. A call that is neither is never
    run a second time.
    """

    event_type = "ToolCallRequested"
    turn: int
    call: int  # its index among the turn's tool calls
    tool: str
    arguments: dict[str, Any]
    idempotency_key: str
    idempotent: bool
    status_check: bool


#: How a tool call's result was obtained: the call itself, or the tool's status check
#: by idempotency key (after a crash between request and result).
ToolResultSource = Literal["call", "status_check"]


@CODEC.register
class ToolCallCompleted(TurnEvent):
    """A requested tool call returned ``result``; its text entered the context once, as
    ``observation_tokens`` token ids (the payload ``payload_id``)."""

    event_type = "ToolCallCompleted"
    turn: int
    idempotency_key: str
    result: str
    seconds: float
    observation_tokens: int
    payload_id: str
    source: ToolResultSource = "call"


#: Why a tool call has no result: it raised, it was interrupted and may not run again
#: (neither idempotent nor able to answer a status check), or it did not answer within
#: its deadline (it may have had effects: not run again either).
ToolFailure = Literal["error", "not_rerun", "timeout"]


@CODEC.register
class ToolCallFailed(TurnEvent):
    """A requested tool call failed; the error text entered the context as the call's
    observation (``observation_tokens`` token ids, the payload ``payload_id``)."""

    event_type = "ToolCallFailed"
    turn: int
    idempotency_key: str
    reason: str
    outcome: ToolFailure
    seconds: float
    observation_tokens: int
    payload_id: str


@CODEC.register
class EnvironmentStepped(TurnEvent):
    """The environment answered turn ``turn``: an observation (its ``observation_tokens``
    token ids are the payload ``payload_id``), a reward and whether the episode is done."""

    event_type = "EnvironmentStepped"
    turn: int
    observation: str | None
    observation_tokens: int
    payload_id: str | None
    reward: float | None
    done: bool


@CODEC.register
class TrajectoryCompleted(TurnEvent):
    """The trajectory ended after ``turns`` model calls with ``final_reward``.

    The payload ``payload_id`` holds the flattened response (everything after the prompt):
    ``token_ids``, ``logprobs`` (0 for tool and environment tokens), ``loss_mask`` (1 for
    model tokens, 0 for tool and environment tokens) and ``weight_versions`` (the weights
    of every model token; -1 for the others).
    """

    event_type = "TrajectoryCompleted"
    turns: int
    #: The environment's reward (``get_reward``, else its last step's); None when it gives
    #: none: the run's reward function scores the response (``SiblingCompleted.reward``).
    final_reward: float | None
    model_tokens: int
    observation_tokens: int
    payload_id: str
    oldest_weight_version: int
    newest_weight_version: int
    finish: Literal["done", "no_tool_call", "max_turns", "context_full"]


@CODEC.register
class TrajectoryResumed(TurnEvent):
    """Attempt ``attempt`` took over the trajectory from ``(from_epoch, from_attempt)``.

    A completed trajectory is taken over whole (its result handed in again, nothing
    run). Otherwise it reuses every durable turn: ``model_calls_reused`` model calls (the turns
    salvaged: never regenerated) and ``tool_results_reused`` recorded tool results (fed
    back, never run again). ``tool_calls_open`` calls were requested without a result;
    the new attempt resolves each (status check, an idempotent re-run, or a recorded
    refusal to run a non-idempotent one twice) with its own ``ToolCallCompleted`` /
    ``ToolCallFailed``.
    """

    event_type = "TrajectoryResumed"
    from_epoch: int
    from_attempt: int
    model_calls_reused: int
    tool_results_reused: int
    tool_calls_open: int


#: What a late result was: a model output, a tool result, an environment step.
LateKind = Literal["model_call", "tool_call", "environment_step"]


@CODEC.register
class LateResultRefused(TurnEvent):
    """A result of superseded attempt ``attempt`` arrived after ``current_attempt`` took
    over the sibling; it was refused (nothing of it entered the trajectory)."""

    event_type = "LateResultRefused"
    turn: int
    kind: LateKind
    current_attempt: int
    reason: str


#: What a staleness policy does with a trajectory that spans too many weight versions.
StalenessAction = Literal["keep", "abort", "restart"]
#: What it did: ``restart`` falls back to ``aborted`` when the turns it would keep (with
#: the next model call's version) still span too many versions.
StalenessOutcome = Literal["kept", "aborted", "restarted"]


@CODEC.register
class TrajectoryTooStale(TurnEvent):
    """The trajectory spans more than ``max_weight_versions`` weight versions: the
    distinct ``versions`` of its model calls, with ``next_version`` (the engine's version
    for the next model call) when the decision came before that call. ``policy`` is the
    configured action, ``outcome`` what it did:

    - ``kept``: nothing changes (the per-token versions say what each turn used);
    - ``aborted``: every turn is abandoned (never fed back, never reused); the sibling
      attempt is aborted and its next attempt starts a new trajectory;
    - ``restarted``: the first ``turns_kept`` turns stay (``restart_after_turn`` + 1 of
      them at most), the later ``turns_abandoned`` ones are abandoned, and the same
      attempt goes on from the end of the last kept turn.

    ``tool_calls_abandoned`` tool calls of abandoned turns stay recorded as run; they
    are never run again nor fed back (the new turns' calls have new idempotency keys).
    """

    event_type = "TrajectoryTooStale"
    versions: list[int]
    next_version: int | None
    max_weight_versions: int
    policy: StalenessAction
    restart_after_turn: int | None = None
    outcome: StalenessOutcome
    turns_kept: int
    turns_abandoned: int
    tool_calls_abandoned: int
    reason: str


#: Every trajectory event type.
TURN_EVENTS: tuple[type[TurnEvent], ...] = (
    TrajectoryStarted,
    ModelCallCompleted,
    ToolCallRequested,
    ToolCallCompleted,
    ToolCallFailed,
    EnvironmentStepped,
    TrajectoryCompleted,
    TrajectoryResumed,
    LateResultRefused,
    TrajectoryTooStale,
)
TURN_EVENT_TYPES: frozenset[str] = frozenset(cls.event_type for cls in TURN_EVENTS)


# ---------------------------------------------------------------------- state

#: What a span of the context is: the start (prompt's first observation), a model
#: output, a tool result, an environment observation.
SegmentKind = Literal["start", "model", "tool", "environment"]


@dataclass(frozen=True, slots=True)
class Segment:
    """A span of the trajectory's context after the prompt, in order."""

    kind: SegmentKind
    turn: int
    tokens: int
    payload_id: str | None
    weight_version: int | None = None  # model spans only


@dataclass(frozen=True, slots=True)
class ToolCallState:
    """One tool call of the trajectory."""

    idempotency_key: str
    turn: int
    call: int
    tool: str
    arguments: dict[str, Any]
    idempotent: bool
    status_check: bool
    status: Literal["requested", "completed", "failed"] = "requested"
    result: str | None = None


Owner = tuple[int, int]  # (epoch, attempt) of the attempt that writes the trajectory


@dataclass(frozen=True, slots=True)
class TrajectoryState:
    """One sibling's trajectory: the fold of its turn events."""

    group_id: int
    sibling: int
    owner: Owner
    prompt: tuple[int, int]  # (data_pass, prompt_index)
    prompt_tokens: int
    segments: tuple[Segment, ...] = ()
    tool_calls: tuple[ToolCallState, ...] = ()
    turns: int = 0  # model calls completed
    stepped: bool = False  # the environment answered the newest turn
    done: bool = False  # the environment said the episode is over
    last_reward: float | None = None
    completed: bool = False
    final_reward: float | None = None
    resumes: int = 0
    late_refused: int = 0
    #: The environment's steps in order: (turn, reward, done).
    steps: tuple[tuple[int, float | None, bool], ...] = ()
    #: The staleness policy kept it though it spans too many weight versions (recorded).
    stale_kept: bool = False
    #: Every turn was abandoned (staleness policy ``abort``): the next attempt starts anew.
    abandoned: bool = False
    #: Times turns of this sibling's trajectory were abandoned (aborts and restarts,
    #: carried to the trajectory that starts anew): new turns' idempotency keys and
    #: payload ids carry it, so they never name an abandoned turn's.
    restarts: int = 0

    @property
    def context_tokens(self) -> int:
        """Token ids in the context: the prompt and every segment."""
        return self.prompt_tokens + sum(s.tokens for s in self.segments)

    def open_tool_calls(self) -> tuple[ToolCallState, ...]:
        """Tool calls requested without a result yet."""
        return tuple(c for c in self.tool_calls if c.status == "requested")

    def tool_call(self, key: str) -> ToolCallState | None:
        """The call with this idempotency key, if requested."""
        for call in self.tool_calls:
            if call.idempotency_key == key:
                return call
        return None

    def turn_calls(self, turn: int) -> tuple[ToolCallState, ...]:
        """The tool calls turn ``turn`` asked for, in call order."""
        return tuple(c for c in self.tool_calls if c.turn == turn)

    def weight_versions(self, before_turn: int | None = None) -> set[int]:
        """The distinct weight versions of the model calls (of turns before ``before_turn``)."""
        return {
            s.weight_version
            for s in self.segments
            if s.kind == "model"
            and s.weight_version is not None
            and (before_turn is None or s.turn < before_turn)
        }

    def loss_mask(self) -> list[int]:
        """One entry per response token (after the prompt): 1 model, 0 tool/environment."""
        out: list[int] = []
        for s in self.segments:  # a segment's run at once: no per-token Python step
            out += [1 if s.kind == "model" else 0] * s.tokens
        return out

    def token_versions(self) -> list[int]:
        """The weight version of each response token (-1: not a model token)."""
        out: list[int] = []
        for s in self.segments:
            v = s.weight_version if s.kind == "model" and s.weight_version is not None else -1
            out += [v] * s.tokens
        return out


_TRAJECTORY_FIELDS = tuple(f.name for f in fields(TrajectoryState))


def _with(traj: TrajectoryState, **changes: Any) -> TrajectoryState:
    """``dataclasses.replace`` of a trajectory, without its per-field checks: a turn
    folds several of these, and ``replace`` costs several times this (every field of
    :class:`TrajectoryState` is an ``__init__`` field, with no ``__post_init__``)."""
    out = TrajectoryState(
        *[changes.pop(n) if n in changes else getattr(traj, n) for n in _TRAJECTORY_FIELDS]
    )
    if changes:
        raise TypeError(f"TrajectoryState has no field(s) {sorted(changes)}")
    return out


#: The trajectories of a run by ``(group_id, sibling)``.
TrajectoryBook = dict[tuple[int, int], TrajectoryState]


# ---------------------------------------------------------------------- decide


@dataclass(frozen=True, slots=True)
class StalenessPolicy:
    """How many weight versions one trajectory may span, and what happens past that.

    ``max_weight_versions`` None: unbounded (every trajectory kept). ``action``: ``keep``
    (recorded), ``abort`` (abandon every turn; the sibling attempt is aborted and the next
    one starts anew) or ``restart`` (keep turns ``0..restart_after_turn``, abandon the
    later ones, go on under the current weights; aborted when the kept turns with the
    next call's version would still span too many)."""

    max_weight_versions: int | None = None
    action: StalenessAction = "keep"
    restart_after_turn: int = 0


def decide_staleness(
    traj: TrajectoryState, policy: StalenessPolicy, attempt: int, next_version: int | None
) -> TrajectoryTooStale | None:
    """The :class:`TrajectoryTooStale` to record for ``traj`` (written by ``attempt``), or
    None when it is within the policy's bound (or nothing more is to be recorded).

    ``next_version``: the engine's weight version for the trajectory's next model call,
    when deciding before that call (then ``keep`` records nothing: it is recorded on the
    versions the calls did use); None: deciding on the recorded model calls, after one.
    ``keep`` is recorded once per trajectory."""
    bound = policy.max_weight_versions
    if bound is None or traj.completed or traj.abandoned:
        return None
    recorded = traj.weight_versions()
    span = recorded | ({next_version} if next_version is not None else set())
    if len(span) <= bound:
        return None
    action = policy.action
    outcome: StalenessOutcome
    versions = sorted(span)
    said = f"the trajectory spans weight versions {versions}"
    if next_version is not None:
        said += f" with its next model call's {next_version}"
    said += f", more than max_weight_versions {bound}"
    if action == "keep":
        if next_version is not None or traj.stale_kept:
            return None
        outcome, kept, reason = "kept", traj.turns, f"{said}: kept (policy keep)"
    elif action == "restart":
        kept = min(policy.restart_after_turn + 1, traj.turns)
        target = next_version if next_version is not None else max(recorded)
        fits = len(traj.weight_versions(kept) | {target}) <= bound
        if kept < traj.turns and fits:
            outcome = "restarted"
            reason = (
                f"{said}: turns {kept}..{traj.turns - 1} abandoned, going on after turn "
                f"{kept - 1} (policy restart, restart_after_turn {policy.restart_after_turn})"
            )
        else:
            why = (
                "there are no turns after it to abandon"
                if kept >= traj.turns
                else f"turns 0..{kept - 1} with version {target} would still span more"
            )
            outcome, kept = "aborted", 0
            reason = (
                f"{said}: aborted (policy restart after turn {policy.restart_after_turn} "
                f"cannot bound it: {why})"
            )
    else:
        outcome, kept, reason = "aborted", 0, f"{said}: aborted (policy abort)"
    return TrajectoryTooStale(
        group_id=traj.group_id,
        sibling=traj.sibling,
        attempt=attempt,
        versions=versions,
        next_version=next_version,
        max_weight_versions=bound,
        policy=action,
        restart_after_turn=policy.restart_after_turn if action == "restart" else None,
        outcome=outcome,
        turns_kept=kept,
        turns_abandoned=traj.turns - kept,
        tool_calls_abandoned=sum(1 for c in traj.tool_calls if c.turn >= kept),
        reason=reason,
    )


@dataclass(frozen=True, slots=True)
class RecordTurn:
    """Record a trajectory event.

    ``trajectory`` is the caller's fold of the sibling's earlier turn events (None
    before :class:`TrajectoryStarted`): the run state holds groups, not turns, so the
    command brings the trajectory it extends, and the decision is a pure function of
    both.
    """

    event: TurnEvent
    trajectory: TrajectoryState | None


def _live_attempt(state: RunState, group_id: int, sibling: int) -> int | None:
    """The sibling's live (in-flight) attempt, or None when it has none."""
    group = state.groups.get(group_id)
    if group is None or not 0 <= sibling < group.size:
        return None
    sib = group.sibling(sibling)
    return sib.attempt if sib.status is SiblingStatus.IN_FLIGHT else None


def decide_turn(state: RunState, cmd: RecordTurn) -> list[RolloutEvent]:
    """``[cmd.event]`` if it may extend ``cmd.trajectory``, else a domain error naming
    the rule: the attempt must be the sibling's live one and own the trajectory; turns
    are consecutive; a tool result answers an open request; nothing follows completion.
    A :class:`StaleAttemptError` means a late result (record a :class:`LateResultRefused`).
    """
    ev, traj = cmd.event, cmd.trajectory
    who = f"group {ev.group_id} sibling {ev.sibling}"
    if traj is not None and (traj.group_id, traj.sibling) != (ev.group_id, ev.sibling):
        raise IllegalTransitionError(
            f"{who}: event given the trajectory of group {traj.group_id} sibling {traj.sibling}"
        )
    live = _live_attempt(state, ev.group_id, ev.sibling)
    if isinstance(ev, LateResultRefused):
        if live is not None and ev.attempt == live:
            raise IllegalTransitionError(
                f"{who}: attempt {ev.attempt} is the live attempt; its result is not late"
            )
        return [ev]
    if live is None or ev.attempt != live:
        raise StaleAttemptError(
            f"{who}: attempt {ev.attempt} is not the live attempt "
            f"({'none in flight' if live is None else f'attempt {live}'}); "
            f"its {ev.event_type} is refused"
        )
    owner = (state.epoch, ev.attempt)
    if isinstance(ev, TrajectoryStarted):
        group = state.groups[ev.group_id]
        if (ev.data_pass, ev.prompt_index) != (group.data_pass, group.prompt_index):
            raise IllegalTransitionError(
                f"{who}: trajectory of prompt {ev.prompt_index} (pass {ev.data_pass}), but the "
                f"group holds prompt {group.prompt_index} (pass {group.data_pass})"
            )
        if (
            traj is not None
            and traj.prompt == (ev.data_pass, ev.prompt_index)
            and not traj.abandoned
        ):
            raise IllegalTransitionError(f"{who}: the trajectory has started already")
        if ev.prompt_tokens < 1 or ev.observation_tokens < 0:
            raise IllegalTransitionError(f"{who}: a trajectory starts from a non-empty prompt")
        if (ev.observation_tokens > 0) != (ev.payload_id is not None):
            raise IllegalTransitionError(f"{who}: observation tokens need their payload")
        return [ev]
    if traj is None:
        raise IllegalTransitionError(f"{who}: {ev.event_type} before TrajectoryStarted")
    if traj.abandoned:
        raise IllegalTransitionError(
            f"{who}: the trajectory was abandoned (too stale); a new one starts"
        )
    if traj.completed and not isinstance(ev, TrajectoryResumed):
        raise IllegalTransitionError(f"{who}: the trajectory is completed; nothing follows")
    if isinstance(ev, TrajectoryResumed):
        if traj.owner >= owner:
            raise IllegalTransitionError(
                f"{who}: attempt {owner} cannot take over the trajectory of attempt {traj.owner}"
            )
        if (ev.from_epoch, ev.from_attempt) != traj.owner:
            raise IllegalTransitionError(
                f"{who}: resumed from {(ev.from_epoch, ev.from_attempt)}, "
                f"but the trajectory belongs to {traj.owner}"
            )
        if ev.model_calls_reused != traj.turns or ev.tool_calls_open != len(traj.open_tool_calls()):
            raise IllegalTransitionError(f"{who}: the resume's counts differ from the trajectory")
        return [ev]
    if traj.owner != owner:
        raise StaleAttemptError(
            f"{who}: attempt {owner} does not own the trajectory (owner {traj.owner}); "
            "resume it first"
        )
    if isinstance(ev, ModelCallCompleted):
        _check_model_call(traj, ev, who)
        if ev.weight_version > state.weight_version:
            raise IllegalTransitionError(
                f"{who}: model call by weight version {ev.weight_version}, but the trainer is "
                f"at {state.weight_version}"
            )
    elif isinstance(ev, ToolCallRequested):
        _check_tool_request(traj, ev, who)
    elif isinstance(ev, ToolCallCompleted | ToolCallFailed):
        call = traj.tool_call(ev.idempotency_key)
        if call is None or call.turn != ev.turn:
            raise IllegalTransitionError(
                f"{who}: no tool call {ev.idempotency_key!r} was requested in turn {ev.turn}"
            )
        if call.status != "requested":
            raise IllegalTransitionError(
                f"{who}: tool call {ev.idempotency_key!r} is {call.status} already"
            )
        if ev.observation_tokens < 1:
            raise IllegalTransitionError(f"{who}: a tool result enters the context as tokens")
    elif isinstance(ev, EnvironmentStepped):
        if traj.turns < 1 or ev.turn != traj.turns - 1:
            raise IllegalTransitionError(
                f"{who}: environment step for turn {ev.turn}, the newest turn is {traj.turns - 1}"
            )
        if traj.stepped or traj.open_tool_calls():
            raise IllegalTransitionError(
                f"{who}: turn {ev.turn} has open tool calls or a step already"
            )
        if (ev.observation_tokens > 0) != (ev.payload_id is not None):
            raise IllegalTransitionError(f"{who}: observation tokens need their payload")
    elif isinstance(ev, TrajectoryCompleted):
        _check_completion(traj, ev, who)
    elif isinstance(ev, TrajectoryTooStale):
        _check_staleness(traj, ev, who)
    else:  # pragma: no cover - every TurnEvent is handled above
        raise TypeError(f"unknown trajectory event {type(ev).__name__}")
    return [ev]


def _check_model_call(traj: TrajectoryState, ev: ModelCallCompleted, who: str) -> None:
    if ev.turn != traj.turns:
        raise IllegalTransitionError(
            f"{who}: model call of turn {ev.turn}, the next turn is {traj.turns}"
        )
    if traj.open_tool_calls():
        raise IllegalTransitionError(f"{who}: turn {ev.turn} starts with tool calls still open")
    if traj.done:
        raise IllegalTransitionError(f"{who}: the environment ended the episode")
    if ev.context_tokens != traj.context_tokens:
        raise IllegalTransitionError(
            f"{who}: model call read {ev.context_tokens} context tokens, the trajectory "
            f"holds {traj.context_tokens}"
        )
    if ev.output_tokens < 1 or ev.weight_version < 0:
        raise IllegalTransitionError(f"{who}: a model call generates at least one token")


def _check_tool_request(traj: TrajectoryState, ev: ToolCallRequested, who: str) -> None:
    if traj.turns < 1 or ev.turn != traj.turns - 1:
        raise IllegalTransitionError(
            f"{who}: tool call for turn {ev.turn}, the newest turn is {traj.turns - 1}"
        )
    if traj.stepped:
        raise IllegalTransitionError(f"{who}: turn {ev.turn} was answered by the environment")
    if traj.tool_call(ev.idempotency_key) is not None:
        raise IllegalTransitionError(
            f"{who}: tool call {ev.idempotency_key!r} was requested already"
        )
    if ev.call != len(traj.turn_calls(ev.turn)):
        raise IllegalTransitionError(f"{who}: tool call {ev.call} of turn {ev.turn} out of order")


def _check_completion(traj: TrajectoryState, ev: TrajectoryCompleted, who: str) -> None:
    if traj.turns < 1 or ev.turns != traj.turns:
        raise IllegalTransitionError(
            f"{who}: completion after {ev.turns} turns, the trajectory has {traj.turns}"
        )
    if traj.open_tool_calls():
        raise IllegalTransitionError(f"{who}: the trajectory has tool calls still open")
    model = sum(s.tokens for s in traj.segments if s.kind == "model")
    other = sum(s.tokens for s in traj.segments if s.kind != "model")
    if (ev.model_tokens, ev.observation_tokens) != (model, other):
        raise IllegalTransitionError(
            f"{who}: completion counts {ev.model_tokens} model and {ev.observation_tokens} "
            f"other tokens, the trajectory holds {model} and {other}"
        )
    versions = [s.weight_version for s in traj.segments if s.weight_version is not None]
    if (ev.oldest_weight_version, ev.newest_weight_version) != (min(versions), max(versions)):
        raise IllegalTransitionError(f"{who}: completion's weight versions differ from its turns")


def _check_staleness(traj: TrajectoryState, ev: TrajectoryTooStale, who: str) -> None:
    if ev.max_weight_versions < 1 or (
        ev.restart_after_turn is not None and ev.restart_after_turn < 0
    ):
        raise IllegalTransitionError(f"{who}: a staleness policy keeps at least one version")
    if traj.open_tool_calls():
        raise IllegalTransitionError(f"{who}: staleness decided with tool calls still open")
    policy = StalenessPolicy(ev.max_weight_versions, ev.policy, ev.restart_after_turn or 0)
    if (ev.policy == "restart") != (ev.restart_after_turn is not None):
        raise IllegalTransitionError(f"{who}: restart_after_turn belongs to policy restart")
    expected = decide_staleness(traj, policy, ev.attempt, ev.next_version)
    if expected is None:
        raise IllegalTransitionError(
            f"{who}: the trajectory spans {sorted(traj.weight_versions())} (next "
            f"{ev.next_version}): within {ev.max_weight_versions} versions, or kept already"
        )
    if expected.model_copy(update={"reason": ev.reason}) != ev:
        raise IllegalTransitionError(
            f"{who}: staleness decision differs from policy {ev.policy}: expected "
            f"outcome {expected.outcome} keeping {expected.turns_kept} turns, got "
            f"{ev.outcome} keeping {ev.turns_kept}"
        )


# ---------------------------------------------------------------------- evolve


def evolve_trajectory(
    book: TrajectoryBook, event: RolloutEvent, epoch: int
) -> TrajectoryState | None:
    """Apply a trajectory event recorded in ``epoch`` to ``book`` (in place); returns the
    trajectory it changed (None for any other event, which the book ignores)."""
    if not isinstance(event, TurnEvent):
        return None
    key = (event.group_id, event.sibling)
    traj = book.get(key)
    if isinstance(event, TrajectoryStarted):
        # A trajectory started anew after one was abandoned keeps counting restarts.
        restarts = traj.restarts if traj is not None and traj.abandoned else 0
        traj = TrajectoryState(
            group_id=event.group_id,
            sibling=event.sibling,
            owner=(epoch, event.attempt),
            prompt=(event.data_pass, event.prompt_index),
            prompt_tokens=event.prompt_tokens,
            segments=(
                (Segment("start", -1, event.observation_tokens, event.payload_id),)
                if event.observation_tokens
                else ()
            ),
            restarts=restarts,
        )
    elif traj is None:
        return None  # a late refusal before the start, or a foreign event: nothing to fold
    elif isinstance(event, LateResultRefused):
        traj = _with(traj, late_refused=traj.late_refused + 1)
    elif isinstance(event, TrajectoryResumed):
        traj = _with(traj, owner=(epoch, event.attempt), resumes=traj.resumes + 1)
    elif isinstance(event, ModelCallCompleted):
        seg = Segment(
            "model", event.turn, event.output_tokens, event.payload_id, event.weight_version
        )
        traj = _with(traj, segments=(*traj.segments, seg), turns=event.turn + 1, stepped=False)
    elif isinstance(event, ToolCallRequested):
        call = ToolCallState(
            idempotency_key=event.idempotency_key,
            turn=event.turn,
            call=event.call,
            tool=event.tool,
            arguments=dict(event.arguments),
            idempotent=event.idempotent,
            status_check=event.status_check,
        )
        traj = _with(traj, tool_calls=(*traj.tool_calls, call))
    elif isinstance(event, ToolCallCompleted | ToolCallFailed):
        done = isinstance(event, ToolCallCompleted)
        calls = tuple(
            replace(
                c,
                status="completed" if done else "failed",
                result=event.result if isinstance(event, ToolCallCompleted) else event.reason,
            )
            if c.idempotency_key == event.idempotency_key
            else c
            for c in traj.tool_calls
        )
        seg = Segment("tool", event.turn, event.observation_tokens, event.payload_id)
        traj = _with(traj, tool_calls=calls, segments=(*traj.segments, seg))
    elif isinstance(event, EnvironmentStepped):
        segs = traj.segments
        if event.observation_tokens:
            segs = (
                *segs,
                Segment("environment", event.turn, event.observation_tokens, event.payload_id),
            )
        traj = _with(
            traj,
            segments=segs,
            stepped=True,
            done=traj.done or event.done,
            last_reward=event.reward if event.reward is not None else traj.last_reward,
            steps=(*traj.steps, (event.turn, event.reward, event.done)),
        )
    elif isinstance(event, TrajectoryTooStale):
        traj = _evolve_staleness(traj, event)
    elif isinstance(event, TrajectoryCompleted):
        traj = _with(traj, completed=True, final_reward=event.final_reward)
    book[key] = traj
    return traj


def _evolve_staleness(traj: TrajectoryState, event: TrajectoryTooStale) -> TrajectoryState:
    if event.outcome == "kept":
        return _with(traj, stale_kept=True)
    if event.outcome == "aborted":
        return _with(traj, abandoned=True, restarts=traj.restarts + 1)
    # Restarted: the turns from ``kept`` on leave the context (segments, calls, steps).
    kept = event.turns_kept
    steps = tuple(st for st in traj.steps if st[0] < kept)
    rewards = [r for _, r, _ in steps if r is not None]
    return _with(
        traj,
        segments=tuple(s for s in traj.segments if s.turn < kept),
        tool_calls=tuple(c for c in traj.tool_calls if c.turn < kept),
        turns=kept,
        steps=steps,
        stepped=any(st[0] == kept - 1 for st in steps),
        done=any(d for _, _, d in steps),
        last_reward=rewards[-1] if rewards else None,
        restarts=traj.restarts + 1,
    )


def fold_trajectories(
    rows: Iterable[tuple[int, RolloutEvent]], book: TrajectoryBook | None = None
) -> TrajectoryBook:
    """The book of ``(epoch, event)`` pairs in log order (other events are skipped)."""
    out: TrajectoryBook = {} if book is None else book
    for epoch, event in rows:
        evolve_trajectory(out, event, epoch)
    return out


def _untouched(state: RunState, event: TurnEvent) -> None:
    """The run state holds groups, not turns: a trajectory event leaves it as it is."""


#: The run state's evolvers of the trajectory events (all no-ops; see the module).
EVOLVERS = dict.fromkeys(TURN_EVENTS, _untouched)

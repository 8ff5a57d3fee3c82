"""Drivers shared by the rollout-domain tests (imported by the test modules).

Two drivers with one interface (``.state`` and ``.execute(command)``):

- :class:`PureRun` decides and evolves in memory (no store), checking on every command
  that ``decide`` leaves the state untouched;
- a :class:`rolloutlog.controller.rollout_controller.RolloutController` (it has the same two
  members).

The helper functions below drive either one.
"""

from __future__ import annotations

import gc
import platform
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.domain import (
    AbortSibling,
    AdmitStep,
    CompleteSibling,
    Completion,
    DispatchSiblings,
    FailSibling,
    PublishWeights,
    RecordTrainStep,
    SelectBatch,
    StartRun,
    decide,
    evolve,
    initial_state,
)
from rolloutlog.controller.domain.commands import Command
from rolloutlog.controller.domain.errors import (
    BatchNotReadyError,
    DatasetExhaustedError,
    LookaheadExceededError,
)
from rolloutlog.controller.domain.events import RolloutEvent
from rolloutlog.controller.domain.state import GroupState, Phase, RunState, SiblingStatus
from rolloutlog.controller.rollout_controller import (
    RecoveryReport,
    RolloutController,
    iter_history,
    replay,
)
from rolloutlog.controller.workloads.passes import pass_permutation
from rolloutlog.eventstore import EventStore, PayloadPut

Applied = list[tuple[int, RolloutEvent]]


class Driver(Protocol):
    state: RunState

    def execute(self, command: Command) -> Applied: ...


def rules(**overrides: Any) -> RolloutConfig:
    """A small config for tests (every knob can be overridden)."""
    base: dict[str, Any] = {
        "group_size": 2,
        "groups_per_step": 2,
        "sampler": "in_order",
        "staleness_bound": 2,
        "lookahead": 1,
        "spare_pool_size": 1,
        "drop_policy": "replace",
        "attempts_per_sibling": 3,
    }
    base.update(overrides)
    return RolloutConfig(**base)


class PureRun:
    """The pure core alone: ``decide`` then ``evolve`` at consecutive offsets."""

    def __init__(
        self,
        config: RolloutConfig | None = None,
        *,
        dataset_size: int = 40,
        passes: int = 1,
        shuffle_seed: int | None = None,
        **kw: Any,
    ):
        self.state = initial_state()
        self.log: Applied = []
        self.execute(
            StartRun(
                run_id="run",
                rollout=config if config is not None else rules(**kw),
                config_fingerprint="fp",
                dataset_fingerprint="ds",
                dataset_size=dataset_size,
                passes=passes,
                shuffle_seed=shuffle_seed,
            )
        )

    def execute(self, command: Command) -> Applied:
        before = self.state.to_snapshot()
        events = decide(self.state, command)
        assert self.state.to_snapshot() == before, f"decide({command}) mutated the state"
        applied: Applied = []
        for ev in events:
            offset = self.state.last_seq + 1
            evolve(self.state, ev, offset)
            applied.append((offset, ev))
        self.log.extend(applied)
        return applied


# ---------------------------------------------------------------- reading events


def kinds(applied: Iterable[tuple[int, RolloutEvent]]) -> list[str]:
    """The event type names of ``applied``, in order."""
    return [ev.event_type for _, ev in applied]


def only(applied: Iterable[tuple[int, RolloutEvent]], event_type: str) -> list[Any]:
    """The events of one type."""
    return [ev for _, ev in applied if ev.event_type == event_type]


# ---------------------------------------------------------------- driving


def admit(run: Driver) -> Applied:
    """Admit the step at the dispatch cursor."""
    return run.execute(AdmitStep())


def admit_all(run: Driver) -> int:
    """Admit until lookahead or the dataset stops it; return the number of steps admitted."""
    n = 0
    while True:
        try:
            run.execute(AdmitStep())
        except (LookaheadExceededError, DatasetExhaustedError):
            return n
        n += 1


def group(run: Driver, gid: int) -> GroupState:
    return run.state.groups[gid]


def step_groups(run: Driver, step: int) -> list[int]:
    """Live group ids stamped for ``step`` (by id)."""
    return sorted(g.group_id for g in run.state.groups.values() if g.target_step == step)


def dispatch(
    run: Driver, gid: int, siblings: Iterable[int] | None = None, version: int | None = None
) -> Applied:
    """Dispatch ``siblings`` (default: every pending one) with ``version`` (default:
    the published version)."""
    g = group(run, gid)
    sibs = (
        tuple(siblings)
        if siblings is not None
        else tuple(i for i, s in enumerate(g.siblings) if s.status is SiblingStatus.PENDING)
    )
    v = run.state.published_version if version is None else version
    return run.execute(DispatchSiblings(gid, sibs, v))


def complete(
    run: Driver,
    gid: int,
    sibling: int,
    *,
    version: int | None = None,
    attempt: int | None = None,
    tokens: int = 4,
    reward: float = 0.5,
) -> Applied:
    """Complete an in-flight sibling (default: its current attempt and dispatch version)."""
    s = group(run, gid).siblings[sibling]
    command = CompleteSibling(
        Completion(
            group_id=gid,
            sibling=sibling,
            attempt=s.attempt if attempt is None else attempt,
            weight_version=(s.weight_version or 0) if version is None else version,
            prompt_tokens=3,
            completion_tokens=tokens,
            reward=reward,
            payload_id=f"g{gid}-s{sibling}-a{s.attempt}",
            finish_reason="stop",
        )
    )
    if isinstance(run, RolloutController):
        # A controller refuses completions whose payload is not stored: store it with them.
        put = PayloadPut(command.completion.payload_id, "sibling", b"tokens")
        return run.execute(command, payload_puts=(put,))
    return run.execute(command)


def fail(run: Driver, gid: int, sibling: int, *, retryable: bool, reason: str = "boom") -> Applied:
    s = group(run, gid).siblings[sibling]
    return run.execute(FailSibling(gid, sibling, s.attempt, retryable, reason))


def abort(run: Driver, gid: int, sibling: int, reason: str = "test abort") -> Applied:
    s = group(run, gid).siblings[sibling]
    return run.execute(AbortSibling(gid, sibling, s.attempt, reason))


def finish_group(run: Driver, gid: int, *, version: int | None = None) -> Applied:
    """Dispatch every pending sibling, then complete every in-flight one."""
    out: Applied = []
    g = group(run, gid)
    if any(s.status is SiblingStatus.PENDING for s in g.siblings):
        out += dispatch(run, gid, version=version)
    for i, s in enumerate(group(run, gid).siblings):
        if s.status is SiblingStatus.IN_FLIGHT:
            out += complete(run, gid, i, version=version)
    return out


def finish_step(run: Driver, step: int, *, version: int | None = None) -> Applied:
    """Finish every admitted group stamped for ``step``."""
    out: Applied = []
    for gid in step_groups(run, step):
        if group(run, gid).phase is Phase.ADMITTED:
            out += finish_group(run, gid, version=version)
    return out


def train(run: Driver, *, publish: bool = True) -> Applied:
    """Select the next batch, record its train step (next weight version), publish it."""
    step = run.state.train_step
    out = run.execute(SelectBatch(step))
    out += run.execute(RecordTrainStep(step, run.state.weight_version + 1))
    if publish:
        out += run.execute(PublishWeights(run.state.weight_version))
    return out


# ---------------------------------------------------------------- the prompt ledger

#: A prompt's identity: (pass, dataset index).
Prompt = tuple[int, int]


@dataclass
class PromptLedger:
    """An independent fold of the history: each pulled prompt's terminal outcome.

    Deliberately separate from ``evolve``: it knows only which events pull, train, evict
    and drop a prompt, and checks that each prompt has exactly one fate. A prompt is
    ``(pass, index)``; the walk order comes from ``RunStarted`` and the pure
    ``pass_permutation``, not from the domain's state.
    """

    pulled: list[Prompt] = field(default_factory=list)
    group_prompt: dict[int, Prompt] = field(default_factory=dict)
    fate: dict[Prompt, str] = field(default_factory=dict)  # prompt -> trained/evicted/dropped
    trained_at: dict[Prompt, int] = field(default_factory=dict)  # prompt -> train step
    selections: dict[Prompt, list[int]] = field(default_factory=lambda: defaultdict(list))
    batches: dict[int, list[int]] = field(default_factory=dict)
    drop_reasons: dict[Prompt, str] = field(default_factory=dict)
    dataset_size: int = 0
    shuffle_seed: int | None = None

    def _expected(self, cursor: int) -> Prompt:
        pass_, pos = divmod(cursor, self.dataset_size)
        if self.shuffle_seed is None:
            return pass_, pos
        return pass_, pass_permutation(self.shuffle_seed, pass_, self.dataset_size)[pos]

    def live(self) -> set[Prompt]:
        return {p for p in self.pulled if p not in self.fate}

    def _end(self, gid: int, fate: str) -> Prompt:
        assert gid in self.group_prompt, f"{fate} of group {gid}, never pulled"
        prompt = self.group_prompt[gid]
        assert prompt not in self.fate, (
            f"prompt {prompt} (group {gid}) {fate} after it was already {self.fate[prompt]}"
        )
        self.fate[prompt] = fate
        return prompt

    def apply(self, ev: RolloutEvent) -> None:
        t = ev.event_type
        if t == "RunStarted":
            self.dataset_size = ev.dataset_size  # type: ignore[attr-defined]
            self.shuffle_seed = ev.shuffle_seed  # type: ignore[attr-defined]
        elif t in ("GroupAdmitted", "SparePulled"):
            p = (ev.data_pass, ev.prompt_index)  # type: ignore[attr-defined]
            assert p not in self.pulled, f"prompt {p} pulled twice"
            assert p == self._expected(len(self.pulled)), f"prompt {p} pulled out of walk order"
            self.pulled.append(p)
            self.group_prompt[ev.group_id] = p  # type: ignore[attr-defined]
        elif t == "GroupSelected":
            key = (ev.data_pass, ev.prompt_index)  # type: ignore[attr-defined]
            self.selections[key].append(ev.train_step)  # type: ignore[attr-defined]
        elif t == "BatchSelected":
            self.batches[ev.train_step] = list(ev.group_ids)  # type: ignore[attr-defined]
        elif t == "StepTrained":
            for gid in self.batches.pop(ev.train_step):  # type: ignore[attr-defined]
                p = self._end(gid, "trained")
                self.trained_at[p] = ev.train_step  # type: ignore[attr-defined]
        elif t == "GroupEvicted":
            self._end(ev.group_id, "evicted")  # type: ignore[attr-defined]
        elif t == "PromptDropped":
            p = self._end(ev.group_id, "dropped")  # type: ignore[attr-defined]
            self.drop_reasons[p] = ev.reason  # type: ignore[attr-defined]

    @classmethod
    def from_history(cls, store: Any, run_id: str) -> PromptLedger:
        ledger = cls()
        for _row, ev in iter_history(store, run_id):
            ledger.apply(ev)
        return ledger

    def check_against(self, state: RunState) -> None:
        """Conservation: every pulled prompt exactly once live / trained / evicted / dropped,
        and the live ones are exactly the state's groups."""
        assert len(self.pulled) == state.dataset_cursor, "pulled prompts have a gap"
        live_state = sorted((g.data_pass, g.prompt_index) for g in state.groups.values())
        assert len(live_state) == len(set(live_state)), f"a prompt is live twice: {live_state}"
        assert sorted(self.live()) == live_state, (
            f"ledger live {sorted(self.live())} != state live {live_state}"
        )
        fates = list(self.fate.values())
        c = state.counters
        assert fates.count("trained") == c.groups_trained
        assert fates.count("evicted") == c.groups_evicted
        assert fates.count("dropped") == c.prompts_dropped
        for p, steps in self.selections.items():
            # A prompt is selected at most once per history (a restore cuts the abandoned
            # selections out of the history, so they are not seen here).
            assert len(steps) == 1, f"prompt {p} selected for steps {steps}"


# ---------------------------------------------------------------- controllers


def assert_rows_untracked(state: RunState) -> None:
    """No collection walks a group's row, its tuple of sibling rows or a sibling row: the
    state's groups cost a full collection nothing per group (the table's one dict of rows
    aside, which a collection untracks too once it holds only untracked rows).

    CPython untracks a tuple when a collection of its generation finds it holds only
    untracked things; a collection may visit a tuple before the tuples it holds, so it
    can take a collection per level (row, tuple of rows, group row). An automatic
    collection may already have moved a tuple to the oldest generation, so three full
    collections, not young ones (which made this check depend on when the interpreter
    last collected). CPython only: other interpreters have no such lists."""
    if platform.python_implementation() != "CPython":
        return
    for _ in range(3):
        gc.collect()
    walked: set[int] | None = None
    for row in state.groups.rows():
        gid, sibling_rows = row[0], row[4]
        for what, obj in (
            ("row", row),
            ("sibling rows", sibling_rows),
            *((f"sibling {i}", r) for i, r in enumerate(sibling_rows)),
        ):
            if not gc.is_tracked(obj):
                continue
            if walked is None:
                walked = {id(o) for o in gc.get_objects()}
            assert id(obj) not in walked, f"group {gid}'s {what} is walked: {obj}"


def store_config(*, snapshot_interval: int = 0, window_ms: float = 0.0) -> StoreConfig:
    """A store config for tests: no commit window (tests flush often), rare snapshots."""
    return StoreConfig(snapshot_interval=snapshot_interval, group_commit_window_ms=window_ms)


def start(
    store: EventStore,
    config: RolloutConfig,
    *,
    run_id: str = "run",
    dataset_size: int = 40,
    snapshot_interval: int = 0,
) -> RolloutController:
    """A new run on ``store``."""
    return RolloutController.start(
        store,
        run_id,
        config,
        dataset_fingerprint="toy-dataset",
        dataset_size=dataset_size,
        store_config=store_config(snapshot_interval=snapshot_interval),
    )


def restore(
    store: EventStore, config: RolloutConfig, offset: int | None, *, run_id: str = "run", **kw: Any
) -> tuple[RolloutController, RecoveryReport]:
    """Restore the run (with its own config unless ``kw`` says otherwise)."""
    kw.setdefault("store_config", store_config())
    return RolloutController.restore(store, run_id, offset, rollout=config, **kw)


def assert_replay_equals_live(ctl: RolloutController) -> None:
    """The state rebuilt from the log (with and without snapshots) is the live state."""
    ctl.flush()
    live = ctl.state.to_snapshot()
    full = replay(ctl.store, ctl.run_id, use_snapshots=False)
    assert full.state.to_snapshot() == live
    fast = replay(ctl.store, ctl.run_id, use_snapshots=True)
    assert fast.state.to_snapshot() == live


def drive_to_end(ctl: Driver, *, max_steps: int = 200) -> list[int]:
    """Admit, generate and train until no further batch can form; return the steps trained.

    Generation uses the published weights; every step publishes its new weights.
    """
    trained: list[int] = []
    for _ in range(max_steps):
        admit_all(ctl)
        for g in sorted(ctl.state.live_groups(Phase.ADMITTED), key=lambda g: g.group_id):
            finish_group(ctl, g.group_id)
        step = ctl.state.train_step
        try:
            applied = ctl.execute(SelectBatch(step))
        except BatchNotReadyError:
            return trained
        if not only(applied, "BatchSelected"):
            continue  # evictions first; select again
        ctl.execute(RecordTrainStep(step, ctl.state.weight_version + 1))
        ctl.execute(PublishWeights(ctl.state.weight_version))
        trained.append(step)
    raise AssertionError(f"the run did not finish within {max_steps} steps")

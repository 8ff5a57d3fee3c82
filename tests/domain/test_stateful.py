"""Random command sequences against a RolloutController on a real SQLite log.

Under random rules (all samplers, drop policies and granularities, small groups) the
machine admits, dispatches, completes, fails, aborts, selects, trains, publishes,
checkpoints, restores to a random earlier checkpoint (salvage or strict) and reopens.
After every step:

- ``check_invariants`` holds on the live state;
- the state rebuilt from the log, with and without snapshots, equals the live state;
- an independent fold of the history (:class:`PromptLedger`) finds every pulled prompt
  exactly once live, trained, evicted or dropped: no prompt lost or trained twice.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from domain_helpers import PromptLedger, store_config
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from rolloutlog.controller.config import RolloutConfig
from rolloutlog.controller.domain import (
    AbortSibling,
    AdmitStep,
    CompleteSibling,
    Completion,
    DispatchSiblings,
    EvictStale,
    FailSibling,
    Phase,
    PublishWeights,
    RecordTrainStep,
    SelectBatch,
    SiblingStatus,
    check_invariants,
)
from rolloutlog.controller.domain.errors import (
    BatchNotReadyError,
    DatasetExhaustedError,
    LookaheadExceededError,
    RunFailedError,
    StaleAttemptError,
)
from rolloutlog.controller.rollout_controller import RolloutController, replay
from rolloutlog.controller.snapshot_encoder import encode_snapshot
from rolloutlog.eventstore import EventStore, PayloadPut

RUN = "stateful"
SNAPSHOT_INTERVAL = 25


def _put(payload_id: str) -> tuple[PayloadPut, ...]:
    """The payload a completion stores with it (the controller refuses unknown ones)."""
    return (PayloadPut(payload_id, "sibling", b"tokens"),)


configs = st.builds(
    RolloutConfig,
    group_size=st.integers(1, 3),
    groups_per_step=st.integers(1, 3),
    sampler=st.sampled_from(["in_order", "in_order", "windowed", "weight_fifo", "ready_first"]),
    staleness_bound=st.integers(0, 3),
    lookahead=st.integers(0, 3),
    spare_pool_size=st.integers(0, 2),
    drop_policy=st.sampled_from(["replace", "replace", "shrink", "fail"]),
    min_step_fraction=st.sampled_from([0.34, 0.5, 1.0]),
    attempts_per_sibling=st.integers(1, 3),
    recovery_granularity=st.sampled_from(["sibling", "group"]),
    abort_stale_at_weight_sync=st.booleans(),
)


class RolloutMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="rolloutlog-stateful-"))
        self.store = EventStore.open(f"sqlite:///{self.tmp / 'log.db'}?synchronous=OFF")
        self.ctl: RolloutController | None = None
        self.config: RolloutConfig | None = None
        self.checkpoints: list[tuple[int, int]] = []  # (offset, train step)
        self.results = 0
        self.opened_at = -1  # offset where the last restore/reopen left the log

    # ------------------------------------------------------------------ helpers
    @property
    def c(self) -> RolloutController:
        assert self.ctl is not None
        return self.ctl

    def _in_flight(self) -> list[tuple[int, int]]:
        return [
            (g.group_id, i)
            for g in sorted(self.c.state.groups.values(), key=lambda g: g.group_id)
            if g.phase is Phase.ADMITTED
            for i, s in enumerate(g.siblings)
            if s.status is SiblingStatus.IN_FLIGHT
        ]

    def _dispatchable(self) -> list[int]:
        return [
            g.group_id
            for g in sorted(self.c.state.groups.values(), key=lambda g: g.group_id)
            if g.phase is Phase.ADMITTED
            and any(s.status is SiblingStatus.PENDING for s in g.siblings)
        ]

    def _failed(self) -> bool:
        return self.c.state.failure is not None

    def _moved_on(self) -> bool:
        """Something happened since the last restore or reopen (no back-to-back ones)."""
        return self.c.state.last_seq != self.opened_at

    # ------------------------------------------------------------------ rules
    @initialize(
        config=configs,
        dataset_size=st.integers(4, 24),
        passes=st.integers(1, 3),
        shuffle_seed=st.none() | st.integers(0, 99),
    )
    def start(
        self,
        config: RolloutConfig,
        dataset_size: int,
        passes: int = 1,
        shuffle_seed: int | None = None,
    ) -> None:
        self.config = config
        self.ctl = RolloutController.start(
            self.store,
            RUN,
            config,
            dataset_fingerprint="toy",
            dataset_size=dataset_size,
            # Several (shuffled) passes: a prompt's identity is (pass, index) throughout.
            passes=passes,
            shuffle_seed=shuffle_seed,
            store_config=store_config(snapshot_interval=SNAPSHOT_INTERVAL),
        )

    @rule(steps=st.integers(1, 3))
    def admit(self, steps: int) -> None:
        for _ in range(steps):
            try:
                self.c.execute(AdmitStep())
            except (LookaheadExceededError, DatasetExhaustedError, RunFailedError):
                return

    @precondition(lambda self: not self._failed())
    @rule(data=st.data())
    def dispatch(self, data: st.DataObject) -> None:
        groups = self._dispatchable()
        if not groups:
            return
        gid = data.draw(st.sampled_from(groups), label="group")
        g = self.c.state.groups[gid]
        pending = [i for i, s in enumerate(g.siblings) if s.status is SiblingStatus.PENDING]
        chosen = data.draw(
            st.lists(st.sampled_from(pending), min_size=1, unique=True), label="siblings"
        )
        s = self.c.state
        # Generation serves the published weights, or newer ones it has loaded.
        version = data.draw(
            st.one_of(
                st.just(s.published_version),
                st.integers(s.published_version, s.weight_version),
            ),
            label="version",
        )
        self.c.execute(DispatchSiblings(gid, tuple(chosen), version))

    @precondition(lambda self: not self._failed())
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        targets = self._in_flight()
        if not targets:
            return
        gid, i = data.draw(st.sampled_from(targets), label="sibling")
        sib = self.c.state.groups[gid].siblings[i]
        assert sib.weight_version is not None
        version = data.draw(st.integers(sib.weight_version, self.c.state.weight_version))
        self.results += 1
        self.c.execute(
            CompleteSibling(
                Completion(
                    gid, i, sib.attempt, version, 3, 1 + i, 0.25 * i, f"r{self.results}", "stop"
                )
            ),
            payload_puts=_put(f"r{self.results}"),
        )

    def _dispatch_pending(self) -> None:
        """Dispatch every pending sibling with the published weights."""
        for gid in self._dispatchable():
            g = self.c.state.groups[gid]
            pending = tuple(
                i for i, s in enumerate(g.siblings) if s.status is SiblingStatus.PENDING
            )
            self.c.execute(DispatchSiblings(gid, pending, self.c.state.published_version))

    def _complete_as_dispatched(self, gid: int, i: int) -> None:
        """Complete in-flight sibling ``i`` of ``gid`` with the weights it was sent with."""
        sib = self.c.state.groups[gid].siblings[i]
        self.results += 1
        rid = f"r{self.results}"
        self.c.execute(
            CompleteSibling(
                Completion(gid, i, sib.attempt, sib.weight_version or 0, 3, 2, 1.0, rid, "stop")
            ),
            payload_puts=_put(rid),
        )

    def _generate(self, data: st.DataObject, outcomes: st.SearchStrategy[str]) -> None:
        """Dispatch every pending sibling with the published weights, then give each
        in-flight sibling an outcome drawn from ``outcomes``."""
        self._dispatch_pending()
        order = data.draw(st.permutations(self._in_flight()), label="completion order")
        for gid, i in order:
            if self._failed():
                return
            g = self.c.state.groups.get(gid)
            if g is None or g.siblings[i].status is not SiblingStatus.IN_FLIGHT:
                continue  # a drop or an eviction of this decision removed it
            sib = g.siblings[i]
            outcome = data.draw(outcomes, label=f"outcome of {gid}/{i}")
            if outcome == "complete":
                self._complete_as_dispatched(gid, i)
            elif outcome in ("retry", "drop"):
                self.c.execute(FailSibling(gid, i, sib.attempt, outcome == "retry", "flaky"))
            elif outcome == "abort":
                self.c.execute(AbortSibling(gid, i, sib.attempt, "preempted"))

    def _train_cycle(self) -> None:
        """Select (after any evictions), train and publish, as a training loop does."""
        s = self.c.state
        try:
            if s.train_step not in s.batches:
                self.c.execute(SelectBatch(s.train_step))
                if s.train_step not in s.batches:
                    self.c.execute(SelectBatch(s.train_step))  # evictions came first
            self.c.execute(RecordTrainStep(s.train_step, s.weight_version + 1))
            self.c.execute(PublishWeights(s.weight_version))
        except (BatchNotReadyError, RunFailedError):
            pass

    @precondition(lambda self: not self._failed())
    @rule(data=st.data())
    def generate(self, data: st.DataObject) -> None:
        """A burst of generation with every kind of outcome."""
        self._generate(
            data, st.sampled_from(["complete"] * 4 + ["retry", "drop", "abort", "leave"])
        )

    @precondition(lambda self: not self._failed())
    @rule(data=st.data(), rounds=st.integers(1, 4))
    def advance(self, data: st.DataObject, rounds: int) -> None:
        """Rounds of a healthy training loop: admit, generate (rare trouble), train."""
        # No drops here: under drop_policy fail one drop ends the run's progress.
        outcomes = st.sampled_from(["complete"] * 12 + ["retry", "abort", "leave"])
        for _ in range(rounds):
            for _ in range(4):
                try:
                    self.c.execute(AdmitStep())
                except (LookaheadExceededError, DatasetExhaustedError, RunFailedError):
                    break
            if self._failed():
                return
            self._generate(data, outcomes)
            self._train_cycle()

    @precondition(lambda self: not self._failed())
    @rule()
    def later_steps_finish_then_an_early_prompt_fails(self) -> None:
        """Dispatch everything, finish every group stamped after the earliest generating
        step, then fail a prompt of that step for good: under in_order with a spare in
        hand, its step borrows a ready group from the furthest later step."""
        self.admit(3)
        if self._failed():
            return
        self._dispatch_pending()
        s = self.c.state
        generating = [(s.groups[gid].target_step, gid, i) for gid, i in self._in_flight()]
        if not generating:
            return
        earliest, victim, sibling = min(generating)  # type: ignore[type-var]
        for step, gid, i in generating:
            if step != earliest:
                self._complete_as_dispatched(gid, i)
        attempt = s.groups[victim].siblings[sibling].attempt
        self.c.execute(FailSibling(victim, sibling, attempt, False, "early prompt failed"))

    @rule()
    def train_cycle(self) -> None:
        self._train_cycle()

    @precondition(lambda self: not self._failed())
    @rule(data=st.data())
    def result_of_a_superseded_attempt(self, data: st.DataObject) -> None:
        targets = [
            (g.group_id, i)
            for g in self.c.state.groups.values()
            for i, s in enumerate(g.siblings)
            if s.attempt >= 2
        ]
        if not targets:
            return
        gid, i = data.draw(st.sampled_from(sorted(targets)), label="sibling")
        sib = self.c.state.groups[gid].siblings[i]
        before = self.c.state.last_seq
        try:
            self.c.execute(
                CompleteSibling(Completion(gid, i, sib.attempt - 1, 0, 3, 4, 0.0, "late", "stop"))
            )
        except StaleAttemptError:
            pass
        else:
            raise AssertionError(f"a superseded attempt of group {gid} sibling {i} was accepted")
        assert self.c.state.last_seq == before

    @precondition(lambda self: not self._failed())
    @rule(data=st.data(), retryable=st.booleans())
    def fail(self, data: st.DataObject, retryable: bool) -> None:
        targets = self._in_flight()
        if not targets:
            return
        gid, i = data.draw(st.sampled_from(targets), label="sibling")
        attempt = self.c.state.groups[gid].siblings[i].attempt
        self.c.execute(FailSibling(gid, i, attempt, retryable, "random failure"))

    @precondition(lambda self: not self._failed())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        targets = self._in_flight()
        if not targets:
            return
        gid, i = data.draw(st.sampled_from(targets), label="sibling")
        attempt = self.c.state.groups[gid].siblings[i].attempt
        self.c.execute(AbortSibling(gid, i, attempt, "random abort"))

    @precondition(lambda self: self.c.state.train_step not in self.c.state.batches)
    @rule()
    def select(self) -> None:
        with contextlib.suppress(BatchNotReadyError, RunFailedError):
            self.c.execute(SelectBatch(self.c.state.train_step))

    @precondition(lambda self: self.c.state.train_step in self.c.state.batches)
    @rule()
    def train(self) -> None:
        s = self.c.state
        with contextlib.suppress(RunFailedError):
            self.c.execute(RecordTrainStep(s.train_step, s.weight_version + 1))

    @precondition(
        lambda self: (
            not self._failed() and self.c.state.published_version < self.c.state.weight_version
        )
    )
    @rule(data=st.data())
    def publish(self, data: st.DataObject) -> None:
        s = self.c.state
        version = data.draw(st.integers(s.published_version, s.weight_version), label="version")
        self.c.execute(PublishWeights(version))

    @precondition(lambda self: not self._failed())
    @rule()
    def evict_stale(self) -> None:
        self.c.execute(EvictStale(reason="operator request"))

    @precondition(
        lambda self: (
            self.c.state.checkpoint is None
            or self.c.state.checkpoint.offset != self.c.state.last_seq
        )
    )
    @rule()
    def checkpoint(self) -> None:
        step = self.c.state.train_step
        offset = self.c.checkpoint(step)
        self.checkpoints.append((offset, step))

    @precondition(lambda self: bool(self.checkpoints) and self._moved_on())
    @rule(data=st.data(), mode=st.sampled_from(["salvage", "strict"]))
    def restore(self, data: st.DataObject, mode: str) -> None:
        offset, step = data.draw(st.sampled_from(self.checkpoints), label="checkpoint")
        self.c.close()
        self.ctl = None
        ctl, report = RolloutController.restore(
            self.store,
            RUN,
            offset,
            rollout=self.config,
            mode=mode,  # type: ignore[arg-type]
            store_config=store_config(snapshot_interval=SNAPSHOT_INTERVAL),
        )
        self.ctl = ctl
        self.opened_at = ctl.state.last_seq
        assert report.from_offset == offset
        assert ctl.state.train_step == step
        assert ctl.state.epoch == report.epoch == self.store.get_run(RUN).current_epoch
        if mode == "strict" or report.granularity == "group":
            assert report.siblings_salvaged == 0
        assert not self._in_flight()  # attempts of the abandoned epoch are void
        # Stale recovered groups are evicted as recovered (never counted as trained).
        assert report.groups_evicted_stale <= ctl.state.counters.groups_evicted_recovered

    @precondition(lambda self: self._moved_on())
    @rule()
    def reopen(self) -> None:
        self.c.close()
        self.ctl = None
        self.ctl = RolloutController.open(
            self.store, RUN, store_config=store_config(snapshot_interval=SNAPSHOT_INTERVAL)
        )
        self.opened_at = self.c.state.last_seq
        assert not self._in_flight()  # the old epoch's attempts are re-dispatched

    # ------------------------------------------------------------------ invariants
    @invariant()
    def invariants_hold(self) -> None:
        if self.ctl is None:
            return
        check_invariants(self.ctl.state)

    @invariant()
    def log_replays_to_the_live_state(self) -> None:
        if self.ctl is None:
            return
        self.ctl.flush()
        live = self.ctl.state.to_snapshot()
        full = replay(self.store, RUN, use_snapshots=False)
        assert full.state.to_snapshot() == live
        fast = replay(self.store, RUN, use_snapshots=True)
        assert fast.state.to_snapshot() == live

    @invariant()
    def incremental_snapshot_equals_a_full_encoding(self) -> None:
        """The snapshot encoder re-encodes only touched groups: its bytes must be those
        of encoding the whole state (a group it missed would restore stale)."""
        if self.ctl is None:
            return
        encoder = self.ctl._snapshot_encoder
        assert encoder.refresh(self.ctl.state, None)
        assert encoder.cut(self.ctl.state)() == encode_snapshot(self.ctl.state)

    @invariant()
    def no_prompt_lost_or_trained_twice(self) -> None:
        if self.ctl is None:
            return
        self.ctl.flush()
        PromptLedger.from_history(self.store, RUN).check_against(self.ctl.state)

    def teardown(self) -> None:
        try:
            if self.ctl is not None:
                self.ctl.close()
        finally:
            self.store.close()
            shutil.rmtree(self.tmp, ignore_errors=True)


#: In-order runs that replace drops from a spare pool: the rules under which a short
#: step borrows a ready group from a later step and a spare repays it.
borrowing_configs = st.builds(
    RolloutConfig,
    group_size=st.integers(1, 3),
    groups_per_step=st.integers(2, 3),
    sampler=st.just("in_order"),
    staleness_bound=st.integers(1, 3),
    lookahead=st.integers(1, 3),
    spare_pool_size=st.integers(1, 3),
    drop_policy=st.just("replace"),
    attempts_per_sibling=st.integers(1, 3),
    recovery_granularity=st.sampled_from(["sibling", "group"]),
    abort_stale_at_weight_sync=st.booleans(),
)


class BorrowingMachine(RolloutMachine):
    """The same machine under in_order/replace rules with spares (borrows and repayments)."""

    @initialize(config=borrowing_configs, dataset_size=st.integers(8, 30))
    def start(self, config: RolloutConfig, dataset_size: int) -> None:
        RolloutMachine.start(self, config, dataset_size)


_SETTINGS = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
RolloutMachine.TestCase.settings = _SETTINGS
BorrowingMachine.TestCase.settings = settings(_SETTINGS, max_examples=25)
test_rollout_state_machine = RolloutMachine.TestCase
test_borrowing_state_machine = BorrowingMachine.TestCase

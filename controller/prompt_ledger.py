"""The prompt ledger: a projection of the log, independent of the state machine, that
says what became of every pulled prompt and what each train step trained.

It is the check behind "no prompt lost, none trained twice": it folds the history with
its own simple rules, and :func:`cross_check` compares the result with the state
machine's live groups.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from rolloutlog.eventstore import EventStoreProtocol

from .domain.events import (
    GroupAdmitted,
    GroupEvicted,
    GroupSelected,
    PromptDropped,
    RolloutEvent,
    RunStarted,
    SiblingCompleted,
    SparePulled,
    StepTrained,
)
from .domain.state import RunState
from .rollout_history import iter_history

#: A prompt's identity: ``(pass, dataset index)``.
PromptId = tuple[int, int]


@dataclass
class PromptLedger:
    """What happened to each prompt, and the reward of each trained step.

    A prompt's identity is ``(pass, index)`` (:data:`PromptId`): the checks (pulled
    twice, trained twice, lost) count per pass, so a prompt trained once in each of two
    passes is not "trained twice". The maps keyed by a bare ``int`` are by dataset index
    (for single-pass audits; with several passes they hold the latest pass).
    """

    group_of_prompt: dict[int, int] = field(default_factory=dict)
    prompt_of_group: dict[int, int] = field(default_factory=dict)
    pulled_twice: list[PromptId] = field(default_factory=list)
    dataset_size: int = 0
    passes: int = 1
    group_of_key: dict[PromptId, int] = field(default_factory=dict)
    key_of_group: dict[int, PromptId] = field(default_factory=dict)
    trained_keys: Counter[PromptId] = field(default_factory=Counter)
    dropped_keys: set[PromptId] = field(default_factory=set)
    evicted_keys: set[PromptId] = field(default_factory=set)
    trained: Counter[int] = field(default_factory=Counter)
    dropped: dict[int, str] = field(default_factory=dict)
    evicted: dict[int, str] = field(default_factory=dict)
    step_of_prompt: dict[int, list[int]] = field(default_factory=dict)
    step_rewards: dict[int, float] = field(default_factory=dict)
    _selected: dict[int, list[int]] = field(default_factory=dict)
    _rewards: dict[int, dict[int, float]] = field(default_factory=dict)

    def apply(self, event: RolloutEvent) -> None:
        """Fold one event."""
        if isinstance(event, RunStarted):
            self.dataset_size, self.passes = event.dataset_size, event.passes
        elif isinstance(event, GroupAdmitted | SparePulled):
            key = (event.data_pass, event.prompt_index)
            if key in self.group_of_key:
                self.pulled_twice.append(key)
            self.group_of_key[key] = event.group_id
            self.key_of_group[event.group_id] = key
            self.group_of_prompt[event.prompt_index] = event.group_id
            self.prompt_of_group[event.group_id] = event.prompt_index
        elif isinstance(event, SiblingCompleted):
            self._rewards.setdefault(event.group_id, {})[event.sibling] = event.reward
        elif isinstance(event, GroupSelected):
            self._selected.setdefault(event.train_step, []).append(event.group_id)
        elif isinstance(event, StepTrained):
            groups = self._selected.pop(event.train_step, [])
            rewards: list[float] = []
            for gid in groups:
                prompt = self.prompt_of_group[gid]
                self.trained[prompt] += 1
                self.trained_keys[self.key_of_group[gid]] += 1
                self.step_of_prompt.setdefault(prompt, []).append(event.train_step)
                rewards.extend(self._rewards.pop(gid, {}).values())
            self.step_rewards[event.train_step] = sum(rewards) / len(rewards) if rewards else 0.0
        elif isinstance(event, PromptDropped):
            self.dropped[event.prompt_index] = event.reason
            self.dropped_keys.add((event.data_pass, event.prompt_index))
        elif isinstance(event, GroupEvicted):
            self.evicted[event.prompt_index] = event.reason
            self.evicted_keys.add((event.data_pass, event.prompt_index))

    @property
    def prompts_pulled(self) -> int:
        """Distinct prompts ``(pass, index)`` pulled into groups."""
        return len(self.group_of_key)

    def passes_completed(self, unused: set[PromptId] | frozenset[PromptId] = frozenset()) -> int:
        """Passes (counted from the first) whose every prompt was pulled and then trained,
        dropped or evicted; prompts in ``unused`` (spares no step needed) do not hold a
        pass open."""
        if self.dataset_size < 1:
            return 0
        open_passes = {p for p, _ in self.unfinished() - set(unused)}
        pulled: Counter[int] = Counter(p for p, _ in self.group_of_key)
        done = 0
        while pulled[done] == self.dataset_size and done not in open_passes:
            done += 1
        return done

    def unfinished(self) -> set[PromptId]:
        """Prompts ``(pass, index)`` pulled but neither trained, dropped nor evicted."""
        done = set(self.trained_keys) | self.dropped_keys | self.evicted_keys
        return set(self.group_of_key) - done

    @property
    def trained_twice(self) -> list[PromptId]:
        """Prompts ``(pass, index)`` trained more than once in their pass (must be empty)."""
        return sorted(p for p, n in self.trained_keys.items() if n > 1)


def build_ledger(store: EventStoreProtocol, run_id: str, to_seq: int | None = None) -> PromptLedger:
    """Fold the run's history (abandoned ranges excluded) into a ledger."""
    ledger = PromptLedger()
    for _row, event in iter_history(store, run_id, to_seq):
        ledger.apply(event)
    return ledger


@dataclass(frozen=True)
class LedgerCheck:
    """The outcome of comparing the ledger with the state machine."""

    prompts_pulled: int
    prompts_trained: int
    prompts_dropped: int
    prompts_evicted: int
    prompts_live: int
    prompts_lost: int
    prompts_trained_twice: int
    prompts_pulled_twice: int
    lost: tuple[PromptId, ...]
    trained_twice: tuple[PromptId, ...]


def cross_check(ledger: PromptLedger, state: RunState) -> LedgerCheck:
    """Every pulled prompt must be trained once, dropped, evicted, or live in ``state``."""
    live_in_state = {(g.data_pass, g.prompt_index) for g in state.groups.values()}
    unfinished = ledger.unfinished()
    lost = sorted(unfinished - live_in_state)
    return LedgerCheck(
        prompts_pulled=ledger.prompts_pulled,
        prompts_trained=len(ledger.trained_keys),
        prompts_dropped=len(ledger.dropped_keys),
        prompts_evicted=len(ledger.evicted_keys),
        prompts_live=len(unfinished & live_in_state),
        prompts_lost=len(lost),
        prompts_trained_twice=len(ledger.trained_twice),
        prompts_pulled_twice=len(ledger.pulled_twice),
        lost=tuple(lost),
        trained_twice=tuple(ledger.trained_twice),
    )

"""The rollout state: what a fold of the events yields. O(live groups), not O(history).

Groups leave the state when they reach a terminal phase (trained, evicted, dropped);
only counters remember them. ``evolve`` updates a state in place (a 10M-event replay
cannot copy the state per event); use :meth:`RunState.copy` to keep an old one.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, is_dataclass
from enum import StrEnum
from typing import Any, NamedTuple

from ..config import RolloutConfig


class Phase(StrEnum):
    """Where a group is in its lifecycle (terminal phases are only counted)."""

    SPARE = "spare"
    ADMITTED = "admitted"  # in flight or partially generated
    READY = "ready"  # in the replay buffer
    SELECTED = "selected"  # in a train batch not yet trained
    TRAINED = "trained"
    EVICTED = "evicted"
    DROPPED = "dropped"


class SiblingStatus(StrEnum):
    """One sibling's generation status."""

    PENDING = "pending"  # not dispatched, or its last attempt failed/aborted
    IN_FLIGHT = "in_flight"
    DONE = "done"


#: A sibling as the state holds it: a plain tuple of atoms, in :class:`SiblingState`'s
#: field order with the status as its string value. CPython's collector untracks a tuple
#: of atoms at the first collection that sees it (an enum member is an object it tracks,
#: hence the string), so a buffer of 100k groups of 16 siblings is not 1.6M objects for
#: every full collection to walk. Rows are immutable: a change makes a new row.
SiblingRow = tuple[int, str, int | None, int, int, float | None, str | None, bool]

_STATUS: dict[str, SiblingStatus] = {s.value: s for s in SiblingStatus}
#: A status's value, looked up by the member or by the value itself.
_VALUE: dict[str, str] = {s: s.value for s in SiblingStatus}
_PENDING = SiblingStatus.PENDING.value
_DONE = SiblingStatus.DONE.value
_new_tuple = tuple.__new__
#: A sibling never dispatched.
NEW_SIBLING_ROW: SiblingRow = (0, _PENDING, None, 0, 0, None, None, False)


class SiblingState(NamedTuple):
    """One completion of a group, as read: an immutable view of the group's row."""

    attempt: int = 0  # newest attempt dispatched (0: never dispatched)
    status: SiblingStatus = SiblingStatus.PENDING
    weight_version: int | None = None  # of the dispatch (in flight) or the completion (done)
    failures: int = 0
    completion_tokens: int = 0
    reward: float | None = None
    payload_id: str | None = None
    salvaged: bool = False

    @classmethod
    def from_row(cls, row: SiblingRow) -> SiblingState:
        """The view of a stored row."""
        a, status, w, f, c, r, p, s = row
        # tuple.__new__ directly: a view is made per sibling read, and the generated
        # __new__ (a Python function) would double its cost.
        return _new_tuple(cls, (a, _STATUS[status], w, f, c, r, p, s))

    def row(self) -> SiblingRow:
        """The row the state stores for this sibling."""
        a, status, w, f, c, r, p, s = self
        value = _VALUE.get(status)
        if value is None:
            value = SiblingStatus(status).value  # the ValueError that names the bad status
        return (a, value, w, f, c, r, p, s)


@dataclass(slots=True)
class GroupState:
    """One prompt × group_size siblings.

    The group itself is one mutable object; its siblings are immutable rows
    (:data:`SiblingRow`), read through :attr:`siblings` and changed by
    :meth:`set_sibling`, which replaces the row. Make one with :meth:`new`.
    """

    group_id: int
    prompt_index: int
    target_step: int | None
    phase: Phase
    sibling_rows: tuple[SiblingRow, ...]
    recovered: bool = False  # came back in a restore
    borrowed_from: int | None = None  # lender step, when re-stamped by a borrow
    selected_for: int | None = None  # train step, when selected
    selected_staleness: int | None = None
    ready_order: int | None = None  # position in commit order (ready_first sampler)
    data_pass: int = 0  # the pass over the data: the prompt's identity is (pass, index)

    @classmethod
    def new(
        cls,
        group_id: int,
        prompt_index: int,
        target_step: int | None,
        phase: Phase,
        siblings: Iterable[SiblingState],
        **rest: Any,
    ) -> GroupState:
        """A group of these siblings (``rest``: the other fields)."""
        rows = tuple([s.row() for s in siblings])
        return cls(group_id, prompt_index, target_step, phase, rows, **rest)

    @property
    def siblings(self) -> tuple[SiblingState, ...]:
        """The siblings, in order (views: change one with :meth:`set_sibling`)."""
        view = SiblingState.from_row
        return tuple([view(row) for row in self.sibling_rows])

    @property
    def size(self) -> int:
        """How many siblings the group has."""
        return len(self.sibling_rows)

    def sibling(self, index: int) -> SiblingState:
        """Sibling ``index`` (an IndexError when the group has no such sibling)."""
        return SiblingState.from_row(self.sibling_rows[index])

    def set_sibling(self, index: int, sibling: SiblingState) -> None:
        """Replace sibling ``index``'s row by ``sibling``'s."""
        rows = self.sibling_rows
        if not 0 <= index < len(rows):
            raise IndexError(f"group {self.group_id} has no sibling {index}")
        self.sibling_rows = (*rows[:index], sibling.row(), *rows[index + 1 :])

    def count(self, status: SiblingStatus) -> int:
        """Siblings with this status."""
        value = status.value
        return sum(1 for row in self.sibling_rows if row[1] == value)

    def done_count(self) -> int:
        """Siblings with a completion."""
        return self.count(SiblingStatus.DONE)

    def oldest_version(self) -> int | None:
        """Oldest weight version among finished siblings (None when none finished)."""
        versions = [row[2] for row in self.sibling_rows if row[1] == _DONE and row[2] is not None]
        return min(versions) if versions else None


@dataclass(slots=True)
class Loan:
    """A borrow: ``group_id`` moved from ``lender_step`` to ``borrower_step``."""

    group_id: int
    lender_step: int
    borrower_step: int
    repaid_by: int | None  # the spare assigned the lender's stamp; None = recorded debt


@dataclass(slots=True)
class Counters:
    """Totals of terminal and other transitions (groups no longer held in the state)."""

    groups_committed: int = 0
    groups_trained: int = 0
    groups_evicted: int = 0
    groups_evicted_recovered: int = 0
    prompts_dropped: int = 0
    replacements: int = 0
    borrows: int = 0
    shortfall: int = 0
    siblings_completed: int = 0
    siblings_failed: int = 0
    siblings_aborted: int = 0
    siblings_salvaged: int = 0
    tokens_generated: int = 0
    tokens_committed: int = 0
    engines_lost: int = 0
    engines_refit: int = 0
    engine_lost_attempts: int = 0  # attempts in flight on engines when they were lost


@dataclass(slots=True)
class EngineState:
    """One generation engine as the log knows it (membership, not health)."""

    engine_id: str
    address: str
    weight_version: int | None  # None: unknown (stale until refit) or lost
    lost: bool = False
    joins: int = 1
    losses: int = 0


@dataclass(slots=True)
class CheckpointRef:
    """The newest checkpoint marker in the history."""

    offset: int
    train_step: int
    weight_version: int


@dataclass(slots=True)
class RunState:
    """The whole rollout state of one run at one offset."""

    run_id: str | None = None
    config: RolloutConfig | None = None
    config_fingerprint: str = ""
    dataset_fingerprint: str = ""
    dataset_size: int = 0
    passes: int = 1  # passes over the dataset the dataset cursor walks
    shuffle_seed: int | None = None  # None: each pass in dataset order
    epoch: int = 1
    last_seq: int = 0  # offset of the newest applied event
    dataset_cursor: int = 0  # prompts pulled, over all passes
    dispatch_cursor: int = 0  # next step to admit prompts for
    train_step: int = 0  # next step to train (= steps trained)
    weight_version: int = 0  # the trainer's
    published_version: int = 0  # what generation serves
    next_group_id: int = 0
    groups: dict[int, GroupState] = field(default_factory=dict)
    #: Ids of the READY groups in commit order (an index of ``groups``, derived from it:
    #: never snapshotted, rebuilt on decode). The ready_first sampler reads its head
    #: instead of scanning a 100k-group buffer; the others scan only the ready groups.
    ready: dict[int, None] = field(default_factory=dict)
    quotas: dict[int, int] = field(default_factory=dict)  # target step -> groups it trains
    spares: list[int] = field(default_factory=list)  # spare group ids, oldest first
    batches: dict[int, list[int]] = field(default_factory=dict)  # selected, untrained
    batch_shortfall: dict[int, int] = field(default_factory=dict)
    loans: dict[int, Loan] = field(default_factory=dict)  # by borrowed group id
    counters: Counters = field(default_factory=Counters)
    checkpoint: CheckpointRef | None = None
    failure: str | None = None  # set when the drop policy "fail" stopped the run
    engines: dict[str, EngineState] = field(default_factory=dict)  # by engine id

    @property
    def rules(self) -> RolloutConfig:
        """The run's config; an error before RunStarted."""
        if self.config is None:
            raise RuntimeError("the run has not started (no RunStarted event applied)")
        return self.config

    @property
    def walk_size(self) -> int:
        """Prompts the dataset cursor can pull: ``dataset_size`` per pass."""
        return self.dataset_size * self.passes

    def prompt_key_at(self, cursor: int) -> tuple[int, int]:
        """``(pass, index)`` of the prompt at dataset-cursor position ``cursor``: a pure
        function of the run's recorded ``dataset_size`` and ``shuffle_seed``, so a replay
        pulls the same prompts."""
        pass_, pos = divmod(cursor, self.dataset_size)
        if self.shuffle_seed is None:
            return pass_, pos
        return pass_, _pass_order(self.shuffle_seed, pass_, self.dataset_size)[pos]

    def copy(self) -> RunState:
        """A deep copy (evolve mutates in place)."""
        return copy.deepcopy(self)

    def live_groups(self, *phases: Phase) -> list[GroupState]:
        """Groups in any of ``phases`` (all live groups when none given), by group id."""
        if not phases:
            return list(self.groups.values())
        return [g for g in self.groups.values() if g.phase in phases]

    def staleness(self, group: GroupState) -> int:
        """Trainer weight version minus the group's oldest finished sibling version."""
        oldest = group.oldest_version()
        return 0 if oldest is None else self.weight_version - oldest

    # ------------------------------------------------------------------ snapshots
    def to_snapshot(self, *, groups: bool = True) -> dict[str, Any]:
        """A JSON-serialisable dict of the whole state (without ``groups``: all of it but
        the groups, which the incremental snapshot encoder keeps itself).

        The same dict ``dataclasses.asdict`` gives (with groups, loans and the step maps
        as lists), built in one pass, so no group is converted twice.
        """
        data: dict[str, Any] = {}
        for name in _field_names(RunState):
            if (name == "groups" and not groups) or name == "ready":
                continue
            value = getattr(self, name)
            if name == "config":
                data[name] = value.model_dump() if value else None
            elif name == "groups":
                data[name] = [group_plain(g) for g in value.values()]
            elif name in ("loans", "engines"):
                data[name] = [_as_plain(item) for item in value.values()]
            elif name in ("quotas", "batches", "batch_shortfall"):
                data[name] = [[k, v] for k, v in value.items()]
            else:
                data[name] = _as_plain(value)
        return data

    @classmethod
    def from_snapshot(cls, data: dict[str, Any]) -> RunState:
        """Rebuild a state from :meth:`to_snapshot`'s output."""
        groups = {}
        for g in data["groups"]:
            group = GroupState(
                **{
                    **{k: v for k, v in g.items() if k != "siblings"},
                    "phase": Phase(g["phase"]),
                    "sibling_rows": tuple([_row_of(s) for s in g["siblings"]]),
                }
            )
            groups[group.group_id] = group
        return cls(
            run_id=data["run_id"],
            config=RolloutConfig.model_validate(data["config"]) if data["config"] else None,
            config_fingerprint=data["config_fingerprint"],
            dataset_fingerprint=data["dataset_fingerprint"],
            dataset_size=data["dataset_size"],
            passes=data.get("passes", 1),
            shuffle_seed=data.get("shuffle_seed"),
            epoch=data["epoch"],
            last_seq=data["last_seq"],
            dataset_cursor=data["dataset_cursor"],
            dispatch_cursor=data["dispatch_cursor"],
            train_step=data["train_step"],
            weight_version=data["weight_version"],
            published_version=data["published_version"],
            next_group_id=data["next_group_id"],
            groups=groups,
            ready=ready_index(groups),
            quotas={int(k): v for k, v in data["quotas"]},
            spares=list(data["spares"]),
            batches={int(k): list(v) for k, v in data["batches"]},
            batch_shortfall={int(k): v for k, v in data["batch_shortfall"]},
            loans={loan["group_id"]: Loan(**loan) for loan in data["loans"]},
            counters=Counters(**data["counters"]),
            checkpoint=CheckpointRef(**data["checkpoint"]) if data["checkpoint"] else None,
            failure=data["failure"],
            # Snapshots written before engine membership have no engine table.
            engines={e["engine_id"]: EngineState(**e) for e in data.get("engines", [])},
        )


def ready_index(groups: dict[int, GroupState]) -> dict[int, None]:
    """The ``RunState.ready`` index of ``groups``: READY group ids in commit order."""
    ready = [g for g in groups.values() if g.phase is Phase.READY]
    ready.sort(key=lambda g: (g.ready_order if g.ready_order is not None else -1, g.group_id))
    return dict.fromkeys(g.group_id for g in ready)


@functools.lru_cache(maxsize=4)
def _pass_order(seed: int, pass_: int, size: int) -> tuple[int, ...]:
    """A pass's order, cached: every pull of a pass reads the same permutation."""
    from .passes import pass_permutation

    return tuple(pass_permutation(seed, pass_, size))


# ---------------------------------------------------------------------- snapshot helpers
#: Field values that ``dataclasses.asdict`` returns as they are (it deep-copies them,
#: and a deep copy of these is the object itself).
_ATOMS: frozenset[type] = frozenset({int, float, str, bool, type(None), Phase, SiblingStatus})
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


#: A snapshot's sibling keys, in row order.
_SIBLING_KEYS: tuple[str, ...] = SiblingState._fields


def group_plain(group: GroupState) -> dict[str, Any]:
    """A group as its snapshot stores it: the fields, and ``siblings`` as a list of
    dicts of :class:`SiblingState`'s fields (the format from before siblings were rows)."""
    data: dict[str, Any] = {}
    for name in _field_names(GroupState):
        if name == "sibling_rows":
            data["siblings"] = [
                dict(zip(_SIBLING_KEYS, row, strict=True)) for row in group.sibling_rows
            ]
        else:
            data[name] = getattr(group, name)
    return data


def _row_of(sibling: dict[str, Any]) -> SiblingRow:
    """The row of a snapshot's sibling dict (its status checked)."""
    return SiblingState(**sibling).row()


def _as_plain(value: Any) -> Any:
    """What ``dataclasses.asdict`` makes of ``value``, with a fast path for atoms."""
    if type(value) in _ATOMS:
        return value
    if is_dataclass(value) and not isinstance(value, type):
        return {name: _as_plain(getattr(value, name)) for name in _field_names(type(value))}
    if type(value) in (list, tuple):
        return type(value)(_as_plain(v) for v in value)
    if type(value) is dict:
        return {_as_plain(k): _as_plain(v) for k, v in value.items()}
    return copy.deepcopy(value)  # what asdict does with any other value

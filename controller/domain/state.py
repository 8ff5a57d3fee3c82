"""The rollout state: what a fold of the events yields. O(live groups), not O(history).

Groups leave the state when they reach a terminal phase (trained, evicted, dropped);
only counters remember them. ``evolve`` updates a state in place (a 10M-event replay
cannot copy the state per event); use :meth:`RunState.copy` to keep an old one.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import (
    ItemsView,
    Iterable,
    Iterator,
    KeysView,
    Mapping,
    MutableMapping,
    ValuesView,
)
from dataclasses import dataclass, field, fields, is_dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Final, Generic, NamedTuple, TypeVar, overload

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


#: A group as the state stores it: a plain tuple of atoms and its tuple of sibling rows,
#: in :data:`GROUP_FIELDS` order, with the phase as its string value. Like a sibling row,
#: CPython's collector untracks it by itself at the first collection that sees it (once
#: its tuple of rows is untracked), so a buffer of 100k groups is not 100k objects for
#: every full collection to walk. Rows are immutable: a change makes a new row.
GroupRow = tuple[
    int,  # group_id
    int,  # prompt_index
    int | None,  # target_step
    str,  # phase (its value)
    tuple[SiblingRow, ...],  # sibling_rows
    bool,  # recovered
    int | None,  # borrowed_from
    int | None,  # selected_for
    int | None,  # selected_staleness
    int | None,  # ready_order
    int,  # data_pass
]
#: A group's fields, in :data:`GroupRow` order (a snapshot stores them by these names).
GROUP_FIELDS: tuple[str, ...] = (
    "group_id",
    "prompt_index",
    "target_step",
    "phase",
    "sibling_rows",
    "recovered",
    "borrowed_from",
    "selected_for",
    "selected_staleness",
    "ready_order",
    "data_pass",
)
_PHASE_AT: Final = 3  # GROUP_FIELDS.index("phase")
_SIBLINGS_AT: Final = 4  # GROUP_FIELDS.index("sibling_rows")
_READY_ORDER_AT: Final = 9  # GROUP_FIELDS.index("ready_order")
_PHASE: dict[str, Phase] = {p.value: p for p in Phase}
#: A phase's value, looked up by the member or by the value itself.
_PHASE_VALUE: dict[str, str] = {p: p.value for p in Phase}
_READY = Phase.READY.value


def _phase_value(phase: Phase | str) -> str:
    value = _PHASE_VALUE.get(phase)
    if value is None:
        value = Phase(phase).value  # the ValueError that names the bad phase
    return value


_T = TypeVar("_T")
_D = TypeVar("_D")

if TYPE_CHECKING:

    class _Field(Generic[_T]):
        """How a type checker sees a :func:`_field` (a property at run time)."""

        def __get__(self, view: GroupState, owner: type[GroupState]) -> _T: ...
        def __set__(self, view: GroupState, value: _T) -> None: ...


def _field(index: int) -> Any:
    """A :class:`GroupState` attribute: field ``index`` of the group's current row."""

    def get(self: GroupState) -> Any:
        rows = self._rows
        if rows is not None:
            row = rows.get(self.group_id)
            if row is not None:
                self._row = row
                return row[index]
        return self._row[index]

    def put(self: GroupState, value: Any) -> None:
        self._put(index, value)

    return property(get, put, doc=f"The group's {GROUP_FIELDS[index]}.")


class GroupState:
    """One prompt × group_size siblings, as read: a view of the group's row.

    The state stores a group as a :data:`GroupRow` in its :class:`GroupTable`; reading
    ``state.groups[gid]`` makes a view, whose attributes read the group's current row
    and whose assignments (``group.phase = Phase.READY``) replace that row in the table,
    so every view of a group sees every change. A view of a group that has since left
    the table reads the group as this view last read or wrote it. A view made by the
    constructor (or :meth:`new`) holds its own row until it is put in a table. The
    siblings are rows too (:data:`SiblingRow`), read through :attr:`siblings` and changed
    by :meth:`set_sibling`, which replaces the sibling's row.
    """

    __slots__ = ("_row", "_rows", "group_id")

    group_id: int
    _rows: dict[int, GroupRow] | None  # the table's rows, when in a table
    _row: GroupRow  # the row as this view last read or wrote it

    prompt_index: _Field[int] = _field(1)
    target_step: _Field[int | None] = _field(2)
    sibling_rows: _Field[tuple[SiblingRow, ...]] = _field(_SIBLINGS_AT)
    recovered: _Field[bool] = _field(5)  # came back in a restore
    borrowed_from: _Field[int | None] = _field(6)  # lender step, when re-stamped by a borrow
    selected_for: _Field[int | None] = _field(7)  # train step, when selected
    selected_staleness: _Field[int | None] = _field(8)
    ready_order: _Field[int | None] = _field(_READY_ORDER_AT)  # commit order (ready_first)
    data_pass: _Field[int] = _field(10)  # the pass over the data: a prompt is (pass, index)

    def __init__(
        self,
        group_id: int,
        prompt_index: int,
        target_step: int | None,
        phase: Phase,
        sibling_rows: tuple[SiblingRow, ...],
        recovered: bool = False,
        borrowed_from: int | None = None,
        selected_for: int | None = None,
        selected_staleness: int | None = None,
        ready_order: int | None = None,
        data_pass: int = 0,
    ) -> None:
        self.group_id = group_id
        self._rows = None
        self._row = (
            group_id,
            prompt_index,
            target_step,
            _phase_value(phase),
            tuple(sibling_rows),
            recovered,
            borrowed_from,
            selected_for,
            selected_staleness,
            ready_order,
            data_pass,
        )

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

    @classmethod
    def of_row(cls, row: GroupRow) -> GroupState:
        """A view that holds ``row`` (in no table)."""
        return _view(None, row[0], row)

    def row(self) -> GroupRow:
        """The group's current row (what the state stores)."""
        rows = self._rows
        if rows is not None:
            row = rows.get(self.group_id)
            if row is not None:
                self._row = row
                return row
        return self._row

    def _put(self, index: int, value: Any) -> None:
        """Replace field ``index`` of the group's row."""
        old = self.row()
        self._store((*old[:index], value, *old[index + 1 :]))

    def _store(self, row: GroupRow) -> None:
        """Make ``row`` the group's row (in the table too, if the group is there)."""
        self._row = row
        rows = self._rows
        if rows is not None and self.group_id in rows:
            rows[self.group_id] = row

    @property
    def phase(self) -> Phase:
        """Where the group is in its lifecycle."""
        return _PHASE[self.row()[_PHASE_AT]]

    @phase.setter
    def phase(self, phase: Phase) -> None:
        self._put(_PHASE_AT, _phase_value(phase))

    @property
    def siblings(self) -> tuple[SiblingState, ...]:
        """The siblings, in order (views: change one with :meth:`set_sibling`)."""
        view = SiblingState.from_row
        return tuple([view(row) for row in self.row()[_SIBLINGS_AT]])

    @property
    def size(self) -> int:
        """How many siblings the group has."""
        return len(self.row()[_SIBLINGS_AT])

    def sibling(self, index: int) -> SiblingState:
        """Sibling ``index`` (an IndexError when the group has no such sibling)."""
        return SiblingState.from_row(self.row()[_SIBLINGS_AT][index])

    def set_sibling(self, index: int, sibling: SiblingState) -> None:
        """Replace sibling ``index``'s row by ``sibling``'s."""
        row = self.row()
        rows = row[_SIBLINGS_AT]
        if not 0 <= index < len(rows):
            raise IndexError(f"group {self.group_id} has no sibling {index}")
        new = (*rows[:index], sibling.row(), *rows[index + 1 :])
        g, p, t, phase, _, rec, lender, step, staleness, order, data_pass = row
        self._store((g, p, t, phase, new, rec, lender, step, staleness, order, data_pass))

    def count(self, status: SiblingStatus) -> int:
        """Siblings with this status."""
        value = status.value
        return sum(1 for row in self.row()[_SIBLINGS_AT] if row[1] == value)

    def done_count(self) -> int:
        """Siblings with a completion."""
        return self.count(SiblingStatus.DONE)

    def oldest_version(self) -> int | None:
        """Oldest weight version among finished siblings (None when none finished)."""
        versions = [
            row[2] for row in self.row()[_SIBLINGS_AT] if row[1] == _DONE and row[2] is not None
        ]
        return min(versions) if versions else None

    # A value: equal when the rows are; a copy holds the row (in no table).
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GroupState):
            return NotImplemented
        return self.row() == other.row()

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass it replaces

    def __repr__(self) -> str:
        row = self.row()
        values: list[object] = list(row)
        values[_PHASE_AT] = _PHASE[row[_PHASE_AT]]
        body = ", ".join(f"{k}={v!r}" for k, v in zip(GROUP_FIELDS, values, strict=True))
        return f"GroupState({body})"

    def __copy__(self) -> GroupState:
        return GroupState.of_row(self.row())

    def __deepcopy__(self, memo: dict[int, Any]) -> GroupState:
        return GroupState.of_row(self.row())  # a row is immutable atoms: shared, not copied

    def __reduce__(self) -> tuple[Any, ...]:
        return (GroupState.of_row, (self.row(),))


_new_object = object.__new__
_MISSING = object()


def _view(rows: dict[int, GroupRow] | None, group_id: int, row: GroupRow) -> GroupState:
    view: GroupState = _new_object(GroupState)
    view.group_id = group_id
    view._rows = rows
    view._row = row
    return view


class GroupTable(MutableMapping[int, GroupState]):
    """``RunState.groups``: the live groups by id, stored as rows, read as views.

    A mapping of group id to :class:`GroupState` as the state's groups always were
    (``groups[gid]``, ``get``, ``values()``, ``items()``, ``del``, ``in``, ``len``), but
    it holds one :data:`GroupRow` per group, which CPython's collector does not track, and
    makes a view per group read. ``groups[gid] = group`` stores the group's row, and a
    view made by the constructor becomes a view of the table's row from then on.
    """

    __slots__ = ("_rows",)

    def __init__(self, groups: Mapping[int, GroupState] | None = None) -> None:
        self._rows: dict[int, GroupRow] = {}
        if groups is not None:
            for group_id, group in groups.items():
                self[group_id] = group

    @classmethod
    def of_rows(cls, rows: Iterable[GroupRow]) -> GroupTable:
        """A table of these rows (keyed by their group ids)."""
        table = cls()
        table._rows = {row[0]: row for row in rows}
        return table

    def row(self, group_id: int) -> GroupRow:
        """Group ``group_id``'s row (a KeyError when it is not live)."""
        return self._rows[group_id]

    def rows(self) -> Iterable[GroupRow]:
        """Every live group's row, in insertion order (no view made)."""
        return self._rows.values()

    def __getitem__(self, group_id: int) -> GroupState:
        rows = self._rows
        view: GroupState = _new_object(GroupState)  # _view, inlined: a read per command
        view.group_id = group_id
        view._rows = rows
        view._row = rows[group_id]
        return view

    @overload
    def get(self, group_id: int) -> GroupState | None: ...
    @overload
    def get(self, group_id: int, default: GroupState | _D) -> GroupState | _D: ...
    def get(self, group_id: int, default: object = None) -> object:
        """The group's view, or ``default`` when it is not live."""
        rows = self._rows
        row = rows.get(group_id)
        if row is None:
            return default
        view: GroupState = _new_object(GroupState)  # _view, inlined: a read per command
        view.group_id = group_id
        view._rows = rows
        view._row = row
        return view

    def __setitem__(self, group_id: int, group: GroupState) -> None:
        if not isinstance(group, GroupState):
            raise TypeError(f"groups hold GroupState values, not {type(group).__name__}")
        if group.group_id != group_id:
            raise ValueError(f"group {group.group_id} stored under id {group_id}")
        self._rows[group_id] = group.row()
        if group._rows is None:
            group._rows = self._rows  # the new group's view now reads the table

    def __delitem__(self, group_id: int) -> None:
        del self._rows[group_id]

    @overload
    def pop(self, group_id: int) -> GroupState: ...
    @overload
    def pop(self, group_id: int, default: GroupState | _D) -> GroupState | _D: ...
    def pop(self, group_id: int, default: object = _MISSING) -> object:
        """Remove the group and return its view (or ``default`` when it is not live)."""
        row = self._rows.pop(group_id, None)
        if row is None:
            if default is _MISSING:
                raise KeyError(group_id)
            return default
        return _view(None, group_id, row)

    def __iter__(self) -> Iterator[int]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._rows

    def keys(self) -> KeysView[int]:
        """The live group ids, in insertion order."""
        return self._rows.keys()

    def values(self) -> ValuesView[GroupState]:
        """A view per live group, in insertion order."""
        return _GroupValues(self)

    def items(self) -> ItemsView[int, GroupState]:
        """``(group_id, view)`` per live group, in insertion order."""
        return _GroupItems(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, GroupTable):
            return self._rows == other._rows
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"GroupTable({dict(self.items())!r})"

    def __copy__(self) -> GroupTable:
        return _table_of(dict(self._rows))

    def __deepcopy__(self, memo: dict[int, Any]) -> GroupTable:
        return _table_of(dict(self._rows))  # rows are immutable atoms: shared, not copied

    def __reduce__(self) -> tuple[Any, ...]:
        return (_table_of, (dict(self._rows),))


def _table_of(rows: dict[int, GroupRow]) -> GroupTable:
    table = GroupTable()
    table._rows = rows
    return table


class _GroupValues(ValuesView[GroupState]):
    __slots__ = ()
    _mapping: GroupTable

    def __iter__(self) -> Iterator[GroupState]:
        rows = self._mapping._rows
        for group_id, row in rows.items():
            yield _view(rows, group_id, row)


class _GroupItems(ItemsView[int, GroupState]):
    __slots__ = ()
    _mapping: GroupTable

    def __iter__(self) -> Iterator[tuple[int, GroupState]]:
        rows = self._mapping._rows
        for group_id, row in rows.items():
            yield group_id, _view(rows, group_id, row)


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
    #: The live groups by id: one untracked row per group (:class:`GroupTable`); a plain
    #: mapping of groups given here becomes one.
    groups: GroupTable = field(default_factory=GroupTable)
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

    def __post_init__(self) -> None:
        groups: Mapping[int, GroupState] = self.groups
        if not isinstance(groups, GroupTable):
            self.groups = GroupTable(groups)

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
        wanted = {p.value for p in phases}
        groups = self.groups
        return [groups[row[0]] for row in groups.rows() if row[_PHASE_AT] in wanted]

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
                data[name] = [row_plain(row) for row in value.rows()]
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
        groups = GroupTable.of_rows(
            GroupState(
                **{
                    **{k: v for k, v in g.items() if k != "siblings"},
                    "phase": Phase(g["phase"]),
                    "sibling_rows": tuple([_row_of(s) for s in g["siblings"]]),
                }
            )._row
            for g in data["groups"]
        )
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


def ready_index(groups: Mapping[int, GroupState]) -> dict[int, None]:
    """The ``RunState.ready`` index of ``groups``: READY group ids in commit order."""
    rows = groups.rows() if isinstance(groups, GroupTable) else [g.row() for g in groups.values()]
    ready = [row for row in rows if row[_PHASE_AT] == _READY]
    ready.sort(key=_ready_key)
    return dict.fromkeys(row[0] for row in ready)


def _ready_key(row: GroupRow) -> tuple[int, int]:
    order = row[_READY_ORDER_AT]
    return (order if order is not None else -1, row[0])


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
    return row_plain(group.row())


def row_plain(row: GroupRow) -> dict[str, Any]:
    """:func:`group_plain` of a group's row (the phase as its value, as JSON has it)."""
    data: dict[str, Any] = {}
    for i, name in enumerate(GROUP_FIELDS):
        if i == _SIBLINGS_AT:
            data["siblings"] = [dict(zip(_SIBLING_KEYS, r, strict=True)) for r in row[_SIBLINGS_AT]]
        else:
            data[name] = row[i]
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

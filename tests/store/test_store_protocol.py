"""The store contract as a type: both stores implement :class:`EventStoreProtocol` with
the same signatures, and the ``eventstore`` package names no rollout concept."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from rolloutlog.eventstore import EventStore, EventStoreProtocol, MemoryEventStore

#: The members of the contract (methods and attributes), read from the Protocol itself.
MEMBERS = sorted(
    name
    for name in {*vars(EventStoreProtocol), *EventStoreProtocol.__annotations__}
    if not name.startswith("_")
)


def test_the_protocol_is_the_documented_contract() -> None:
    assert {
        "create_run",
        "get_run",
        "list_runs",
        "open_epoch",
        "history_segments",
        "add_indexer",
        "append",
        "last_seq",
        "read",
        "read_history",
        "derived_rows",
        "save_snapshot",
        "load_snapshot",
        "put_payload",
        "get_payload",
        "close",
        "dialect",
        "readonly",
    } <= set(MEMBERS)


@pytest.mark.parametrize("impl", [EventStore, MemoryEventStore])
@pytest.mark.parametrize("name", [m for m in MEMBERS if callable(vars(EventStoreProtocol).get(m))])
def test_both_stores_implement_every_method_with_the_protocols_signature(
    impl: type, name: str
) -> None:
    want = inspect.signature(vars(EventStoreProtocol)[name])
    got = inspect.signature(getattr(impl, name))
    assert list(got.parameters) == list(want.parameters), f"{impl.__name__}.{name}"
    for param, spec in want.parameters.items():
        have = got.parameters[param]
        assert have.kind == spec.kind, f"{impl.__name__}.{name}({param})"
        assert have.default == spec.default, f"{impl.__name__}.{name}({param}) default"


def test_instances_are_protocol_instances(tmp_path: Path) -> None:
    memory = MemoryEventStore()
    with EventStore.open(f"sqlite:///{tmp_path / 'log.db'}") as sql:
        assert isinstance(sql, EventStoreProtocol)
        assert isinstance(memory, EventStoreProtocol)
        assert {sql.dialect, memory.dialect} == {"sqlite", "memory"}


#: Rollout concepts the generic store must not name (in code, schema or docs).
ROLLOUT_NAMES = (
    "RolloutController",
    "group_id",
    "prompt_index",
    "target_step",
    "train_step",
    "weight_version",
    "AuditKeys",
    "audit_keys",
)


def test_the_eventstore_package_names_no_rollout_concept() -> None:
    from rolloutlog import eventstore

    root = Path(eventstore.__file__).parent
    found = [
        f"{path.name}: {name}"
        for path in sorted(root.glob("*.py"))
        for name in ROLLOUT_NAMES
        if re.search(rf"\b{name}\b", path.read_text(encoding="utf-8"))
    ]
    assert found == []

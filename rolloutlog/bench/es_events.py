"""The domain's ``SiblingDispatched`` and ``SiblingCompleted`` as the ``eventsourcing``
library models them (frozen dataclasses), for the peer-library baseline of
``rolloutlog bench store``: the same fields, plus the train step that rolloutlog keeps
on the stored row.

A module of its own so that ``eventsourcing`` (an optional dependency, the ``bench``
extra) is imported only when the benchmark runs, and so the classes' topics resolve.
"""

from __future__ import annotations

from eventsourcing.domain import DomainEvent


class EsSiblingDispatched(DomainEvent):
    """A sibling was dispatched (eventsourcing's typed event)."""

    train_step: int
    group_id: int
    sibling: int
    attempt: int
    weight_version: int
    engine_id: str | None


class EsSiblingCompleted(DomainEvent):
    """A sibling completed (eventsourcing's typed event)."""

    train_step: int
    group_id: int
    sibling: int
    attempt: int
    weight_version: int
    prompt_tokens: int
    completion_tokens: int
    reward: float
    payload_id: str
    finish_reason: str
    salvaged_from: int | None
    engine_id: str | None

"""The benchmark's events as the ``eventsourcing`` library models them (frozen dataclasses).

A module of its own so that ``eventsourcing`` (an optional dependency, the ``bench``
extra) is imported only when the benchmark runs, and so the classes' topics resolve.
"""

from __future__ import annotations

from eventsourcing.domain import DomainEvent


class EsSiblingDispatched(DomainEvent):
    """A sibling was dispatched (eventsourcing's typed event)."""

    train_step: int
    group_id: int
    prompt_index: int
    target_step: int
    sibling: int
    attempt: int
    weight_version: int
    engine: str


class EsSiblingCompleted(DomainEvent):
    """A sibling completed (eventsourcing's typed event)."""

    train_step: int
    group_id: int
    prompt_index: int
    target_step: int
    sibling: int
    attempt: int
    weight_version: int
    prompt_tokens: int
    completion_tokens: int
    reward: float
    finish_reason: str
    payload_id: str

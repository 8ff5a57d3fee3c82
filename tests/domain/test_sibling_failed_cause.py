"""SiblingFailed says what failed (schema 2: ``cause``, generation or reward); a schema 1
row from an older log is upcast, its reason telling a reward failure apart."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from rolloutlog.controller.domain.events import CODEC, SiblingFailed
from rolloutlog.eventstore.records import StoredEvent


def _v1(reason: str) -> StoredEvent:
    payload = {"group_id": 3, "sibling": 1, "attempt": 2, "retryable": False, "reason": reason}
    return StoredEvent("r", 7, 1, "SiblingFailed", 1, json.dumps(payload), datetime.now(UTC))


def test_schema_1_rows_are_upcast_with_their_cause() -> None:
    reward = CODEC.decode(_v1("reward failed: ValueError: x"))
    assert isinstance(reward, SiblingFailed) and reward.cause == "reward"
    assert reward.reason == "reward failed: ValueError: x" and reward.attempt == 2
    engine = CODEC.decode(_v1("engine timed out"))
    assert isinstance(engine, SiblingFailed) and engine.cause == "generation"


def test_the_cause_round_trips_at_schema_2() -> None:
    event = SiblingFailed(
        group_id=1, sibling=0, attempt=1, retryable=False, reason="r", cause="reward"
    )
    assert SiblingFailed.schema_version == 2
    new = CODEC.encode(event, recorded_at=datetime.now(UTC))
    row = StoredEvent("r", 1, 1, new.type, new.schema_version, new.payload, datetime.now(UTC))
    assert CODEC.decode(row) == event

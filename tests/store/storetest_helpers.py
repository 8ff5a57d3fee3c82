"""Plain helpers shared by the event store contract tests (imported by the test modules)."""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from rolloutlog.eventstore import NewEvent

#: The helper script run as a child process by the crash and multi-process tests.
WORKER = Path(__file__).with_name("store_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
#: A fixed base time with microseconds; offsets keep every event's timestamp distinct.
T0 = datetime(2026, 11, 30, 12, 34, 56, 123456, tzinfo=UTC)


def make_event(i: int, **overrides: object) -> NewEvent:
    """Event ``i`` of a test log: every column set, all derived from ``i``."""
    fields: dict[str, object] = {
        "type": f"Type{i % 3}",
        "schema_version": 1 + i % 2,
        "payload": f'{{"i": {i}, "text": "é✓ {i}"}}',
        "recorded_at": T0 + timedelta(seconds=i, microseconds=i),
        "train_step": i // 4,
        "weight_version": i // 8,
        "group_id": i % 5,
        "prompt_index": 100 + i % 7,
        "target_step": i // 4 + 1,
    }
    fields.update(overrides)
    return NewEvent(**fields)  # type: ignore[arg-type]


def make_batch(start: int, n: int) -> list[NewEvent]:
    """Events ``start .. start + n - 1`` (by :func:`make_event`)."""
    return [make_event(i) for i in range(start, start + n)]


def worker_cmd(*args: str) -> list[str]:
    """Command line running ``store_worker.py`` with this interpreter."""
    return [sys.executable, str(WORKER), *args]

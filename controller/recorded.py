"""What a controller tells its listeners: the events of one executed command, as the log
recorded them.

The rows of one command share their metadata (the controller stamps them once, from the
same state): the time, the run's epoch, the steps trained and the weight version. A
listener folds them with exactly what a reader of the log would see, without reading
the rows back.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

from .domain.events import RolloutEvent


@dataclass(frozen=True, slots=True)
class RecordedEvents:
    """The events of one command at offsets ``first_offset, first_offset + 1, ...``, with
    the metadata their rows carry."""

    first_offset: int
    events: tuple[RolloutEvent, ...]
    recorded_at: datetime  # wall-clock UTC, the rows' recorded_at
    epoch: int  # the epoch that appended them
    train_step: int | None  # steps trained when they were recorded
    weight_version: int | None  # the trainer's weight version then

    @property
    def last_offset(self) -> int:
        """The offset of the command's last event."""
        return self.first_offset + len(self.events) - 1

    def pairs(self) -> Iterator[tuple[int, RolloutEvent]]:
        """``(offset, event)`` of each event, in log order."""
        return enumerate(self.events, self.first_offset)

"""The :class:`Committer` contract: batched durable appends of one run, offsets at once,
durability at ``flush``; and what every implementation shares (argument checks, the
bounded history of commit times).

Implemented by :class:`~rolloutlog.eventstore.groupcommit.GroupCommitter` (a thread of
this process) and :class:`~rolloutlog.eventstore.writer_process.ProcessCommitter` (a
child process); :func:`~rolloutlog.eventstore.groupcommit.open_committer` picks one.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Literal

from .records import NewEvent, PayloadPut

#: Where appends run: on the committer's thread, or in a child process.
CommitWriter = Literal["thread", "process"]


class Committer(abc.ABC):
    """Group commit of one run's appends: offsets at once, durability at :meth:`flush`.

    ``submit`` queues one command's events (and payloads) and returns the last offset it
    assigned; the events of one call always commit in the same transaction. ``flush`` /
    ``aflush`` return once everything submitted before them is durable, and raise
    :class:`GroupCommitClosedError` (its cause: the append's error) after a failed append:
    a committer that failed accepts nothing more, because later events would depend on
    lost ones.
    """

    #: Where the appends run.
    writer: CommitWriter
    run_id: str
    epoch: int
    _next_seq: int  # the offset the next submitted event gets

    @property
    def next_seq(self) -> int:
        """Sequence the next submitted event will get."""
        return self._next_seq

    @property
    @abc.abstractmethod
    def durable_seq(self) -> int:
        """Newest sequence known to be durable."""

    @property
    @abc.abstractmethod
    def commit_seconds(self) -> list[float]:
        """Seconds each committed transaction took (newest last; a bounded history)."""

    @abc.abstractmethod
    def submit(self, batch: Sequence[NewEvent], payload_puts: Sequence[PayloadPut] = ()) -> int:
        """Queue one command's events (and their payloads); return the last sequence."""

    @abc.abstractmethod
    def flush(self, timeout: float | None = None) -> int:
        """Block until every event submitted so far is durable; return the durable sequence."""

    @abc.abstractmethod
    async def aflush(self) -> int:
        """Await durability of everything submitted so far without blocking the event loop.

        Always a suspension point: when everything is durable already it still yields to
        the loop once, so a caller's commands on either side of an output commit do not
        run back to back while other tasks wait (with a writer process, commits are
        often done before the caller asks).
        """

    @abc.abstractmethod
    def close(self, *, flush: bool = True) -> None:
        """Stop appending, first making everything submitted durable (by default)."""


def check_committer_args(max_batch: int, window_s: float) -> None:
    """The batching parameters every committer takes, checked the same way."""
    if max_batch < 1:
        raise ValueError("max_batch must be >= 1")
    if window_s < 0:
        raise ValueError("window_s must be >= 0")


#: Bounded history of commit times a committer keeps (it drops the older half when full).
COMMIT_HISTORY = 10_000


def record_commit_seconds(history: list[float], seconds: float) -> None:
    """Append one transaction's time to ``history``, dropping the older half when full."""
    history.append(seconds)
    if len(history) > COMMIT_HISTORY:
        del history[: COMMIT_HISTORY // 2]

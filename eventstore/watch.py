"""Waking readers that tail the log when an append commits.

On PostgreSQL every append statement ends with ``pg_notify`` on
:data:`rolloutlog.eventstore.pg_append.CHANNEL` (delivered when it commits), so an
:class:`AppendWatcher` holds one connection that ``LISTEN``s and its :meth:`wait` returns
as soon as any append commits. SQLite has no notifications: :meth:`wait` sleeps out its
timeout (the caller's poll interval), exactly the polling it replaces.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any

from .errors import StoreUnavailableError
from .pg_append import CHANNEL, parse_notify, pg_connect_url

if TYPE_CHECKING:
    from .store import EventStore

#: Longest one blocking wait for a notification (a stop is noticed within it).
_SLICE_S = 0.25


class AppendWatcher:
    """Blocks until an append commits (PostgreSQL) or a timeout passes (any store)."""

    def __init__(self, store: Any, stop: threading.Event | None = None) -> None:
        self.store = store
        #: Set it (from any thread) to end a :meth:`wait` early.
        self._stop = stop if stop is not None else threading.Event()
        self._conn: Any = None
        #: Whether waits end on notifications (False: they only time out, i.e. polling).
        self.listening = False
        if getattr(store, "dialect", None) == "postgresql":
            self._conn = _listen(store)
            self.listening = True

    def wait(self, timeout: float) -> dict[str, int]:
        """Wait up to ``timeout`` seconds; return ``{run_id: last_seq}`` of the appends
        that committed meanwhile (empty after a timeout, or always when polling)."""
        if self._conn is None:
            self._stop.wait(timeout)
            return {}
        seen: dict[str, int] = {}
        deadline = time.monotonic() + timeout
        try:
            # In slices, so a stop set from another thread ends the wait soon.
            while not seen and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for note in self._conn.notifies(timeout=min(left, _SLICE_S), stop_after=1):
                    _note(seen, note.payload)
            # Drain what else arrived with it without waiting again.
            for note in self._conn.notifies(timeout=0):
                _note(seen, note.payload)
        except Exception as exc:  # the server went away: fall back to polling, say why
            self.close()
            raise StoreUnavailableError(f"listening for appends failed: {exc}") from exc
        return seen

    def close(self) -> None:
        """Stop listening. Call it from the thread that waits (the connection is not
        shared between threads)."""
        self._stop.set()
        conn, self._conn = self._conn, None
        self.listening = False
        if conn is not None:
            with contextlib.suppress(Exception):  # best effort: the connection may be gone
                conn.close()


def _note(seen: dict[str, int], payload: str) -> None:
    parsed = parse_notify(payload)
    if parsed is not None:
        seen[parsed[0]] = max(seen.get(parsed[0], 0), parsed[1])


def _listen(store: EventStore) -> Any:
    """A psycopg autocommit connection that LISTENs on the append channel."""
    import psycopg

    url = store.url
    # The URL's own query options (sslmode, ...) as libpq keywords, after rolloutlog's name.
    options: dict[str, Any] = {"application_name": "rolloutlog append watcher"}
    options.update(pg_connect_url(url).query)
    conn = psycopg.connect(
        host=url.host,
        port=url.port,
        user=url.username,
        password=url.password,
        dbname=url.database,
        autocommit=True,
        connect_timeout=10,
        **options,
    )
    conn.execute(f"LISTEN {CHANNEL}")
    return conn

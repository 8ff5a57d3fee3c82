"""Child process of the crash, multi-process and read-only tests (not a test module).

Usage::

    store_worker.py crash URL RUN BATCH PAD
        Append batches of BATCH events (each payload names its own sequence, padded with
        PAD bytes) forever; after each acknowledged append print its last sequence and
        flush stdout. The parent SIGKILLs it at a random moment.
    store_worker.py contend URL RUN WRITER N BATCH
        Append N batches of BATCH events tagged with WRITER, competing with other
        processes: read last_seq, append with expected_seq = last + 1, retry on
        AppendConflictError. Print {"wins": N, "conflicts": C} as JSON.
    store_worker.py readonly-as-nobody PATH RUN [SHARED]
        Load every module first, drop to uid/gid 65534 (nobody), then try to open the
        SQLite file PATH for writing and read-only; print what happened as JSON.
        SHARED: a world-readable folder holding a copy of ``migrations/`` (the store
        reads it on every open), imported instead of the checkout's, which nobody may
        not be able to read (a clone inside a 0700 folder).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rolloutlog.eventstore import AppendConflictError, EventStore, NewEvent


def crash(url: str, run_id: str, batch: int, pad: int) -> None:
    store = EventStore.open(url)
    info = store.get_run(run_id)
    nxt = info.last_seq + 1
    filler = "x" * pad
    while True:
        now = datetime.now(UTC)
        events = [
            NewEvent("Crash", 1, json.dumps({"seq": s, "pad": filler}), now)
            for s in range(nxt, nxt + batch)
        ]
        last = store.append(run_id, events, expected_seq=nxt, epoch=info.current_epoch)
        print(last, flush=True)
        nxt = last + 1


def contend(url: str, run_id: str, writer: int, n: int, batch: int) -> None:
    store = EventStore.open(url)
    epoch = store.get_run(run_id).current_epoch
    wins = conflicts = 0
    while wins < n:
        nxt = store.last_seq(run_id) + 1
        now = datetime.now(UTC)
        events = [
            NewEvent("Contend", 1, json.dumps({"w": writer, "k": wins, "j": j}), now)
            for j in range(batch)
        ]
        try:
            store.append(run_id, events, expected_seq=nxt, epoch=epoch)
        except AppendConflictError:
            conflicts += 1
            continue
        wins += 1
    store.close()
    print(json.dumps({"wins": wins, "conflicts": conflicts}), flush=True)


def readonly_as_nobody(path: str, run_id: str, shared: str | None = None) -> None:
    if shared is not None:
        # The checkout may be out of nobody's reach: alembic reads the copies in SHARED.
        import rolloutlog.migrations
        from rolloutlog.eventstore import schema_head

        root = Path(shared)
        schema_head.migrations_dir = lambda: root / "migrations"  # type: ignore[assignment]
        rolloutlog.migrations.version_locations = lambda script_dir: [  # type: ignore[assignment]
            script_dir / "versions",
            root / "index_migrations",
        ]
        os.chdir(shared)
    # Import everything the store loads lazily while still root: nobody cannot read the
    # interpreter's files under /root.
    warm = tempfile.mkdtemp()
    EventStore.open(f"sqlite:///{warm}/warm.db").close()
    os.setgid(65534)
    os.setuid(65534)
    out: dict[str, object] = {"writable": os.access(path, os.W_OK)}
    try:
        EventStore.open(f"sqlite:///{path}").close()
        out["open_rw"] = "opened"
    except Exception as exc:
        out["open_rw"] = [type(exc).__name__, str(exc)]
    store = EventStore.open(f"sqlite:///{path}", readonly=True)
    out["last_seq"] = store.last_seq(run_id)
    out["payloads"] = [e.payload for e in store.read(run_id)]
    try:
        store.append(
            run_id,
            [NewEvent("T", 1, "{}", datetime.now(UTC))],
            expected_seq=out["last_seq"] + 1,  # type: ignore[operator]
            epoch=1,
        )
        out["append"] = "appended"
    except Exception as exc:
        out["append"] = [type(exc).__name__, str(exc)]
    store.close()
    print(json.dumps(out), flush=True)


def main(argv: list[str]) -> None:
    mode, *args = argv
    if mode == "crash":
        crash(args[0], args[1], int(args[2]), int(args[3]))
    elif mode == "contend":
        contend(args[0], args[1], int(args[2]), int(args[3]), int(args[4]))
    elif mode == "readonly-as-nobody":
        readonly_as_nobody(args[0], args[1], args[2] if len(args) > 2 else None)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])

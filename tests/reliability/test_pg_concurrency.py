"""PostgreSQL under concurrent use (docs/operations.md: several runs, audit readers and metrics
exporters on one database at once).

One writer process appends a run while reader threads page through the log, audit
readers run the SQL views and a metrics LogTailer polls: no reader ever sees a skipped
or duplicated event, audit results agree with a later full read, and the tailer ends
equal to an offline projection. Several runs written at once by different processes
each end contiguous, with their invariants and ledger intact.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from reliability_harness import Worker, exactly_once

from rolloutlog.controller.metrics.live import LogTailer
from rolloutlog.controller.metrics.projection import project_history
from rolloutlog.controller.replay_tool import check_history
from rolloutlog.controller.sql_audit import SqlAudit
from rolloutlog.eventstore import EventStore

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def _loop(stop: threading.Event, errors: list[str], body: Callable[[], None]) -> int:
    rounds = 0
    while not stop.is_set():
        try:
            body()
        except Exception as exc:  # collected and asserted on by the test
            errors.append(f"{type(exc).__name__}: {exc}")
            return rounds
        rounds += 1
    return rounds


def test_readers_audits_and_tailer_during_a_live_run(pg_url: str) -> None:
    writer = Worker(pg_url, "r", "start", 25)
    stop = threading.Event()
    errors: list[str] = []
    audits: list[dict[str, Any]] = []
    staleness: list[list[dict[str, Any]]] = []
    rounds: dict[str, int] = {}
    store: EventStore | None = None
    tailer: LogTailer | None = None
    try:
        writer.wait_for("READY")
        store = EventStore.open(pg_url, create=False)
        tailer = LogTailer(store, "r", interval=0.02)

        def read_prefix(page: int, history: bool) -> Callable[[], None]:
            def body() -> None:
                assert store is not None
                rows = (
                    list(store.read_history("r"))
                    if history
                    else list(store.read("r", page_size=page))
                )
                seqs = [r.seq for r in rows]
                assert seqs == list(range(1, len(seqs) + 1)), f"gap or duplicate in {seqs[-20:]}"
                assert len(seqs) >= 1

            return body

        def audit_body() -> None:
            with SqlAudit(pg_url) as audit:
                row = audit.summary("r").rows[0]
                steps = audit.staleness("r").rows
            audits.append(row)
            staleness.append(steps)

        tailer.start()
        bodies = {
            "read-7": read_prefix(7, False),
            "read-50": read_prefix(50, False),
            "read-2000": read_prefix(2000, False),
            "history": read_prefix(0, True),
            "audit-1": audit_body,
            "audit-2": audit_body,
        }
        threads = [
            threading.Thread(
                target=lambda n=name, b=body: rounds.__setitem__(n, _loop(stop, errors, b))
            )
            for name, body in bodies.items()
        ]
        for t in threads:
            t.start()
        assert writer.finish(timeout=120) == 0, writer.stderr[-2000:]
        stop.set()
        for t in threads:
            t.join(60)
        tailer.close()
        assert errors == [], errors[:3]
        assert all(n > 0 for n in rounds.values()), rounds
        assert tailer.errors == 0, tailer.last_error

        last = store.last_seq("r")
        assert [r.seq for r in store.read("r")] == list(range(1, last + 1))
        history = list(store.read_history("r"))
        trained = sum(1 for r in history if r.type == "StepTrained")
        assert trained == 25
        # Every audit snapshot is a prefix of the final log; the final one equals it.
        with SqlAudit(pg_url) as audit:
            final = audit.summary("r").rows[0]
            final_steps = {s["train_step"]: s for s in audit.staleness("r").rows}
        assert final["last_seq"] == last and final["history_events"] == len(history)
        assert final["steps_trained"] == trained
        for snap, steps in zip(audits, staleness, strict=True):
            assert snap["last_seq"] <= last and snap["steps_trained"] <= trained
            assert snap["history_events"] == snap["last_seq"]
            for s in steps:
                if s["trained"]:
                    assert s == final_steps[s["train_step"]], (s, final_steps[s["train_step"]])
        # The tailer caught up equals the offline projection of the whole log.
        tailer.poll()
        assert tailer.follower.projection.offset == last
        follower = tailer.follower
        offline = project_history(store, "r").values()
        assert follower.projection.values(work=follower.work) == offline
        assert check_history(store, "r").violation is None
    finally:
        stop.set()
        if tailer is not None:
            tailer.close()
        writer.kill()
        if store is not None:
            store.close()


def test_several_runs_written_at_once_by_different_processes(pg_url: str) -> None:
    EventStore.open(pg_url).close()  # the schema first, so the writers do not race for it
    runs = [f"run-{i}" for i in range(3)]
    workers = [Worker(pg_url, rid, "start", 8) for rid in runs]
    try:
        for w in workers:
            assert w.finish(timeout=120) == 0, w.stderr[-2000:]
            assert w.lines[-1] == "DONE"
    finally:
        for w in workers:
            w.kill()
    with EventStore.open(pg_url) as store:
        assert sorted(r.run_id for r in store.list_runs()) == runs
        for rid, w in zip(runs, workers, strict=True):
            last = store.last_seq(rid)
            rows = list(store.read(rid))
            assert [r.seq for r in rows] == list(range(1, last + 1)), rid
            assert {r.run_id for r in rows} == {rid}
            assert max(w.acks()) <= last
            assert check_history(store, rid).violation is None
            result = exactly_once(store, rid)
            assert result["lost"] == () and result["trained_twice"] == (), (rid, result)
            assert sum(1 for r in rows if r.type == "StepTrained") == 8

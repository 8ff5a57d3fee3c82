"""Crash atomicity with real process kills: a batch is all there or not at all.

A child process (``store_worker.py crash``) appends large batches in a loop and prints
every acknowledged last sequence; the parent SIGKILLs it at a random moment, reopens
the store and checks the log: no acknowledged event lost, no torn batch, no gap.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from storetest_helpers import REPO_ROOT, worker_cmd

from rolloutlog.eventstore import EventStore
from rolloutlog.eventstore.pg_append import pg_connect_url

BATCH = 300
PAD = 400  # bytes of padding per event: ~120 KB per transaction


def _run_and_kill(url: str, rng: random.Random, errlog: Path) -> list[int]:
    """Start a crash writer, SIGKILL it after a few acknowledged batches; return the acks."""
    with errlog.open("w") as err:
        child = subprocess.Popen(
            worker_cmd("crash", url, "crash", str(BATCH), str(PAD)),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=REPO_ROOT,
        )
    acks: list[int] = []
    first_ack = threading.Event()

    def pump() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            acks.append(int(line))
            first_ack.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        if not first_ack.wait(60):
            raise AssertionError(f"the writer never acknowledged: {errlog.read_text()[-3000:]}")
        wanted = rng.randint(1, 6)
        deadline = time.monotonic() + 30
        while len(acks) < wanted and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.001)
        time.sleep(rng.uniform(0, 0.03))  # land anywhere, mostly inside a transaction
        assert child.poll() is None, f"the writer died: {errlog.read_text()[-3000:]}"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
    reader.join(30)
    assert child.returncode == -signal.SIGKILL
    assert acks and acks == sorted(acks), acks
    return acks


def _kill_rounds(url: str, rounds: int, seed: int, tmp: Path) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    with EventStore.open(url) as store:
        store.create_run("crash")
    history: list[tuple[int, int]] = []  # (max acknowledged seq, last_seq after reopen)
    for round_no in range(rounds):
        acks = _run_and_kill(url, rng, tmp / f"writer-{round_no}.err")
        with EventStore.open(url) as store:
            last = store.last_seq("crash")
            engine = sa.create_engine(pg_connect_url(sa.engine.make_url(url)))
            with engine.connect() as conn:
                count = conn.execute(
                    sa.text("SELECT COUNT(*) FROM events WHERE run_id = 'crash'")
                ).scalar_one()
                if url.startswith("sqlite"):
                    assert conn.exec_driver_sql("PRAGMA integrity_check").scalar_one() == "ok"
            engine.dispose()
            assert count == last, f"round {round_no}: {count} rows but last_seq {last}"
            assert last >= acks[-1], f"round {round_no}: acknowledged {acks[-1]}, log has {last}"
            assert last % BATCH == 0, f"round {round_no}: torn batch, last_seq {last}"
            seqs = []
            for ev in store.read("crash"):
                assert json.loads(ev.payload)["seq"] == ev.seq
                seqs.append(ev.seq)
            assert seqs == list(range(1, last + 1))
        if history:
            assert last >= history[-1][1]
        history.append((acks[-1], last))
    return history


@pytest.mark.slow
def test_sigkill_never_tears_a_batch_sqlite(sqlite_url: str, tmp_path: Path) -> None:
    history = _kill_rounds(sqlite_url, rounds=10, seed=20261130, tmp=tmp_path)
    assert len(history) == 10
    assert history[-1][1] >= 10 * BATCH  # every round acknowledged at least one batch


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.parametrize("chunk", [0, 250, 7], ids=["one-statement", "pipeline-2", "pipeline-43"])
def test_sigkill_never_tears_a_batch_postgres(pg_url: str, tmp_path: Path, chunk: int) -> None:
    # A batch of 300 events as one statement, or pipelined in 2 or 43 statements.
    history = _kill_rounds(f"{pg_url}?append_chunk_events={chunk}", rounds=3, seed=7, tmp=tmp_path)
    assert history[-1][1] >= 3 * BATCH

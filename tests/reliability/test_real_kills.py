"""Real kills: SIGKILL a live run process at random moments (inside group commits too);
every reopen succeeds and no event that flush() acknowledged is missing."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rolloutlog.controller.domain.invariants import check_invariants
from rolloutlog.controller.replay_tool import check_history
from rolloutlog.controller.rollout_controller import replay
from rolloutlog.eventstore import EventStore

WORKER = Path(__file__).with_name("kill_worker.py")
KILLS = int(os.environ.get("ROLLOUTLOG_KILLS", "100"))


def _spawn(url: str, mode: str, steps: int = 1_000_000) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), url, "r", mode, str(steps)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _kill_at_random(proc: subprocess.Popen[str], rng: random.Random) -> tuple[int, str]:
    """Wait for READY, let it run a random while, SIGKILL it; return the highest ACK."""
    assert proc.stdout is not None
    acked = 0
    ready = proc.stdout.readline()
    while ready.startswith("ACK"):
        acked = max(acked, int(ready.split()[1]))
        ready = proc.stdout.readline()
    if not ready.startswith("READY"):
        proc.kill()
        err = proc.stderr.read() if proc.stderr else ""
        raise AssertionError(f"worker did not start: {ready!r} {err[-2000:]}")
    deadline = time.monotonic() + rng.uniform(0.05, 0.8)
    os.set_blocking(proc.stdout.fileno(), False)
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("ACK"):
            acked = max(acked, int(line.split()[1]))
        elif not line:
            time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # Anything printed before the kill is an acknowledgement too.
    for line in proc.stdout.read().splitlines() if proc.stdout else []:
        if line.startswith("ACK"):
            acked = max(acked, int(line.split()[1]))
    proc.stdout.close()
    if proc.stderr:
        proc.stderr.close()
    return acked, ready.strip()


def _kill_loop(url: str, kills: int, seed: int) -> None:
    rng = random.Random(seed)
    highest_ack = 0
    for i in range(kills):
        proc = _spawn(url, "start" if i == 0 else "open")
        acked, ready = _kill_at_random(proc, rng)
        highest_ack = max(highest_ack, acked)
        store = EventStore.open(url)  # every reopen succeeds
        try:
            last = store.last_seq("r")
            assert last >= highest_ack, (
                f"kill {i}: flush() acknowledged offset {highest_ack} but the log ends at {last}"
            )
            seqs = [e.seq for e in store.read("r")]
            assert seqs == list(range(1, last + 1)), f"kill {i}: the log has gaps"
            state = replay(store, "r").state
            check_invariants(state)
            assert state.epoch == store.get_run("r").current_epoch, ready
        finally:
            store.close()
    store = EventStore.open(url)
    try:
        assert store.get_run("r").current_epoch == kills  # one epoch per process
        assert check_history(store, "r").violation is None
        assert store.last_seq("r") > 0
    finally:
        store.close()


@pytest.mark.slow
def test_sigkill_loop_sqlite(sqlite_url: str) -> None:
    _kill_loop(sqlite_url, KILLS, seed=1)


@pytest.mark.slow
@pytest.mark.postgres
def test_sigkill_loop_postgres(pg_url: str) -> None:
    _kill_loop(pg_url, max(10, KILLS // 10), seed=2)

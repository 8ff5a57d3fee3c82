"""Real kills: SIGKILL a live run process at random moments (inside group commits too);
every reopen succeeds and no event that flush() acknowledged is missing."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
from reliability_harness import ForkServer, Worker

from rolloutlog.controller.domain.invariants import check_invariants
from rolloutlog.controller.replay_tool import check_history
from rolloutlog.controller.rollout_controller import replay
from rolloutlog.eventstore import EventStore

KILLS = int(os.environ.get("ROLLOUTLOG_KILLS", "100"))
#: Longest a worker may take to start (imports on a loaded machine) before the test fails.
START_TIMEOUT_S = 180.0


def _kill_at_random(url: str, mode: str, rng: random.Random, forks: ForkServer) -> tuple[int, str]:
    """Wait for READY, let it run a random while, SIGKILL it; return the highest ACK.

    Every wait has a deadline and a failure names the worker's stderr (a bare
    ``readline()`` once blocked a loaded machine's run until the suite's timeout).
    """
    worker = Worker(url, "r", mode, 1_000_000, forks=forks)
    try:
        ready = worker.wait_for("READY", timeout=START_TIMEOUT_S)
        # The kill moment is random on purpose: inside group commits, between them.
        time.sleep(rng.uniform(0.05, 0.8))
        worker.kill()
        # Anything printed before the kill is an acknowledgement too (the reader thread
        # has read the pipe to its end).
        return max(worker.acks(), default=0), ready
    finally:
        worker.kill()


def _kill_loop(url: str, kills: int, seed: int) -> None:
    rng = random.Random(seed)
    highest_ack = 0
    # Each worker is forked from one process that did the imports (torch, rolloutlog) once:
    # a kill no longer pays an interpreter's start-up, the killed process is the same.
    with ForkServer(start_timeout=START_TIMEOUT_S) as forks:
        for i in range(kills):
            acked, ready = _kill_at_random(url, "start" if i == 0 else "open", rng, forks)
            highest_ack = max(highest_ack, acked)
            store = EventStore.open(url)  # every reopen succeeds
            try:
                last = store.last_seq("r")
                assert last >= highest_ack, (
                    f"kill {i}: flush() acknowledged offset {highest_ack} "
                    f"but the log ends at {last}"
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
@pytest.mark.parametrize("part", range(4))
def test_sigkill_loop_sqlite(sqlite_url: str, part: int) -> None:
    """KILLS kills in all, in four logs of their own (so parallel workers share them)."""
    _kill_loop(sqlite_url, max(1, KILLS // 4), seed=1 + 10 * part)


@pytest.mark.slow
@pytest.mark.postgres
def test_sigkill_loop_postgres(pg_url: str) -> None:
    _kill_loop(pg_url, max(10, KILLS // 10), seed=2)


def test_a_hung_worker_fails_within_its_deadline(sqlite_url: str) -> None:
    """A worker that never gets to READY fails the wait with its output, it does not hang."""
    worker = Worker(sqlite_url, "r", "start", 1)
    try:
        os.kill(worker.proc.pid, signal.SIGSTOP)  # hung before it could print anything
        started = time.monotonic()
        with pytest.raises(AssertionError, match=r"no 'READY' line within 1.0s; start worker"):
            worker.wait_for("READY", timeout=1.0)
        assert time.monotonic() - started < 10
    finally:
        worker.kill()
    assert worker.proc.returncode == -signal.SIGKILL


def test_a_hung_fork_server_fails_within_its_deadline(sqlite_url: str) -> None:
    """The kill loop's fork server, hung before it forks, fails the worker's start within
    its deadline instead of blocking the test (once forked, a worker is waited on as above)."""
    with ForkServer(start_timeout=1.0) as forks:
        try:
            os.kill(forks.proc.pid, signal.SIGSTOP)
            started = time.monotonic()
            with pytest.raises(AssertionError, match=r"forked no worker within 1.0s"):
                Worker(sqlite_url, "r", "start", 1, forks=forks)
            assert time.monotonic() - started < 10
        finally:
            os.killpg(forks.proc.pid, signal.SIGKILL)
    assert forks.proc.returncode == -signal.SIGKILL

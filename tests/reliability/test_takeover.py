"""Fencing and takeover with real processes (docs/concepts.md: epoch fencing).

Process A runs a long run; process B restores it from its newest checkpoint (or opens
it where it stands) while A is running, or while A is frozen (SIGSTOP: a zombie
controller that wakes up after the takeover). A must exit FENCED with a message naming
both epochs, none of A's appends after B's epoch opened may be in the log, B finishes
its steps, the invariants hold and the prompt ledger shows nothing lost or trained twice.
Two restores racing (in-process, meeting at open_epoch): exactly one wins.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
from reliability_harness import Worker, drive, exactly_once, run, start

from rolloutlog.controller.config import StoreConfig
from rolloutlog.controller.replay_tool import check_history
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_index import read_history_indexed
from rolloutlog.eventstore import EpochFencedError, EventStore

OPENER = {"restore": "RunRestored", "open": "RunResumed"}


def _newest_checkpoint_step(url: str) -> int:
    with EventStore.open(url) as store:
        rows = [r for r in read_history_indexed(store, "r") if r.type == "CheckpointMarked"]
        return max(r.train_step or 0 for r in rows) if rows else 0


def _check_takeover(url: str, loser: Worker, winner: Worker, mode: str, epoch: int) -> None:
    """The log after ``winner`` took the run over from ``loser`` at ``epoch``."""
    with EventStore.open(url) as store:
        info = store.get_run("r")
        assert info.current_epoch == epoch
        rows = list(store.read("r"))
        assert [r.seq for r in rows] == list(range(1, info.last_seq + 1))
        first_new = next(r.seq for r in rows if r.epoch == epoch)
        assert rows[first_new - 1].type == OPENER[mode], rows[first_new - 1]
        # Before the takeover only older epochs; after it only the new one: none of the
        # fenced writer's appends got in once the new epoch was open.
        assert all(r.epoch < epoch for r in rows[: first_new - 1])
        assert all(r.epoch == epoch for r in rows[first_new - 1 :])
        assert max(loser.acks(), default=0) < first_new
        # (a winner that found its step target already reached acknowledges nothing)
        assert min(winner.acks(), default=first_new) >= first_new
        assert check_history(store, "r").violation is None
        result = exactly_once(store, "r")
        assert result["lost"] == () and result["trained_twice"] == (), result
        assert result["violations"] == []
        assert result["trained"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["restore", "open"])
@pytest.mark.parametrize("a_state", ["running", "frozen"])
def test_takeover_fences_the_old_process(db_url: str, mode: str, a_state: str) -> None:
    a = Worker(db_url, "r", "start", 10**6)
    b: Worker | None = None
    try:
        a.wait_for("READY")
        a.wait_for("ACK", count=8)  # a few steps trained and checkpointed
        # A is frozen while B starts (imports), so B's step target is known; "running":
        # A resumes while B is still starting and races it through the takeover.
        os.kill(a.proc.pid, signal.SIGSTOP)
        steps = _newest_checkpoint_step(db_url) + (12 if a_state == "frozen" else 300)
        b = Worker(db_url, "r", mode, steps)
        if a_state == "running":
            time.sleep(0.3)
            os.kill(a.proc.pid, signal.SIGCONT)
        woke_a_early = a_state == "running"
        try:
            ready = b.wait_for("READY", timeout=10)
        except AssertionError:
            # The frozen A may hold the write lock mid-transaction: let it commit. It may
            # then run past B's target before B takes over.
            os.kill(a.proc.pid, signal.SIGCONT)
            woke_a_early = True
            ready = b.wait_for("READY", timeout=180)
        finally:
            if a_state == "frozen":
                os.kill(a.proc.pid, signal.SIGCONT)  # the zombie wakes up after the takeover
        assert ready.startswith("READY epoch=2"), ready
        b_step = int(ready.split("step=")[1])
        if not woke_a_early:
            assert b_step < steps
        rc_a = a.finish(timeout=90)
        fenced = [x for x in a.lines if x.startswith("FENCED")]
        assert rc_a == 3 and fenced, (rc_a, a.lines[-3:], a.stderr[-2000:])
        assert "holds epoch 1 but the run is at epoch 2" in fenced[0], fenced[0]
        # "running": B may have up to 300 steps to train, each checkpointed and synced.
        assert b.finish(timeout=300) == 0, b.stderr[-2000:]
        assert b.lines[-1] == "DONE"
        _check_takeover(db_url, a, b, mode, 2)
        if b_step < steps:  # B trained up to its target
            assert _newest_checkpoint_step(db_url) == steps
    finally:
        if a.proc.poll() is None:
            os.kill(a.proc.pid, signal.SIGCONT)
        a.kill()
        if b is not None:
            b.kill()


def test_two_restores_racing_in_process_exactly_one_wins(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both restores pass replay and checks, then meet at open_epoch: one wins."""
    with EventStore.open(db_url) as store:
        ctl = start(store)
        run(drive(ctl, 3))
        ctl.close()
        offset = max(r.seq for r in store.read("r") if r.type == "CheckpointMarked")
    barrier = threading.Barrier(2, timeout=30)
    original = EventStore.open_epoch

    def open_epoch(self: EventStore, *args: Any, **kwargs: Any) -> int:
        barrier.wait()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(EventStore, "open_epoch", open_epoch)
    outcomes: list[object] = [None, None]
    stores = [EventStore.open(db_url) for _ in range(2)]

    def restore(i: int) -> None:
        try:
            outcomes[i] = RolloutController.restore(
                stores[i], "r", offset, store_config=StoreConfig(group_commit_window_ms=1)
            )[0]
        except Exception as exc:  # the loser's error is the assertion below
            outcomes[i] = exc

    threads = [threading.Thread(target=restore, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        winners = [o for o in outcomes if isinstance(o, RolloutController)]
        losers = [o for o in outcomes if isinstance(o, EpochFencedError)]
        assert len(winners) == 1 and len(losers) == 1, outcomes
        assert "holds epoch 1 but the run is at epoch 2" in str(losers[0])
        monkeypatch.setattr(EventStore, "open_epoch", original)
        ctl = winners[0]
        run(drive(ctl, 5))
        ctl.close()
        with EventStore.open(db_url) as store:
            assert store.get_run("r").current_epoch == 2
            assert check_history(store, "r").violation is None
            result = exactly_once(store, "r")
            assert result["lost"] == () and result["trained_twice"] == (), result
    finally:
        for s in stores:
            s.close()

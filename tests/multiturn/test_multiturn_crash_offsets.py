"""Crash a multi-turn run at many offsets, then restore it and let it finish. No tool
runs twice, no completed model call is regenerated, every trajectory's mask and versions
agree with its turns, and every prompt is trained exactly once.

- In memory, at every offset k (every 6th; all with ``ROLLOUTLOG_CRASH_ALL=1``): the log
  a crash at k left (cut from a finished run's log), the tools whose request is durable
  by k ran (the harder case: a run without its result).
- On PostgreSQL, at a seeded random sample of offsets (``ROLLOUTLOG_CRASH_SEED``): a live
  run in a forked child process SIGKILLs itself right after the commit that reaches the
  offset (the tools it ran are its own), and a fresh controller in this process restores
  from what PostgreSQL holds.

Both come back from the newest checkpoint in the log.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
import traceback
import warnings
from pathlib import Path

import pytest
import sqlalchemy as sa
from mt_crash import (
    check,
    drive,
    failed,
    model_calls_reused,
    ran_by_the_crash,
    run_until_killed,
)
from mt_task import ROLLOUT, RUN, STORE, Ledger, Prompts, start

from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_index import attach as attach_index
from rolloutlog.controller.rollout_index import read_indexed
from rolloutlog.eventstore import EventStore, MemoryEventStore, NewEvent

#: How many offsets the PostgreSQL variant crashes at (each a forked child).
PG_CRASHES = 6
WORKER_DEADLINE_S = 120


@pytest.fixture(scope="module")
def base_log(tmp_path_factory: pytest.TempPathFactory) -> MemoryEventStore:
    store = MemoryEventStore()
    ctl = start(store)
    ctl.checkpoint(0)
    asyncio.run(drive(ctl, Ledger(tmp_path_factory.mktemp("base") / "ledger.tsv")))
    ctl.close()
    return store


def _crashed_at(base: MemoryEventStore, k: int, ledger: Ledger) -> tuple[MemoryEventStore, int]:
    """The log a crash at k left, its payloads, and the ledger of the tools that ran by
    then; the offset of the newest checkpoint at or before k."""
    info = base.get_run(RUN)
    target = MemoryEventStore()
    target.create_run(RUN, config_fingerprint=info.config_fingerprint, config_json=info.config_json)
    rows = list(read_indexed(base, RUN, 1, k))
    attach_index(target)  # the index is written with its events, as the controller's store does
    target.append(
        RUN,
        [
            NewEvent(
                r.type,
                r.schema_version,
                r.payload,
                r.recorded_at,
                (r.group_id, r.prompt_index, r.target_step, r.train_step, r.weight_version),
            )
            for r in rows
        ],
        expected_seq=1,
        epoch=1,
    )
    for r in base.read(RUN, 1, k):
        pid = json.loads(r.payload).get("payload_id")
        if pid:
            target.put_payload(RUN, pid, "x", base.get_payload(RUN, pid))
    checkpoint = ran_by_the_crash(base.read(RUN, 1, k), ledger)
    assert checkpoint, f"no checkpoint at or before {k}"
    return target, checkpoint


def _restore_and_finish(store: object, checkpoint: int, ledger: Ledger) -> None:
    ctl, _ = RolloutController.restore(
        store,  # type: ignore[arg-type]
        RUN,
        checkpoint,
        rollout=ROLLOUT,
        dataset_fingerprint=Prompts.fingerprint,
        store_config=STORE,
    )
    asyncio.run(drive(ctl, ledger))
    ctl.close()


def _offsets(base: MemoryEventStore) -> list[int]:
    stride = 1 if os.environ.get("ROLLOUTLOG_CRASH_ALL") else 6
    return list(range(3, base.last_seq(RUN) + 1, stride))


@pytest.mark.slow
def test_crash_a_multi_turn_run_at_many_offsets(base_log: MemoryEventStore, tmp_path: Path) -> None:
    offsets = _offsets(base_log)
    assert len(offsets) > 30
    failures = []
    salvaged = 0
    for k in offsets:
        ledger = Ledger(tmp_path / f"ledger-{k}.tsv")
        crashed, checkpoint = _crashed_at(base_log, k, ledger)
        _restore_and_finish(crashed, checkpoint, ledger)
        result = check(crashed, ledger)
        salvaged += model_calls_reused(crashed)
        if failed(result):
            failures.append((k, result))
    assert not failures, failures[:3]
    assert salvaged > 0  # turns were resumed, not regenerated


def _empty_schema(url: str) -> None:
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("DROP SCHEMA public CASCADE")
            conn.exec_driver_sql("CREATE SCHEMA public")
    finally:
        engine.dispose()


def _kill_at(url: str, k: int, ledger: Ledger) -> None:
    """Run the run on ``url`` in a forked child (its own session; forked, not spawned:
    the imports are this process's) until it SIGKILLs itself at offset ``k``."""
    with warnings.catch_warnings():  # torch's idle native threads: fork is safe here
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            run_until_killed(url, ledger, k)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + WORKER_DEADLINE_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the run did not reach offset {k} in {WORKER_DEADLINE_S} s")
        time.sleep(0.02)
    code = os.waitstatus_to_exitcode(status)
    assert code == -signal.SIGKILL, f"the run did not die at {k} (exit {code})"


@pytest.mark.slow
@pytest.mark.postgres
def test_sigkill_a_multi_turn_run_on_postgresql_at_random_offsets(
    base_log: MemoryEventStore, pg_url: str, tmp_path: Path
) -> None:
    seed = int(os.environ.get("ROLLOUTLOG_CRASH_SEED", "34"))
    # The live run's length varies a little with scheduling: stay inside the shortest.
    offsets = sorted(
        random.Random(seed).sample(range(3, base_log.last_seq(RUN) * 9 // 10), PG_CRASHES)
    )
    failures = []
    salvaged = 0
    for k in offsets:
        _empty_schema(pg_url)
        ledger = Ledger(tmp_path / f"ledger-{k}.tsv")
        _kill_at(pg_url, k, ledger)
        store = EventStore.open(pg_url)  # a fresh controller, from what PostgreSQL holds
        try:
            crashed_at = store.last_seq(RUN)
            assert crashed_at >= k
            checkpoint = ran_by_the_crash(store.read(RUN), ledger)
            assert checkpoint, f"no checkpoint at or before {crashed_at}"
            _restore_and_finish(store, checkpoint, ledger)
            result = check(store, ledger)
            salvaged += model_calls_reused(store)
        finally:
            store.close()
        if failed(result):
            failures.append((seed, k, crashed_at, result))
    assert not failures, failures[:3]
    assert salvaged > 0  # turns were resumed, not regenerated

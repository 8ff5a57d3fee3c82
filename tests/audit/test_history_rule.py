"""The SQL history rule (``history_spans`` / ``history_events`` / ``abandoned_events``)
agrees with :meth:`EventStore.history_segments` over random restore patterns."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import sqlalchemy as sa

from rolloutlog.eventstore import EventStore, NewEvent


def _append(store: EventStore, run_id: str, n: int) -> None:
    last = store.last_seq(run_id)
    epoch = store.get_run(run_id).current_epoch
    now = datetime.now(UTC)
    batch = [NewEvent("T", 1, f'{{"i": {last + i + 1}}}', now) for i in range(n)]
    store.append(run_id, batch, expected_seq=last + 1, epoch=epoch)


def _expected(store: EventStore, run_id: str) -> list[int]:
    return [s for a, b in store.history_segments(run_id) for s in range(a, b + 1)]


def _sql(store: EventStore, sql: str, run_id: str) -> list[tuple[int, ...]]:
    with store.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text(sql), {"r": run_id}).all()]


_SEQS = "SELECT seq FROM {view} WHERE run_id = :r ORDER BY seq"


def _check(store: EventStore, run_id: str) -> None:
    want = _expected(store, run_id)
    spans = _sql(
        store,
        "SELECT first_seq, last_seq FROM history_spans WHERE run_id = :r ORDER BY first_seq",
        run_id,
    )
    assert spans == store.history_segments(run_id), run_id
    got = [s for (s,) in _sql(store, _SEQS.format(view="history_events"), run_id)]
    assert got == want, run_id
    gone = [s for (s,) in _sql(store, _SEQS.format(view="abandoned_events"), run_id)]
    assert sorted(set(gone) | set(got)) == list(range(1, store.last_seq(run_id) + 1))
    assert not set(gone) & set(got)


def _naive_history(store: EventStore, run_id: str) -> list[int]:
    """The tempting rule: a row of epoch e is abandoned iff seq > min(resume_seq of the
    later epochs). Wrong when a restore resumes on a branch an earlier one abandoned."""
    with store.engine.connect() as conn:
        epochs = {e: r for e, r in conn.exec_driver_sql(
            f"SELECT epoch, resume_seq FROM epochs WHERE run_id = '{run_id}'"
        ).all()}  # fmt: skip
        rows = conn.exec_driver_sql(
            f"SELECT seq, epoch FROM events WHERE run_id = '{run_id}' ORDER BY seq"
        ).all()
    out = []
    for seq, epoch in rows:
        later = [r for e, r in epochs.items() if e > epoch]
        if not later or seq <= min(later):
            out.append(seq)
    return out


def test_random_restore_patterns_match_history_segments(db_url: str) -> None:
    rng = random.Random(20261130)
    kinds = {"abandoned_branch": 0, "empty_epoch": 0, "resume_zero": 0, "takeover": 0}
    fast = f"{db_url}?synchronous=OFF" if db_url.startswith("sqlite") else db_url
    with EventStore.open(fast) as store:
        # SQLite explores more patterns; PostgreSQL (where a commit costs ~20 ms) fewer.
        for n in range(40 if store.dialect == "sqlite" else 14):
            run_id = f"r{n}"
            store.create_run(run_id)
            _check(store, run_id)  # an empty run has no history
            abandoned: set[int] = set()
            previous_empty = False
            for _ in range(rng.randint(3, 9)):
                op = rng.random()
                last = store.last_seq(run_id)
                if op < 0.45 or last == 0:
                    _append(store, run_id, rng.randint(1, 4))
                    previous_empty = False
                else:
                    history = set(_expected(store, run_id))
                    abandoned |= set(range(1, last + 1)) - history
                    choice = rng.random()
                    if choice < 0.25 and abandoned:
                        resume = rng.choice(sorted(abandoned))
                        kinds["abandoned_branch"] += 1
                    elif choice < 0.35:
                        resume = 0
                        kinds["resume_zero"] += 1
                    elif choice < 0.5:
                        resume = last
                        kinds["takeover"] += 1
                    else:
                        resume = rng.randint(0, last)
                    if previous_empty:
                        kinds["empty_epoch"] += 1
                    store.open_epoch(run_id, resume_seq=resume)
                    previous_empty = True
                _check(store, run_id)
    # The patterns covered every shape the rule has to get right.
    assert all(count > 0 for count in kinds.values()), kinds


def test_resuming_an_abandoned_branch_brings_it_back(db_url: str) -> None:
    """Epoch 2 abandons 3..10, epoch 3 resumes at 5: 3..5 are history again (the naive
    "seq > min(later resume_seq)" rule would drop them)."""
    with EventStore.open(db_url) as store:
        store.create_run("r")
        _append(store, "r", 10)
        store.open_epoch("r", resume_seq=2)
        _append(store, "r", 2)  # 11, 12
        store.open_epoch("r", resume_seq=5)
        _append(store, "r", 3)  # 13..15
        _check(store, "r")
        assert _expected(store, "r") == [1, 2, 3, 4, 5, 13, 14, 15]
        assert _naive_history(store, "r") == [1, 2, 13, 14, 15]
        # A restore of a run that already had restores, to the newest history's middle.
        store.open_epoch("r", resume_seq=14)
        _append(store, "r", 1)  # 16
        _check(store, "r")
        assert _expected(store, "r") == [1, 2, 3, 4, 5, 13, 14, 16]


def test_runs_do_not_see_each_other(db_url: str) -> None:
    with EventStore.open(db_url) as store:
        for run_id, resume in (("a", 3), ("b", 1)):
            store.create_run(run_id)
            _append(store, run_id, 6)
            store.open_epoch(run_id, resume_seq=resume)
            _append(store, run_id, 2)
        for run_id in ("a", "b"):
            _check(store, run_id)
        spans = _sql(store, "SELECT run_id, first_seq, last_seq FROM history_spans "
                     "WHERE run_id = :r ORDER BY first_seq", "b")  # fmt: skip
        assert spans == [("b", 1, 1), ("b", 7, 8)]

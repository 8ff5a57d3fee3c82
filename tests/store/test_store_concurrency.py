"""Contract under concurrency: readers see a contiguous prefix; competing writers, one wins."""

from __future__ import annotations

import json
import random
import subprocess
import threading
from datetime import UTC, datetime

import pytest
from storetest_helpers import REPO_ROOT, skip_if_memory, worker_cmd

from rolloutlog.eventstore import AppendConflictError, NewEvent


def _ev(seq: int, writer: int = 0) -> NewEvent:
    return NewEvent("C", 1, json.dumps({"seq": seq, "w": writer}), datetime.now(UTC))


def test_readers_during_writes_see_a_contiguous_prefix(db_url: str, open_store) -> None:
    # Not inherently SQL, but on the memory store a whole append fits in one reader pass
    # under the GIL, so the test could not show a read overlapping a write.
    skip_if_memory(db_url, "isolation of concurrent transactions")
    writer_store = open_store(db_url)
    writer_store.create_run("r1")
    rng = random.Random(1234)
    sizes = [rng.randint(1, 7) for _ in range(150)]
    total = sum(sizes)
    batch_ends = {0}
    end = 0
    for s in sizes:
        end += s
        batch_ends.add(end)
    done = threading.Event()
    start = threading.Barrier(4)
    errors: list[BaseException] = []
    observed: list[int] = []

    def writer() -> None:
        try:
            start.wait()
            nxt = 1
            for s in sizes:
                batch = [_ev(q) for q in range(nxt, nxt + s)]
                nxt = writer_store.append("r1", batch, expected_seq=nxt, epoch=1) + 1
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    def reader(page_size: int) -> None:
        store = open_store(db_url)
        try:
            start.wait()
            while True:
                finished = done.is_set()
                got = list(store.read("r1", page_size=page_size))
                seqs = [e.seq for e in got]
                n = len(seqs)
                assert seqs == list(range(1, n + 1)), f"gap or duplicate in {seqs}"
                assert all(json.loads(e.payload)["seq"] == e.seq for e in got)
                assert n in batch_ends, f"read ended inside a batch at {n}"
                observed.append(n)
                if finished:
                    assert n == total
                    return
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer)]
    threads += [threading.Thread(target=reader, args=(p,)) for p in (1, 5, 64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]
    assert writer_store.last_seq("r1") == total
    # The readers really read while the log was growing, not only before or after.
    assert any(0 < n < total for n in observed), observed[:20]


@pytest.mark.parametrize("contenders", [2, 4])
def test_writers_with_the_same_expected_seq_exactly_one_wins(
    db_url: str, open_store, contenders: int
) -> None:
    setup = open_store(db_url)
    setup.create_run("r1")
    stores = [open_store(db_url) for _ in range(contenders)]
    batch = 3
    rounds = 15
    winners: list[int] = []
    for round_no in range(rounds):
        expected = round_no * batch + 1
        barrier = threading.Barrier(contenders)
        results: list[object] = [None] * contenders

        def contend(i: int, expected: int = expected, barrier=barrier, results=results) -> None:
            events = [_ev(expected + j, writer=i) for j in range(batch)]
            barrier.wait()
            try:
                results[i] = stores[i].append("r1", events, expected_seq=expected, epoch=1)
            except Exception as exc:  # recorded and checked below
                results[i] = exc

        threads = [threading.Thread(target=contend, args=(i,)) for i in range(contenders)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        won = [i for i, r in enumerate(results) if isinstance(r, int)]
        assert len(won) == 1, (round_no, results)
        assert results[won[0]] == expected + batch - 1
        for i, r in enumerate(results):
            if i != won[0]:
                assert isinstance(r, AppendConflictError), r
                assert r.actual_next_seq == expected + batch
        winners.append(won[0])
        assert setup.last_seq("r1") == expected + batch - 1
    got = list(setup.read("r1"))
    assert [e.seq for e in got] == list(range(1, rounds * batch + 1))
    for round_no, w in enumerate(winners):
        chunk = got[round_no * batch : (round_no + 1) * batch]
        assert [json.loads(e.payload)["w"] for e in chunk] == [w] * batch


@pytest.mark.slow
def test_processes_competing_for_one_run(db_url: str, open_store) -> None:
    skip_if_memory(db_url, "child processes open the database")
    """Separate processes (own connections, own pools) appending with retry on conflict."""
    store = open_store(db_url)
    store.create_run("r1")
    procs, wins, batch = 3, 20, 4
    children = [
        subprocess.Popen(
            worker_cmd("contend", db_url, "r1", str(w), str(wins), str(batch)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
        )
        for w in range(procs)
    ]
    reports = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["wins"] for r in reports] == [wins] * procs
    got = list(store.read("r1"))
    assert [e.seq for e in got] == list(range(1, procs * wins * batch + 1))
    assert store.last_seq("r1") == procs * wins * batch
    per_writer: dict[int, list[int]] = {w: [] for w in range(procs)}
    for i in range(0, len(got), batch):
        chunk = [json.loads(e.payload) for e in got[i : i + batch]]
        # A batch is never interleaved with another writer's.
        assert len({c["w"] for c in chunk}) == 1
        assert [c["j"] for c in chunk] == list(range(batch))
        assert len({c["k"] for c in chunk}) == 1
        per_writer[chunk[0]["w"]].append(chunk[0]["k"])
    # Each writer's batches are all there, once each, in its own order.
    assert per_writer == {w: list(range(wins)) for w in range(procs)}

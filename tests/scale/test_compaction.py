"""Compaction of a real run (SQLite and PostgreSQL): what it keeps, removes and refuses.

A run is driven by RolloutController + RolloutRuntime + DeterministicBackend (the
reliability harness: failures, drops, borrows, evictions, a checkpoint every step and a
snapshot every 25 events), compacted before a middle checkpoint with an archive, then
restored at a later checkpoint and finished. The exactly-once ledger is folded from the
archive plus what remains (the ledger of controller/prompt_ledger.py starts at offset 1).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from rolloutlog.cli import main as cli_main
from rolloutlog.cli.compact import rollout_snapshot_refs, verify_rollout_snapshot
from rolloutlog.controller.domain import CODEC
from rolloutlog.controller.domain.invariants import find_violations
from rolloutlog.controller.prompt_ledger import PromptLedger, cross_check
from rolloutlog.controller.rollout_controller import RolloutController, decode_snapshot, replay
from rolloutlog.controller.rollout_index import MARKS_TABLE as STEP_MARKS
from rolloutlog.controller.rollout_index import SIBLING_TABLE as SIBLING_INDEX
from rolloutlog.controller.rollout_index import TABLE as ROLLOUT_INDEX
from rolloutlog.controller.rollout_index import TABLES as ROLLOUT_TABLES
from rolloutlog.controller.rollout_index import attach
from rolloutlog.eventstore import EventStore, StoredEvent
from rolloutlog.eventstore.compaction import (
    CompactedHistoryError,
    CompactionError,
    compact,
    list_compactions,
    read_archive,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from reliability_harness import FINGERPRINT, drive, rollout_config, run, start, store_config

RUN = "r"


def _checkpoints(store: EventStore) -> list[int]:
    return [r.seq for r in store.read_history(RUN) if r.type == "CheckpointMarked"]


def _payload_rows(store: EventStore) -> dict[str, bytes]:
    with store.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT payload_id, data FROM payloads WHERE run_id = 'r'"
        ).all()
    return {r[0]: bytes(r[1]) for r in rows}


def _snapshot_seqs(store: EventStore) -> list[int]:
    with store.engine.connect() as conn:
        return [
            r[0]
            for r in conn.exec_driver_sql(
                "SELECT seq FROM snapshots WHERE run_id = 'r' ORDER BY seq"
            ).all()
        ]


def _ledger(store: EventStore, archived: list[StoredEvent]) -> PromptLedger:
    """The prompt ledger of the current history, folded from the archive + the store."""
    rows = {e.seq: e for e in archived}
    rows.update({e.seq: e for e in store.read(RUN)})
    ledger = PromptLedger()
    for first, last in store.history_segments(RUN):
        for seq in range(first, last + 1):
            ledger.apply(CODEC.decode(rows[seq]))  # type: ignore[arg-type]
    return ledger


@pytest.fixture
def driven(db_url: str) -> Any:
    """A run trained 8 steps, with a restore to step 2 in between (an abandoned range)."""
    store = EventStore.open(db_url)
    ctl = start(store)
    try:
        run(drive(ctl, 4))
    finally:
        ctl.close()
    ckpt2 = _checkpoints(store)[2]
    ctl, _ = RolloutController.restore(
        store, RUN, ckpt2, rollout=rollout_config(), dataset_fingerprint=FINGERPRINT,
        store_config=store_config(),
    )  # fmt: skip
    try:
        run(drive(ctl, 8))
    finally:
        ctl.close()
    # The restored controller snapshots too: the compaction base below lies after the
    # restore, past steps whose groups were trained (their payloads can go). Without
    # it the base fell in the first segment, and how far in depended on timing.
    segments = store.history_segments(RUN)
    snaps = _snapshot_seqs(store)
    assert any(segments[-1][0] <= s <= _checkpoints(store)[6] for s in snaps), (snaps, segments)
    yield store
    store.close()


def test_compact_restore_finish_exactly_once(driven: EventStore, tmp_path: Path) -> None:
    store = driven
    cps = _checkpoints(store)
    before = cps[6]
    # What every offset gives before the compaction.
    pre_end = replay(store, RUN).state.to_snapshot()
    pre_at = {k: replay(store, RUN, k).state.to_snapshot() for k in cps}
    pre_rows = list(store.read(RUN))
    pre_payloads = _payload_rows(store)
    pre_snaps = _snapshot_seqs(store)
    abandoned_before = {
        r.seq for r in pre_rows if not any(f <= r.seq <= e for f, e in store.history_segments(RUN))
    }
    assert abandoned_before, "the fixture must leave an abandoned range"
    attach(store)  # as the controller that wrote the run does
    pre_index = {table: store.derived_rows(table, RUN) for table in ROLLOUT_TABLES}
    keyed = sorted(r[1] for t in (ROLLOUT_INDEX, SIBLING_INDEX) for r in pre_index[t])
    assert keyed == [r.seq for r in pre_rows], "every controller event has one index row"
    assert pre_index[SIBLING_INDEX] and pre_index[STEP_MARKS]

    dry = compact(
        store, RUN, before, archive=tmp_path / "dry.jsonl", dry_run=True,
        snapshot_refs=rollout_snapshot_refs,
    )  # fmt: skip
    assert not (tmp_path / "dry.jsonl").exists()
    assert list(store.read(RUN)) == pre_rows, "a dry run changes nothing"

    archive = tmp_path / "archive.jsonl"
    plan = compact(
        store, RUN, before, archive=archive, snapshot_refs=rollout_snapshot_refs,
        verify_snapshot=verify_rollout_snapshot,
    )  # fmt: skip
    assert (plan.snapshot_seq, plan.events_removed) == (dry.snapshot_seq, dry.events_removed)
    base = plan.snapshot_seq
    assert base <= before and base in pre_snaps
    assert plan.upto_seq == base - 1
    assert plan.abandoned_events_removed == len({s for s in abandoned_before if s < base})
    assert [r.seq for r in store.read(RUN)] == [r.seq for r in pre_rows if r.seq >= base]
    assert _snapshot_seqs(store) == [s for s in pre_snaps if s >= base]
    (record,) = list_compactions(store, RUN)
    assert (record.upto_seq, record.snapshot_seq, record.archive) == (base - 1, base, str(archive))

    # The archive round-trips: every removed row is in it, byte for byte.
    arch = read_archive(archive)
    assert arch.events == [r for r in pre_rows if r.seq < base]
    assert [s.seq for s in arch.snapshots] == [s for s in pre_snaps if s < base]
    post_payloads = _payload_rows(store)
    assert set(arch.payloads) == set(pre_payloads) - set(post_payloads)
    assert all(arch.payloads[p][1] == pre_payloads[p] for p in arch.payloads)
    assert arch.payloads, "completed groups trained before the base free their payloads"
    # The rollout index follows its events: rows of removed events go (into the archive).
    removed = {}
    for table, rows in pre_index.items():
        assert store.derived_rows(table, RUN) == [r for r in rows if r[1] >= base]
        assert [tuple(d.values()) for d in arch.derived[table]] == [r for r in rows if r[1] < base]
        removed[table] = sum(1 for r in rows if r[1] < base)
    assert plan.derived_removed == removed
    assert removed[ROLLOUT_INDEX] + removed[SIBLING_INDEX] == base - 1

    # Payloads still needed are kept: those of kept events and of the base's live groups.
    for row in store.read(RUN):
        if row.type == "SiblingCompleted":
            assert store.get_payload(RUN, json.loads(row.payload)["payload_id"])
    snap = store.load_snapshot(RUN, at_or_before=base)
    assert snap is not None and snap.seq == base
    for pid in rollout_snapshot_refs(snap.data):
        assert store.get_payload(RUN, pid)
    assert plan.payloads_kept > 0, "groups live at the base keep their payloads"

    # Replays at and after the base equal the pre-compaction replays.
    assert replay(store, RUN).state.to_snapshot() == pre_end
    for k in cps:
        if k >= base:
            assert replay(store, RUN, k).state.to_snapshot() == pre_at[k]
    assert decode_snapshot(snap.data).last_seq == base

    # Before the base: a clear error naming the compaction, and nothing changes.
    epoch = store.get_run(RUN).current_epoch
    early = max(k for k in cps if k < base)
    with pytest.raises(CompactedHistoryError, match=r"compacted at .*events 1\.\.") as exc:
        RolloutController.restore(
            store, RUN, early, rollout=rollout_config(), dataset_fingerprint=FINGERPRINT
        )
    assert str(base) in str(exc.value) and str(archive) in str(exc.value)
    assert store.get_run(RUN).current_epoch == epoch
    with pytest.raises(CompactedHistoryError):
        replay(store, RUN, use_snapshots=False)
    with pytest.raises(CompactionError, match="already compacted"):
        compact(store, RUN, before, snapshot_refs=rollout_snapshot_refs)

    # Restore at a later checkpoint and finish the run: no prompt lost or trained twice.
    later = min(k for k in cps if k >= base)
    ctl, report = RolloutController.restore(
        store, RUN, later, rollout=rollout_config(), dataset_fingerprint=FINGERPRINT
    )
    assert report.snapshot_offset is not None and report.snapshot_offset >= base
    try:
        run(drive(ctl, 16))
        final = ctl.state
    finally:
        ctl.close()
    assert not find_violations(final)
    assert replay(store, RUN).state.to_snapshot() == final.to_snapshot()
    check = cross_check(_ledger(store, arch.events), final)
    assert check.lost == () and check.trained_twice == () and check.prompts_pulled_twice == 0
    assert check.prompts_trained > 0


def test_compact_refusals(driven: EventStore, tmp_path: Path) -> None:
    store = driven
    first_snapshot = _snapshot_seqs(store)[0]
    with pytest.raises(CompactionError, match="no snapshot at or before offset"):
        compact(store, RUN, first_snapshot - 1)
    with pytest.raises(CompactionError, match="outside run"):
        compact(store, RUN, store.last_seq(RUN) + 1)
    existing = tmp_path / "exists.jsonl"
    existing.write_text("")
    with pytest.raises(CompactionError, match="already exists"):
        compact(store, RUN, _checkpoints(store)[-1], archive=existing)
    # Without a snapshot reference rule no payload is removed (any might still be needed).
    before = _payload_rows(store)
    plan = compact(store, RUN, _checkpoints(store)[-1])
    assert plan.payloads_removed == [] and _payload_rows(store) == before
    # A later compaction moves the base forward; the error names the newest one.
    ctl = RolloutController.open(store, RUN)
    try:
        run(drive(ctl, ctl.state.train_step + 2))
        ctl.snapshot_now()
    finally:
        ctl.close()
    plan2 = compact(store, RUN, store.last_seq(RUN), snapshot_refs=rollout_snapshot_refs)
    assert plan2.snapshot_seq > plan.snapshot_seq
    assert [c.snapshot_seq for c in list_compactions(store, RUN)] == [
        plan.snapshot_seq,
        plan2.snapshot_seq,
    ]
    with pytest.raises(CompactedHistoryError, match=str(plan2.snapshot_seq)):
        RolloutController.restore(store, RUN, plan.snapshot_seq, force=True)


def test_cli_compact(tmp_path: Path) -> None:
    db = tmp_path / "log.db"
    store = EventStore.open(f"sqlite:///{db}")
    ctl = start(store)
    try:
        run(drive(ctl, 6))
    finally:
        ctl.close()
    cps = _checkpoints(store)
    store.close()
    runner = CliRunner()
    dry = runner.invoke(
        cli_main, ["compact", str(db), "--run", RUN, "--before", str(cps[4]), "--dry-run", "--json"]
    )
    assert dry.exit_code == 0, dry.output
    planned = json.loads(dry.output)
    assert planned["dry_run"] and planned["events_removed"] > 0
    out = runner.invoke(
        cli_main,
        ["compact", str(db), "--before", str(cps[4]), "--archive", str(tmp_path / "a.jsonl")],
    )
    assert out.exit_code == 0, out.output
    assert f"removed events 1..{planned['upto_seq']}" in out.output
    assert len(read_archive(tmp_path / "a.jsonl").events) == planned["events_removed"]
    again = runner.invoke(cli_main, ["compact", str(db), "--before", str(cps[4])])
    assert again.exit_code != 0 and "already compacted" in again.output

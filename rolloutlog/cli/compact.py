"""``rolloutlog compact``: remove a run's history before a snapshot (retention)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from rolloutlog.controller.rollout_index import TABLES as ROLLOUT_INDEX_TABLES
from rolloutlog.eventstore import Snapshot, StoreError
from rolloutlog.eventstore.compaction import CompactionPlan

from ._options import flag, json_option, run_option
from .common import open_store, pick_run


def rollout_snapshot_refs(data: bytes) -> set[str]:
    """Payload ids a rollout snapshot refers to (completions of the groups it holds)."""
    from rolloutlog.controller.rollout_controller import decode_snapshot

    state = decode_snapshot(data)
    return {
        sib.payload_id
        for group in state.groups.values()
        for sib in group.siblings
        if sib.payload_id is not None
    }


def verify_rollout_snapshot(snap: Snapshot) -> None:
    """Refuse a base snapshot that does not decode (it will be the only way back)."""
    from rolloutlog.controller.domain.invariants import check_invariants
    from rolloutlog.controller.rollout_controller import decode_snapshot

    state = decode_snapshot(snap.data)
    if state.last_seq != snap.seq:
        raise StoreError(
            f"snapshot at offset {snap.seq} describes offset {state.last_seq}: refusing to "
            "make it the base of a compaction"
        )
    check_invariants(state)


def _url(db: str) -> str:
    return db if "://" in db else f"sqlite:///{Path(db).resolve()}"


def _print_plan(plan: CompactionPlan) -> None:
    verb = "would remove" if plan.dry_run else "removed"
    click.echo(
        f"run {plan.run_id}: base snapshot at offset {plan.snapshot_seq} "
        f"(newest in the current history at or before {plan.before_offset})"
    )
    click.echo(
        f"  {verb} events 1..{plan.upto_seq}: {plan.events_removed:,} "
        f"({plan.history_events_removed:,} history, {plan.abandoned_events_removed:,} abandoned)"
    )
    click.echo(f"  {verb} {len(plan.snapshots_removed)} older snapshots")
    click.echo(
        f"  {verb} {len(plan.payloads_removed):,} payloads; kept {plan.payloads_kept:,} "
        "still referenced by kept events or snapshots"
    )
    if plan.archive:
        note = " (not written: dry run)" if plan.dry_run else ""
        click.echo(f"  archive: {plan.archive}{note}")
    if not plan.dry_run:
        click.echo(
            f"  restore and replay now work at offsets >= {plan.snapshot_seq} whose history "
            "passes through that snapshot"
        )


@click.command("compact")
@click.argument("db")
@run_option("Run id (default: the newest run).")
@click.option(
    "--before",
    "before",
    type=int,
    required=True,
    help="Compact up to the newest current-history snapshot at or before this offset.",
)
@click.option(
    "--archive",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Export every removed row to this JSONL file first (must not exist).",
)
@flag("--dry-run", "Report what would be removed; change nothing.")
@json_option()
def compact(
    db: str, run_id: str | None, before: int, archive: Path | None, dry_run: bool, as_json: bool
) -> None:
    """Remove the history of a run before a snapshot (DB: a URL or a SQLite file).

    Keeps the newest snapshot at or before --before that lies in the current history
    (the base), every event from the base on, and every payload that a kept event or
    snapshot still refers to. Removes the older events (history and abandoned ranges),
    the older snapshots and the payloads only they referred to. Restores and replays at
    offsets from the base on work as before; earlier ones fail naming the compaction.
    The run's metrics are folded up to the base first and kept (the metrics base), so
    ``rolloutlog metrics`` and ``serve-metrics`` show the same values afterwards.
    See docs/retention.md.
    """
    from rolloutlog.controller.metrics.retention import compact_with_metrics

    store = open_store(_url(db), readonly=False)
    try:
        run = pick_run(store, run_id)
        try:
            plan = compact_with_metrics(
                store,
                run,
                before,
                archive=archive,
                dry_run=dry_run,
                snapshot_refs=rollout_snapshot_refs,
                verify_snapshot=verify_rollout_snapshot,
                derived_tables=ROLLOUT_INDEX_TABLES,
            )
        except StoreError as exc:
            raise click.ClickException(str(exc)) from exc
    finally:
        store.close()
    if as_json:
        click.echo(json.dumps(plan.to_dict()))
    else:
        _print_plan(plan)

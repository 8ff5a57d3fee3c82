"""Helpers shared by the CLI commands: opening a log and choosing a run."""

from __future__ import annotations

import click

from rolloutlog.eventstore import EventStore, StoreError


def open_store(url: str, *, readonly: bool = True) -> EventStore:
    """Open the log at ``url`` (read-only by default); store errors become CLI errors."""
    try:
        return EventStore.open(url, create=False, readonly=readonly)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc


def pick_run(store: EventStore, run_id: str | None) -> str:
    """``run_id`` if it exists, else the newest run; a clear error when there is none."""
    try:
        if run_id is not None:
            store.get_run(run_id)
            return run_id
        runs = store.list_runs()
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    if not runs:
        raise click.ClickException(f"{store.url.render_as_string()} holds no runs")
    return runs[-1].run_id

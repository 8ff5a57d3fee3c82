"""Helpers shared by the CLI commands: opening a log, choosing a run, checking extras."""

from __future__ import annotations

import importlib.util

import click

# The logs the CLI opens are rollout logs: their schema includes the rollout index's
# branch, registered by importing its module.
from rolloutlog.controller import rollout_index as _rollout_index  # noqa: F401
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


#: The modules each optional extra brings (``pip install 'rolloutlog[EXTRA]'``).
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "torch": ("torch", "transformers", "tokenizers", "safetensors"),
    "vllm": ("vllm",),
    "bench": ("eventsourcing",),
    "trl": ("trl", "datasets"),
}


def require_extra(extra: str, what: str) -> None:
    """Fail with one line naming the extra to install when its modules are missing.

    The core install (``pip install rolloutlog``) has no torch; commands that train or
    generate with a model call this before importing anything that needs it.
    """
    missing = [m for m in EXTRA_MODULES[extra] if importlib.util.find_spec(m) is None]
    if missing:
        raise click.ClickException(
            f"{what} needs {', '.join(missing)} (not installed): pip install 'rolloutlog[{extra}]'"
        )

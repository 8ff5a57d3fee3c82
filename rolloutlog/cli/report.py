"""``rolloutlog report``: a self-contained HTML report of a stored run."""

from __future__ import annotations

from pathlib import Path

import click

from rolloutlog.eventstore import StoreError

from ._options import run_option, shown
from .common import open_store
from .metrics import _pick_run


@click.command("report")
@click.argument("db_url")
@run_option("Run id (default: the most recent run).")
@shown(
    "--out",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    default=Path("report.html"),
    help="The HTML file to write.",
)
def report(db_url: str, run_id: str | None, out: Path) -> None:
    """Write one self-contained HTML file with plots of a run, from its log.

    Reward per step, staleness per step, generation throughput, prompt outcomes, and
    the epochs and restores (abandoned branches, what each restore reused, salvaged and
    re-ran). The plotting library's JavaScript is embedded: the file opens offline.
    Needs the `report` extra (plotly).
    """
    from rolloutlog.controller.metrics.report import ReportError, write_report

    store = open_store(db_url)
    try:
        run = _pick_run(store, run_id)
        charts = write_report(store, run, out)
    except (StoreError, ReportError) as exc:
        raise click.ClickException(str(exc)) from exc
    except OSError as exc:
        raise click.ClickException(f"cannot write {out}: {exc}") from exc
    finally:
        store.close()
    click.echo(f"wrote {out} ({charts} charts, run {run})")

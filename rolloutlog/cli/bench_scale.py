"""``rolloutlog bench scale``: append rate, restore time and audit lookups, 10M vs 100k.

Registered into the ``bench`` group by :mod:`rolloutlog.cli.bench`; the benchmark module
is imported when the command runs, so ``--help`` stays fast.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import click

from ._options import db_dir_option, flag, json_option, shown


@click.command("scale")
@shown("--events", default=10_000_000, help="Events in the large log.")
@shown("--baseline-events", default=100_000, help="Events in the baseline log.")
@shown("--window", default=100_000, help="Appends measured per log.")
@shown("--batch", default=2_000, help="Events per append transaction.")
@shown("--lookups", default=200, help="Random lookups of each kind.")
@shown(
    "--view-repeats",
    default=2,
    help="Runs of the slow view-based queries (the 'before' numbers); 0 skips them.",
)
@shown("--restore-repeats", default=3, help="Restores timed per log.")
@db_dir_option(
    "Folder for the generated logs, kept and reused across runs "
    "(default: <temp>/rolloutlog-bench-scale)."
)
@flag("--fresh", "Regenerate the logs even if --db-dir holds them.")
@json_option()
def scale(
    events: int,
    baseline_events: int,
    window: int,
    batch: int,
    lookups: int,
    view_repeats: int,
    restore_repeats: int,
    db_dir: Path | None,
    fresh: bool,
    as_json: bool,
) -> None:
    """How the log's costs hold up as history grows, --events vs 100k.

    Generates two logs of the same realistic run (domain bench generator; 10M events
    take several minutes, and are kept in --db-dir for the next run), then measures the
    append rate of --window more events into each (target: within 20%), the restore of
    the checkpoint at the end of each with snapshots on (target: ratio <= 1.5), and the
    median latency of random prompt-history and step-batch lookups (target: < 50 ms).
    """
    from rolloutlog.bench import scale_bench

    def progress(msg: str) -> None:
        if not as_json:
            click.echo(msg, err=True)

    folder = db_dir or Path(tempfile.gettempdir()) / "rolloutlog-bench-scale"
    try:
        result = scale_bench.run_scale_benchmark(
            events=events, baseline_events=baseline_events, window=window, batch=batch,
            lookups=lookups, view_repeats=view_repeats, restore_repeats=restore_repeats,
            db_dir=folder, reuse=not fresh, progress=progress,
        )  # fmt: skip
    except ValueError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if as_json:
        click.echo(json.dumps(result))
    else:
        scale_bench.print_scale_report(result)

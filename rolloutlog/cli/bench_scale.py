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


@click.command("scale")
@click.option("--events", default=10_000_000, show_default=True, help="Events in the large log.")
@click.option(
    "--baseline-events", default=100_000, show_default=True, help="Events in the baseline log."
)
@click.option("--window", default=100_000, show_default=True, help="Appends measured per log.")
@click.option("--batch", default=2_000, show_default=True, help="Events per append transaction.")
@click.option("--lookups", default=200, show_default=True, help="Random lookups of each kind.")
@click.option(
    "--view-repeats",
    default=2,
    show_default=True,
    help="Runs of the slow view-based queries (the 'before' numbers); 0 skips them.",
)
@click.option("--restore-repeats", default=3, show_default=True, help="Restores timed per log.")
@click.option(
    "--db-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder for the generated logs, kept and reused across runs "
    "(default: <temp>/rolloutlog-bench-scale).",
)
@click.option("--fresh", is_flag=True, help="Regenerate the logs even if --db-dir holds them.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
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

"""``rolloutlog bench``: benchmarks that print ratios against baselines measured in the same run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ._options import db_dir_option, flag, json_option, shown


@click.group()
def bench() -> None:
    """Benchmarks (each prints ratios against a baseline measured in the same run)."""


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part.replace("_", "")) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"{text!r}: expected comma-separated integers") from exc
    if len(sizes) < 2 or min(sizes) < 0:
        raise click.BadParameter(f"{text!r}: give at least two sizes >= 0")
    return sizes


@bench.command("store")
@shown("--events", default=200_000, help="Events per system.")
@shown("--batch", default=1_000, help="Events per transaction.")
@shown("--page-size", default=2_000, help="Rows per read page.")
@shown("--repeat", default=3, help="Runs per system (or window); best counts.")
@db_dir_option("Folder for the SQLite files (default: the system temp folder).")
@flag("--keep-files", "Keep the SQLite files after the run.")
@flag(
    "--scale",
    "Instead: append rate of the last --scale-window appends into logs of --scale-sizes.",
)
@shown(
    "--scale-sizes", default="100000,10000000", help="Log sizes N for --scale (comma-separated)."
)
@shown("--scale-window", default=100_000, help="Appends measured.")
@shown(
    "--scale-slices",
    default=10,
    help="The window is appended in this many slices alternating between the logs.",
)
@click.option(
    "--db",
    "db_url",
    default=None,
    help="Instead: PostgreSQL mode on this database (postgresql+psycopg://...): rolloutlog's "
    "append against raw psycopg COPY into the same table, and append-to-LISTEN latency.",
)
@json_option()
def store(
    db_url: str | None,
    events: int,
    batch: int,
    page_size: int,
    repeat: int,
    db_dir: Path | None,
    keep_files: bool,
    scale: bool,
    scale_sizes: str,
    scale_window: int,
    scale_slices: int,
    as_json: bool,
) -> None:
    """Event store throughput against raw sqlite3 and the eventsourcing library.

    Writes the same events through each system (SQLite, WAL, rolloutlog's synchronous
    level, same batch size), reads them back and decodes them, and prints events/s and
    the ratios rolloutlog / baseline. With --scale, measures instead how the append rate
    holds up as the log grows (the 10M-event size takes minutes).
    """
    from rolloutlog.bench import store_bench

    def progress(msg: str) -> None:
        if not as_json:
            click.echo(msg, err=True)

    try:
        if db_url is not None:
            if not db_url.startswith("postgresql"):
                raise ValueError(f"--db takes a PostgreSQL URL, got {db_url!r}")
            result = store_bench.run_pg_store_benchmark(
                db_url, events=events, batch=batch, repeat=repeat, progress=progress
            )
            if as_json:
                click.echo(json.dumps(result))
            else:
                store_bench.print_pg_report(result)
            return
        if scale:
            result = store_bench.run_scale_benchmark(
                sizes=_sizes(scale_sizes), window=scale_window, batch=batch, repeat=repeat,
                slices=scale_slices, db_dir=db_dir, keep_files=keep_files, progress=progress,
            )  # fmt: skip
        else:
            result = store_bench.run_store_benchmark(
                events=events, batch=batch, page_size=page_size, repeat=repeat, db_dir=db_dir,
                keep_files=keep_files, progress=progress,
            )  # fmt: skip
    except (ValueError, store_bench.BenchmarkError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if as_json:
        click.echo(json.dumps(result))
    elif scale:
        store_bench.print_scale_report(result)
    else:
        store_bench.print_store_report(result)


from .bench_durability import durability  # noqa: E402

bench.add_command(durability)

from .bench_domain import domain  # noqa: E402

bench.add_command(domain)

from .bench_scale import scale  # noqa: E402

bench.add_command(scale)

from .bench_fleet import fleet  # noqa: E402

bench.add_command(fleet)

from .bench_trl import trl  # noqa: E402

bench.add_command(trl)

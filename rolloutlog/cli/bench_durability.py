"""``rolloutlog bench durability``: the log on SQLite against an in-memory store."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from ._options import flag, json_option, picked, shown


@click.command("durability")
@shown("--groups", default=10_000, type=click.IntRange(64))
@shown("--groups-per-step", default=64, type=click.IntRange(1))
@shown(
    "--latency",
    default=0.0,
    type=click.FloatRange(0),
    help="Seconds the test backend spends per request (0: pure bookkeeping, the worst case).",
)
@shown("--repeats", default=3, type=click.IntRange(1))
@shown(
    "--synchronous",
    type=click.Choice(["FULL", "NORMAL"]),
    default="FULL",
    help="SQLite synchronous level of the log (FULL is rolloutlog's default).",
)
@shown(
    "--commit-writer",
    type=click.Choice(["thread", "process"]),
    default="thread",
    help="Where the SQLite log's appends run (StoreConfig.commit_writer).",
)
@flag(
    "--busy-trainer",
    "Also measure the commit thread's time per event while the main thread trains a "
    "small torch model, against the same submissions with the main thread asleep "
    "(ratio commit_busy_vs_idle).",
)
@json_option()
def durability(
    groups: int,
    groups_per_step: int,
    latency: float,
    repeats: int,
    synchronous: str,
    commit_writer: str,
    busy_trainer: bool,
    as_json: bool,
) -> None:
    """Durability overhead of a synthetic rollout: SQLite log vs in-memory store."""
    from .common import require_extra

    require_extra("torch", "rolloutlog bench durability")
    from rolloutlog.bench.durability_bench import run_busy_trainer_bench, run_durability_bench

    result = run_durability_bench(
        **picked("groups", "groups_per_step", "latency", "repeats", "synchronous", "commit_writer")
    )
    if busy_trainer:
        result["busy_trainer"] = run_busy_trainer_bench(
            repeats=repeats, commit_writer=commit_writer
        )
        result["ratios"].update(result["busy_trainer"]["ratios"])
    if as_json:
        click.echo(json.dumps(result))
        return
    table = Table(title=f"durability overhead: {groups} groups, {result['events']} events")
    table.add_column("log")
    table.add_column("median seconds", justify="right")
    table.add_column("runs")
    table.add_row(
        "in memory",
        f"{result['memory_seconds']:.2f}",
        ", ".join(f"{x:.2f}" for x in result["memory_runs"]),
    )
    table.add_row(
        f"SQLite ({commit_writer} writer)",
        f"{result['sqlite_seconds']:.2f}",
        ", ".join(f"{x:.2f}" for x in result["sqlite_runs"]),
    )
    Console().print(table)
    click.echo(
        f"durability_overhead = {result['ratios']['durability_overhead']:.3f} (target <= 1.05)"
    )
    if busy_trainer:
        busy = result["busy_trainer"]
        click.echo(
            f"commit thread per event: {busy['commit_s_per_event_idle'] * 1e6:.1f} us idle, "
            f"{busy['commit_s_per_event_busy'] * 1e6:.1f} us with a training main thread: "
            f"commit_busy_vs_idle = {busy['ratios']['commit_busy_vs_idle']:.2f} "
            "(target <= 1.5)"
        )

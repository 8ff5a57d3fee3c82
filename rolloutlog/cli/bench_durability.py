"""``rolloutlog bench durability``: the log on SQLite (with each writer) against an
in-memory store."""

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
    type=click.Choice(["auto", "thread", "process"]),
    default="thread",
    help="The writer of the top-level figures and of --busy-trainer (StoreConfig."
    "commit_writer; auto: a writer process on SQLite). Both writers are measured anyway.",
)
@flag(
    "--busy-trainer",
    "Also measure a commit's time per event while the main thread trains a small torch "
    "model on one thread (ratio commit_busy_vs_idle), then on every core "
    "(commit_busy_all_cores_vs_idle), against the same submissions with the main thread "
    "asleep.",
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
        # A training main thread (one torch thread), then a trainer on every core.
        busy = run_busy_trainer_bench(repeats=repeats, commit_writer=commit_writer)
        every_core = run_busy_trainer_bench(
            repeats=repeats, commit_writer=commit_writer, trainer_threads=None
        )
        result["busy_trainer"] = busy
        result["busy_trainer_all_cores"] = every_core
        result["ratios"]["commit_busy_vs_idle"] = busy["ratios"]["commit_busy_vs_idle"]
        result["ratios"]["commit_busy_all_cores_vs_idle"] = every_core["ratios"][
            "commit_busy_vs_idle"
        ]
    if as_json:
        click.echo(json.dumps(result))
        return
    table = Table(title=f"durability overhead: {groups} groups, {result['events']} events")
    table.add_column("log")
    table.add_column("median seconds", justify="right")
    table.add_column("runs")
    table.add_column("overhead", justify="right")
    table.add_column("first durable checkpoint", justify="right")
    table.add_row(
        "in memory",
        f"{result['memory_seconds']:.2f}",
        ", ".join(f"{x:.2f}" for x in result["memory_runs"]),
        "-",
        "-",
    )
    for writer, label in (("thread", "thread, the default"), ("process", "process")):
        w = result["writers"][writer]
        table.add_row(
            f"SQLite (writer: {label})",
            f"{w['sqlite_seconds']:.2f}",
            ", ".join(f"{x:.2f}" for x in w["sqlite_runs"]),
            f"{w['durability_overhead']:.3f}",
            f"{w['first_durable_checkpoint_ms']:.0f} ms",
        )
    Console().print(table)
    ratios = result["ratios"]
    click.echo(
        f"durability_overhead_process = {ratios['durability_overhead_process']:.3f} "
        "(target <= 1.05); "
        f"durability_overhead_thread = {ratios['durability_overhead_thread']:.3f} "
        "(the default writer; no target)"
    )
    if busy_trainer:
        for key, trainer, ratio, target in (
            ("busy_trainer", "a training main thread", "commit_busy_vs_idle", " (target <= 1.5)"),
            (
                "busy_trainer_all_cores",
                f"a trainer on {result['busy_trainer_all_cores']['trainer_threads']} threads",
                "commit_busy_all_cores_vs_idle",
                "",
            ),
        ):
            busy = result[key]
            click.echo(
                f"commit per event: {busy['commit_s_per_event_idle'] * 1e6:.1f} us idle, "
                f"{busy['commit_s_per_event_busy'] * 1e6:.1f} us beside {trainer}: "
                f"{ratio} = {busy['ratios']['commit_busy_vs_idle']:.2f}{target}"
            )

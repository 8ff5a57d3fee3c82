"""``rolloutlog bench domain``: checkpoint, restore and memory of the rollout state machine.

Registered into the ``bench`` group by :mod:`rolloutlog.cli.bench`. The benchmark
module is imported when the command runs, so ``--help`` stays fast.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from rich.table import Table

from ._options import db_dir_option, flag, json_option, optional_int

_PARTS = ("checkpoint", "restore", "memory", "loop", "turns")


def _fmt_s(seconds: float | None) -> str:
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else (f"{x:.1f}" if x >= 10 else f"{x:.2f}")


def _table(title: str, *column_rows: tuple[str, ...], left: str | None = None) -> Table:
    """A rich table of ``column_rows``' columns, right-aligned but for ``left``."""
    from rich.table import Table

    table = Table(title=title)
    for col in (col for row in column_rows for col in row):
        table.add_column(col, justify="left" if col == left else "right")
    return table


def print_report(result: dict[str, Any]) -> None:
    """Rich tables of the ratios and the raw numbers behind them."""
    from rich.console import Console

    from rolloutlog.bench.domain_bench import size_label

    console = Console()
    if not console.is_terminal:
        console = Console(width=150)
    ratios = _table(
        "rolloutlog bench domain: ratios (same run, same machine)",
        ("ratio", "value", "target", "met"),
        left="ratio",
    )
    for name, value in result["ratios"].items():
        target = result["targets"].get(name)
        met = None if target is None else target["met"]
        ratios.add_row(
            name,
            _fmt_ratio(value),
            "-" if target is None else f"{target['comparison']} {target['target']:g}",
            "-" if met is None else ("[green]yes[/green]" if met else "[red]no[/red]"),
        )
    console.print(ratios)

    loop = result.get("loop")
    if loop:
        pause = loop["loop_pause_ms"]
        console.print(
            f"event loop with {size_label(loop['ready_groups'])} ready groups: longest pause "
            f"{pause['max']:.1f} ms (p99 {pause['p99']:.2f} ms, {pause['samples']} samples) "
            f"over {loop['cycles']} training cycles and {loop['snapshots_written']} "
            f"snapshots; a full-state encoding takes {loop['full_snapshot_encode_ms']:.0f} ms"
        )
        full = loop["full_collection"]
        console.print(
            f"one full gc.collect() with {size_label(full['groups'])} groups of "
            f"{full['group_size']}: {full['untracked_ms']:.1f} ms as the state holds them "
            f"(siblings as untracked rows), {full['tracked_ms']:.1f} ms with every sibling "
            "an object of its own"
        )

    ckpt = result.get("checkpoint")
    if ckpt:
        table = _table(
            "checkpoint() vs full-state snapshot (SQLite)",
            ("ready groups", "log events", "checkpoint p50", "checkpoint p90"),
            ("checkpoint max", "snapshot p50", "snapshot size"),
        )
        for label in ("small", "large"):
            row = ckpt[label]
            table.add_row(
                f"{row['ready_groups']:,}",
                f"{row['log_events']:,}",
                _fmt_s(row["checkpoint"]["median_s"]),
                _fmt_s(row["checkpoint"]["p90_s"]),
                _fmt_s(row["checkpoint"]["max_s"]),
                _fmt_s(row["snapshot_baseline"]["median_s"]),
                _fmt_bytes(row["snapshot_baseline"]["snapshot_bytes"]),
            )
        console.print(table)

    restore = result.get("restore")
    if restore:
        table = _table(
            "RolloutController.restore (newest snapshot + tail)",
            ("log events", "db size", "generated in", "snapshots", "events replayed"),
            ("restore p50", "replay p50", "live groups", "invariants"),
        )
        for label in ("small", "large"):
            row = restore[label]
            log = row["log"]
            table.add_row(
                f"{log['events']:,}",
                _fmt_bytes(log["db_bytes"]),
                _fmt_s(log["generate_s"]),
                f"{log['snapshots']:,}",
                f"{row['events_replayed']:,}",
                _fmt_s(row["restore"]["median_s"]),
                _fmt_s(row["phase_median_s"].get("replay")),
                f"{log['live_groups']:,}",
                row["invariants"],
            )
        console.print(table)

    memory = result.get("memory")
    if memory:
        table = _table(
            "state memory (tracemalloc) against live groups and history",
            ("case", "steps", "events", "live groups", "state", "per live group"),
            left="case",
        )
        for case in ("base", "history_x10", "live_x10"):
            row = memory[case]
            table.add_row(
                case,
                f"{row['steps']:,}",
                f"{row['events']:,}",
                f"{row['live_groups']:,}",
                _fmt_bytes(row["retained_bytes"]),
                _fmt_bytes(row["bytes_per_live_group"]),
            )
        if restore:
            for label in ("small", "large"):
                row = restore[label]
                mem = row["state_memory"]
                live = row["log"]["live_groups"]
                table.add_row(
                    f"restored {size_label(row['intended_events'])}-event log",
                    "-",
                    f"{row['log']['events']:,}",
                    f"{live:,}",
                    _fmt_bytes(mem["retained_bytes"]),
                    _fmt_bytes(mem["retained_bytes"] / live if live else None),
                )
        console.print(table)
        console.print(
            f"history ×10 / base: {_fmt_ratio(memory['history_x10_over_base'])}   "
            f"live groups ×10 / base: {_fmt_ratio(memory['live_x10_over_base'])}   "
            f"marginal bytes per live group: {_fmt_bytes(memory['marginal_bytes_per_live_group'])}"
        )
    load = result["machine"]
    console.print(
        f"[dim]{load['cpus']} CPUs, load average {load['loadavg_1_5_15']} at start, "
        f"{load['loadavg_end']} at end; {result['seconds']:.0f} s in all[/dim]"
    )


@click.command("domain")
@json_option("Print one JSON object (ratios + raw).")
@flag("--small", "Smaller sizes for a quick run: 10k vs 100 groups, 200k vs 20k events.")
@optional_int(
    "--events",
    minimum=1000,
    help="Events in the large restore log (default 10,000,000; --small: 200,000).",
)
@optional_int(
    "--baseline-events",
    minimum=100,
    help="Events in the baseline restore log (default 100,000; --small: 20,000).",
)
@optional_int(
    "--snapshot-interval",
    minimum=2,
    help="Events between snapshots in the restore logs (default 50,000; the restored "
    "checkpoint lies half an interval after the newest snapshot).",
)
@optional_int(
    "--checkpoint-groups",
    minimum=1,
    help="Ready groups in the large checkpoint state (default 100,000).",
)
@optional_int(
    "--baseline-groups",
    minimum=1,
    help="Ready groups in the baseline checkpoint state (default 1,000).",
)
@optional_int("--repeats", minimum=1, help="Checkpoints timed per state (default 31).")
@optional_int("--restore-repeats", minimum=1, help="Restores timed per log (default 3).")
@optional_int(
    "--groups-per-step", minimum=1, help="Prompts per step of the generated run (default 64)."
)
@optional_int(
    "--group-size", minimum=1, help="Siblings per prompt of the generated run (default 16)."
)
@optional_int(
    "--memory-steps",
    minimum=1,
    help="Training steps of the memory benchmark's base case (default 10; --small: 4).",
)
@click.option(
    "--only",
    "only",
    type=click.Choice(_PARTS),
    multiple=True,
    help="Run only these parts (repeatable); default: all five.",
)
@flag(
    "--full-replay-check",
    "Also replay each generated log from its first event without snapshots and "
    "compare with the generator's fold (slow at 10M).",
)
@db_dir_option("Folder for the benchmark's SQLite files (default: the system temp folder).")
@flag("--keep", "Keep the SQLite files after the run.")
@flag("--check", "Exit with status 1 when a target is missed.")
def domain(
    as_json: bool,
    small: bool,
    events: int | None,
    baseline_events: int | None,
    snapshot_interval: int | None,
    checkpoint_groups: int | None,
    baseline_groups: int | None,
    repeats: int | None,
    restore_repeats: int | None,
    groups_per_step: int | None,
    group_size: int | None,
    memory_steps: int | None,
    only: tuple[str, ...],
    full_replay_check: bool,
    db_dir: Path | None,
    keep: bool,
    check: bool,
) -> None:
    """Checkpoint, restore and memory of the rollout state machine, with ratios.

    \b
    checkpoint_100k_vs_1k                 checkpoint() with 100k vs 1k ready groups (<= 1.5)
    snapshot_baseline_vs_checkpoint_100k  full-state snapshot vs checkpoint() (>= 100)
    restore_10m_vs_100k                   restore() of a 10M vs 100k-event log (<= 1.5)

    The 10M-event log is generated first (several minutes on a small machine; progress
    goes to stderr).
    """
    from rolloutlog.bench.domain_bench import (
        FULL_SIZES,
        SMALL_SIZES,
        run_domain_benchmark,
        scaled_sizes,
    )

    sizes = scaled_sizes(
        SMALL_SIZES if small else FULL_SIZES,
        events=events,
        baseline_events=baseline_events,
        checkpoint_groups=checkpoint_groups,
        baseline_groups=baseline_groups,
        snapshot_interval=snapshot_interval,
        checkpoint_repeats=repeats,
        restore_repeats=restore_repeats,
        groups_per_step=groups_per_step,
        group_size=group_size,
        memory_steps=memory_steps,
    )
    if sizes.restore_events[0] <= sizes.restore_tail or sizes.restore_events[1] <= (
        sizes.restore_tail
    ):
        raise click.BadParameter(
            f"every restore log needs more events than the tail ({sizes.restore_tail}); "
            "raise --baseline-events/--events or lower --snapshot-interval"
        )

    def progress(message: str) -> None:
        click.echo(message, err=True)

    result = run_domain_benchmark(
        sizes,
        parts=only or _PARTS,
        db_dir=db_dir,
        keep_files=keep,
        progress=progress,
        full_replay_check=full_replay_check,
    )
    if as_json:
        click.echo(json.dumps(result, indent=2, default=str))
    else:
        print_report(result)
    if check and any(t["met"] is False for t in result["targets"].values()):
        sys.exit(1)

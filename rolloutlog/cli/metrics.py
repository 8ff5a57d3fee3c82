"""``rolloutlog metrics`` (offline projections of a stored run) and ``rolloutlog
serve-metrics`` (a Prometheus exporter that tails the log).

Both recompute the same fold the live exporter runs (:mod:`rolloutlog.controller.metrics`), from
the log alone, so they work on any stored run, from any machine that reaches the
database, while the run is going or long after. Append latency and checkpoint/restore
durations are not in the log: only the exporter embedded in a training process
(``telemetry: {enabled: true}``) has them.
"""

from __future__ import annotations

import json
import signal
import threading
from datetime import UTC, datetime
from typing import Any

import click
from rich import box
from rich.console import Console
from rich.table import Table

from rolloutlog.eventstore import EventStore, StoreError, normalise_url

from ._options import flag, json_option, optional_int, run_option, shown
from .common import open_store

_URL_HELP = "DB_URL is sqlite:///PATH or postgresql+psycopg://USER@HOST:PORT/DB."


def _display(url: str) -> str:
    try:
        return normalise_url(url).render_as_string(hide_password=True)
    except StoreError:
        return url


def _pick_run(store: EventStore, run_id: str | None) -> str:
    """``run_id`` if the log has it; by default the only (or most recent) run."""
    runs = store.list_runs()
    if not runs:
        raise click.ClickException(f"the log at {_display(str(store.url))} holds no run yet")
    names = [r.run_id for r in runs]
    if run_id is None:
        return names[-1]
    if run_id not in names:
        shown = ", ".join(names[-10:]) + (
            f" (and {len(names) - 10} more)" if len(names) > 10 else ""
        )
        raise click.ClickException(f"no run {run_id!r} in the log; runs: {shown}")
    return run_id


@click.command("metrics")
@click.argument("db_url")
@run_option("Run id (default: the most recent run).")
@optional_int(
    "--from",
    "from_seq",
    minimum=1,
    help="First offset of the range: counters, histograms and series count only events "
    "from here on (gauges are always the values at the range's end).",
)
@optional_int(
    "--to",
    "to_seq",
    minimum=1,
    help="Last offset of the range (default: the end of the current history). An offset a "
    "restore abandoned gives the history of that branch.",
)
@shown(
    "--steps",
    "step_rows",
    type=click.IntRange(0),
    default=20,
    help="Rows of the per-step table (the newest ones; 0: all). JSON always has all.",
)
@json_option()
def metrics(
    db_url: str,
    run_id: str | None,
    from_seq: int | None,
    to_seq: int | None,
    step_rows: int,
    as_json: bool,
) -> None:
    """Print the metrics of a stored run, recomputed from its log.

    The same projection the live exporter serves: counters, gauges, histogram summaries,
    rates, and the series on the train-step axis (one row per trained step, with its
    wall-clock UTC time) and of restores. Only the run's history counts: work a restore
    abandoned is left out. Append latency and checkpoint/restore durations are live-only.
    """
    from rolloutlog.controller.metrics import METRICS, project_history

    if from_seq is not None and to_seq is not None and from_seq > to_seq:
        raise click.UsageError(f"--from {from_seq} is after --to {to_seq}")
    store = open_store(db_url)
    try:
        run = _pick_run(store, run_id)
        store.check_log(run)  # never count an incomplete log (issue 9)
        last = store.last_seq(run)
        if to_seq is not None and to_seq > last:
            raise click.ClickException(
                f"--to {to_seq} is outside run {run!r}, whose log holds offsets 1..{last}"
            )
        values = project_history(store, run, from_seq=from_seq, to_seq=to_seq).values()
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        store.close()
    values["db"] = _display(db_url)
    values["not_in_log"] = sorted(name for name, info in METRICS.items() if info.live_only)
    if as_json:
        click.echo(json.dumps(values, sort_keys=True))
        return
    _print(Console(), values, step_rows)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _print(console: Console, v: dict[str, Any], step_rows: int) -> None:
    last = v["last_event"] or {}
    head = Table(title=f"rolloutlog metrics — run {v['run_id']}", show_header=False)
    head.add_column("what")
    head.add_column("value")
    for key, value in (
        ("log", v["db"]),
        ("offsets", f"{v['from_offset']}..{v['offset']}"),
        ("history (offset ranges)", ", ".join(f"{a}..{b}" for a, b in v["history"])),
        ("run started (UTC)", v["started_at"]),
        ("newest event (UTC)", last.get("time")),
        ("epoch", last.get("epoch")),
        ("wall-clock span of the range", f"{v['wall_seconds']:.3f} s"),
    ):
        head.add_row(key, _fmt(value))
    console.print(head)

    counters = Table(title="counters (the range): work done, all epochs / the history")
    counters.add_column("metric", no_wrap=True)  # names stay whole (they are searched)
    counters.add_column("labels", overflow="fold")
    counters.add_column("work done", justify="right", no_wrap=True)
    counters.add_column("history", justify="right", no_wrap=True)
    history = v.get("history_counters", {})
    for name, value in v["counters"].items():
        if isinstance(value, list):
            mine = history.get(name, [])
            for i, sample in enumerate(value):
                labels = ", ".join(f"{k}={x}" for k, x in sample.items() if k != "value")
                other = mine[i]["value"] if i < len(mine) else None
                counters.add_row(name, labels, _fmt(sample["value"]), _fmt(other))
        else:
            counters.add_row(name, "", _fmt(value), _fmt(history.get(name)))
    console.print(counters)

    gauges = Table(title="gauges (at the end of the range)")
    gauges.add_column("metric")
    gauges.add_column("value", justify="right")
    for name, value in v["gauges"].items():
        if name.endswith("_timestamp_seconds") and value is not None:
            # A Unix time reads as a date, not as 1.7961e+09.
            shown = datetime.fromtimestamp(value, UTC).isoformat(timespec="milliseconds")
            gauges.add_row(name, shown)
        else:
            gauges.add_row(name, _fmt(value))
    console.print(gauges)

    rates = Table(title="rates (per second of log time over the range)")
    rates.add_column("rate")
    rates.add_column("per second", justify="right")
    for name, value in v["rates"].items():
        rates.add_row(name.removesuffix("_per_second"), _fmt(value))
    console.print(rates)

    hists = Table(title="histograms")
    hists.add_column("metric", no_wrap=True)
    for col in ("count", "mean", "min", "max"):
        hists.add_column(col, justify="right")
    hists.add_column("values", overflow="fold")
    for name, h in v["histograms"].items():
        dist = h.get("values") or {k: n for k, n in h["buckets"].items()}
        hists.add_row(
            name,
            _fmt(h["count"]),
            _fmt(h["mean"]),
            _fmt(h["min"]),
            _fmt(h["max"]),
            " ".join(f"{k}:{n}" for k, n in dist.items()),
        )
    console.print(hists)

    for row in v["restores"]:
        restore = Table(title=f"restore at offset {row['offset']}", show_header=False)
        restore.add_column("what")
        restore.add_column("value", justify="right")
        for title, key in (
            ("time (UTC)", "time"),
            ("epoch opened", "epoch"),
            ("from checkpoint at offset", "from_offset"),
            ("checkpoint train step", "checkpoint_train_step"),
            ("mode / granularity", None),
            ("log time rolled back (s)", "rolled_back_seconds"),
            ("complete groups restored", "complete_groups_restored"),
            ("unfinished groups found", "unfinished_groups_found"),
            ("siblings reused", "siblings_reused"),
            ("siblings re-run", "siblings_rerun"),
            ("siblings salvaged", "siblings_salvaged"),
        ):
            value = f"{row['mode']} / {row['granularity']}" if key is None else row[key]
            restore.add_row(title, _fmt(value))
        console.print(restore)

    rows = v["steps"][-step_rows:] if step_rows else v["steps"]
    steps = Table(
        title=f"train steps ({len(rows)} of {len(v['steps'])}; time of day UTC)",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    cols = (
        ("step", "step"),
        ("time", "time"),
        ("wall\ns", "wall_seconds"),
        ("epoch", "epoch"),
        ("groups", "groups"),
        ("reward\nmean", "reward_mean"),
        ("stale\nmax", "staleness_max"),
        ("stale\nmean", "staleness_mean"),
        ("tokens\ncommitted", "tokens_committed"),
    )
    for title, _ in cols:
        steps.add_column(title, justify="right", no_wrap=True)
    for row in rows:
        cells = []
        for _, key in cols:
            value = row[key]
            if key == "time":
                value = value[11:23]  # HH:MM:SS.fff of the ISO time
            elif isinstance(value, float):
                value = f"{value:.4g}"
            cells.append(_fmt(value))
        steps.add_row(*cells)
    console.print(steps)
    console.print(
        "[dim]not in the log (live only, from the exporter embedded in training): "
        + ", ".join(v["not_in_log"])
        + "[/dim]"
    )


@click.command("serve-metrics")
@click.argument("db_url")
@shown(
    "--port",
    type=click.IntRange(0, 65535),
    default=9400,
    help="HTTP port (0: any free port, printed at start).",
)
@shown("--host", default="0.0.0.0", help="Address to listen on.")
@click.option(
    "--run",
    "run_ids",
    multiple=True,
    help="Run id; repeat for several runs (default: the most recent run).",
)
@flag(
    "--all-runs",
    "Serve every run of the log (the newest --max-runs), runs created later included.",
)
@shown(
    "--max-runs",
    type=click.IntRange(1),
    default=20,
    help="With --all-runs: serve at most this many runs, the newest ones.",
)
@shown(
    "--interval",
    type=click.FloatRange(min=0.05),
    default=2.0,
    help="Seconds between polls of the log.",
)
def serve_metrics(
    db_url: str,
    port: int,
    host: str,
    run_ids: tuple[str, ...],
    all_runs: bool,
    max_runs: int,
    interval: float,
) -> None:
    """Serve runs' metrics to Prometheus at http://HOST:PORT/metrics, tailing the log.

    Polls the log every --interval seconds and folds the new events of every epoch:
    the *_total counters count all the work done and never decrease, also across
    restores; gauges follow the run's current history. Every series carries a run_id
    label. They always equal `rolloutlog metrics` on the same log. Runs until
    interrupted.
    """
    from rolloutlog.controller.metrics import RunsTailer, start_exporter

    if all_runs and run_ids:
        raise click.UsageError("--all-runs and --run exclude each other")
    store = open_store(db_url)
    try:
        if all_runs:
            names: list[str] = []
        elif run_ids:
            names = [_pick_run(store, r) for r in dict.fromkeys(run_ids)]
        else:
            names = [_pick_run(store, None)]
        tailer = RunsTailer(store, names, interval=interval, max_runs=max_runs)
        tailer.poll()
    except StoreError as exc:
        store.close()
        raise click.ClickException(str(exc)) from exc
    except click.ClickException:
        store.close()
        raise
    try:
        handle = start_exporter(tailer.sources, port, addr=host)
    except OSError as exc:
        store.close()
        raise click.ClickException(f"cannot serve on {host}:{port}: {exc}") from exc
    stop = threading.Event()

    def _stop(_signum: int, _frame: object) -> None:
        stop.set()

    previous = signal.signal(signal.SIGTERM, _stop)
    if all_runs:
        what = f"every run (the newest {max_runs}; {len(tailer.sources())} now)"
    else:
        what = "run " + ", ".join(names)
    click.echo(
        f"serving metrics of {what} ({_display(db_url)}) at {handle.url} "
        f"(port {handle.port}), polling every {interval:g} s; Ctrl-C stops"
    )
    tailer.start()
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        tailer.close()
        handle.close()
        store.close()

"""``rolloutlog audit DB_URL``: canned audit queries and read-only SQL over the audit views.

Without a query option it prints one summary row per run. Every query reads the run's
current history only (events a restore abandoned are left out; see
``docs/sql-cookbook.md``). ``--json`` prints a JSON list of row objects.
"""

from __future__ import annotations

import json
import os
import re
import sys
from datetime import UTC, datetime
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from rolloutlog.controller.sql_audit import DEFAULT_LIMIT, DEFAULT_TIMEOUT_S, QueryResult, SqlAudit
from rolloutlog.eventstore import StoreError

from ._options import flag, json_option, run_option, seconds_option, shown

_INT = re.compile(r"^-?\d+$")

#: Columns that the views hold as booleans (SQLite stores them as 1 / 0).
_BOOL_COLUMNS = frozenset({"trained", "forced", "evicted_recovered"})


def _parse_params(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``--param NAME=VALUE`` pairs as a dict (integer-looking values as integers)."""
    params: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_]\w*", name):
            raise click.BadParameter(f"{pair!r} is not NAME=VALUE", param_hint="--param")
        params[name] = int(value) if _INT.match(value) else value
    return params


def _value(column: str, value: Any) -> Any:
    """One value of a canned query, as printed on both dialects."""
    if value is None:
        return None
    if column in _BOOL_COLUMNS:
        return bool(value)
    if column.endswith("_at") and isinstance(value, str):
        # SQLite stores UTC timestamps as naive text, PostgreSQL answers in the session's
        # time zone: print both as UTC ISO 8601.
        try:
            ts = datetime.fromisoformat(value)
        except ValueError:
            return value
        return (ts.astimezone(UTC) if ts.tzinfo else ts.replace(tzinfo=UTC)).isoformat()
    return value


def _normalise(result: QueryResult) -> QueryResult:
    """Canned queries print alike on both dialects: booleans, UTC ISO timestamps."""
    rows = [{k: _value(k, v) for k, v in row.items()} for row in result.rows]
    return QueryResult(result.columns, rows, result.truncated)


def _cell(column: str, value: Any) -> Text:
    """A table cell: NULL dimmed, booleans as true/false, short floats and timestamps."""
    if value is None:
        return Text("NULL", style="dim")
    if isinstance(value, bool):
        return Text("true" if value else "false")
    if isinstance(value, float):
        return Text(f"{value:.4g}")
    if column.endswith("_at") and isinstance(value, str):
        return Text(value[:23].replace("T", " "))
    return Text(str(value))


def _details(row: dict[str, Any]) -> str:
    """An event's payload as ``key=value`` pairs, less the fields its columns show."""
    try:
        payload = json.loads(row["payload"])
    except (TypeError, ValueError):
        return str(row["payload"])
    if not isinstance(payload, dict):
        return str(payload)
    shown = {k for k, v in row.items() if k != "payload" and payload.get(k) == v}
    return " ".join(
        f"{k}={json.dumps(v) if isinstance(v, str | list | dict) else v}"
        for k, v in payload.items()
        if k not in shown and v is not None
    )


def _print(result: QueryResult, title: str, as_json: bool, *, events: bool = False) -> None:
    """The rows as JSON, or as a rich table (``events``: condense the payload column)."""
    if as_json:
        click.echo(json.dumps(result.rows))
    else:
        console = Console()
        if not console.is_terminal and "COLUMNS" not in os.environ:
            # A pipe or a file: event lists keep their columns (COLUMNS overrides).
            console = Console(width=160)
        if not result.rows:
            console.print(f"{title}: no rows")
        elif len(result.columns) > 6 and len(result.rows) <= 5 and not events:
            # Wide rows (e.g. one summary per run) read better as columns of fields,
            # one block per row, than squeezed into one table.
            for i, row in enumerate(result.rows):
                name = f"{title} ({i + 1} of {len(result.rows)})" if len(result.rows) > 1 else title
                table = Table(title=name, title_justify="left")
                table.add_column("column")
                table.add_column("value", overflow="fold")
                for col in result.columns:
                    table.add_row(col, _cell(col, row[col]))
                console.print(table)
        else:
            table = Table(title=title, title_justify="left")
            columns = list(result.columns)
            if events:  # event lists: the payload condensed to what the columns miss
                columns = [c for c in columns if c != "payload"]
            for col in columns:
                table.add_column(col, overflow="fold", min_width=min(len(col), 12))
            if events:
                table.add_column("details", overflow="fold", ratio=1)
            for row in result.rows:
                cells = [_cell(c, row[c]) for c in columns]
                if events:
                    cells.append(Text(_details(row)))
                table.add_row(*cells)
            console.print(table)
    if result.truncated:
        click.echo(
            f"note: output truncated to {len(result.rows)} rows (raise it with --limit)",
            err=True,
        )


@click.command()
@click.argument("db_url")
@run_option("Run id (default: the database's only run).")
@click.option("--prompt", "prompt_index", type=int, help="Every event about prompt IDX.")
@click.option("--group", "group_id", type=int, help="Every event about group G.")
@click.option("--step", "train_step", type=int, help="The batch of train step N.")
@flag("--dropped", "Prompts dropped or evicted, and why.")
@flag("--staleness", "Staleness (and mean reward) per step.")
@flag("--recovery", "What each restore recovered.")
@click.option(
    "--sql",
    help="A read-only SELECT/WITH query over the views ('-' reads it from stdin); "
    ":run_id is bound from --run (default: the database's only run).",
)
@click.option(
    "--param",
    "params",
    multiple=True,
    metavar="NAME=VALUE",
    help="Bind :NAME in --sql (integers are bound as integers, other values as text).",
)
@shown("--limit", type=click.IntRange(1), default=DEFAULT_LIMIT, help="Most rows printed.")
@seconds_option(
    "--timeout", "timeout_s", default=DEFAULT_TIMEOUT_S, help="Seconds a query may run."
)
@flag(
    "--allow-privileged-role",
    "PostgreSQL: run --sql even though the URL's role can write, create roles or is "
    "a superuser (still one statement in a read-only transaction with the timeout). "
    "Without it --sql needs a reader role: rolloutlog db create-reader.",
)
@json_option("Print a JSON list of row objects.")
def audit(
    db_url: str,
    run_id: str | None,
    prompt_index: int | None,
    group_id: int | None,
    train_step: int | None,
    dropped: bool,
    staleness: bool,
    recovery: bool,
    sql: str | None,
    params: tuple[str, ...],
    limit: int,
    timeout_s: float,
    allow_privileged_role: bool,
    as_json: bool,
) -> None:
    """Audit the run(s) logged at DB_URL with SQL (read-only).

    DB_URL is sqlite:///PATH or postgresql+psycopg://USER@HOST:PORT/DB. With no query
    option, one summary row per run. The views and a cookbook of queries are in
    docs/sql-cookbook.md. On PostgreSQL, --sql runs only as a read-only role (create
    one with rolloutlog db create-reader) unless --allow-privileged-role is given.
    """
    chosen = [
        name
        for name, on in (
            ("--prompt", prompt_index is not None),
            ("--group", group_id is not None),
            ("--step", train_step is not None),
            ("--dropped", dropped),
            ("--staleness", staleness),
            ("--recovery", recovery),
            ("--sql", sql is not None),
        )
        if on
    ]
    if len(chosen) > 1:
        raise click.UsageError(f"choose one query, not {' and '.join(chosen)}")
    if params and sql is None:
        raise click.UsageError("--param binds parameters of --sql only")
    bound = _parse_params(params)
    if sql == "-":
        sql = sys.stdin.read()
    try:
        with SqlAudit(
            db_url, limit=limit, timeout_s=timeout_s, allow_privileged_role=allow_privileged_role
        ) as db:
            db.store.check_log(run_id)  # the views must not count an incomplete log
            if sql is not None:
                db.require_reader()  # before anything else runs for the query
                if run_id is not None or (":run_id" in sql and "run_id" not in bound):
                    # :run_id is --run, or the database's only run when --run is omitted.
                    bound.setdefault("run_id", db.resolve_run(run_id))
                result, title = db.select(sql, bound), "query"
            elif not chosen:
                result, title = _normalise(db.summary(run_id)), "runs"
            else:
                run = db.resolve_run(run_id)
                if prompt_index is not None:
                    result = db.prompt_history(run, prompt_index)
                    title = f"run {run}: prompt {prompt_index}"
                elif group_id is not None:
                    result = db.group_history(run, group_id)
                    title = f"run {run}: group {group_id}"
                elif train_step is not None:
                    result = db.step_batch(run, train_step)
                    title = f"run {run}: batch of step {train_step}"
                elif dropped:
                    result, title = db.dropped(run), f"run {run}: prompts dropped or evicted"
                elif staleness:
                    result, title = db.staleness(run), f"run {run}: staleness per step"
                else:
                    result, title = db.recovery(run), f"run {run}: recoveries"
                result = _normalise(result)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    _print(result, title, as_json, events=prompt_index is not None or group_id is not None)

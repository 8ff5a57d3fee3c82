"""``rolloutlog replay``: debug a run's history and its restores."""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from rich.console import Console
from rich.padding import Padding
from rich.text import Text

from rolloutlog.eventstore import StoreError

from ._options import flag, json_option, optional_int, run_option
from .common import open_store, pick_run


def _target(spec: str) -> tuple[str, int]:
    kind, _, value = spec.partition(":")
    if kind not in ("group", "prompt") or not value.isdigit():
        raise click.BadParameter(f"{spec!r}: use group:ID or prompt:INDEX", param_hint="--explain")
    return kind, int(value)


def _outcome(run_id: str, result: Any, *fields: str) -> tuple[dict[str, Any], bool]:
    """A check's JSON: the run id and ``result``'s ``fields``, and whether the last of
    them (the violation or mismatch found, if any) is set."""
    out: dict[str, Any] = {"run_id": run_id, **{f: getattr(result, f) for f in fields}}
    return out, out[fields[-1]] is not None


@click.command()
@click.argument("db_url")
@run_option("Run id (default: the newest run).")
@optional_int("--to", "to_seq", minimum=0, help="Offset to stop at.")
@flag("--check", "Check every invariant after every decision.")
@click.option(
    "--diff",
    nargs=2,
    type=click.IntRange(0),
    default=None,
    metavar="A B",
    help="What changed between offsets A and B.",
)
@click.option(
    "--explain",
    "explain_spec",
    default=None,
    metavar="group:ID|prompt:IDX",
    help="The full history of one group or prompt.",
)
@flag("--verify-decisions", "Re-run every recorded decision and report the first that differs.")
@json_option("Machine-readable output.")
def replay(
    db_url: str,
    run_id: str | None,
    to_seq: int | None,
    check: bool,
    diff: tuple[int, int] | None,
    explain_spec: str | None,
    verify_decisions: bool,
    as_json: bool,
) -> None:
    """Replay a run's log: the state at any offset (default), or one of the modes below.

    Exit code 1 when --check finds a violation or --verify-decisions a mismatch.
    """
    from rolloutlog.controller import replay_tool as rt
    from rolloutlog.controller.domain.errors import DomainError

    store = open_store(db_url)
    console = Console()
    try:
        rid = pick_run(store, run_id)
        failed = False
        out: dict[str, Any]
        if check:
            res = rt.check_history(store, rid, to_seq)
            out, failed = _outcome(rid, res, "events_checked", "decisions_checked", "violation")
        elif diff is not None:
            out = rt.diff_states(rt.state_at(store, rid, diff[0]), rt.state_at(store, rid, diff[1]))
        elif explain_spec is not None:
            kind, value = _target(explain_spec)
            events = (
                rt.explain(store, rid, group_id=value)
                if kind == "group"
                else rt.explain(store, rid, prompt=value)
            )
            out = {"run_id": rid, "target": explain_spec, "events": events}
        elif verify_decisions:
            v = rt.verify_decisions(store, rid, to_seq)
            out, failed = _outcome(rid, v, "decisions_verified", "decisions_skipped", "mismatch")
        else:
            out = rt.state_summary(rt.state_at(store, rid, to_seq))
    except (StoreError, DomainError, ValueError) as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc
    finally:
        store.close()
    if as_json:
        click.echo(json.dumps(out, default=str))
    else:
        _render(console, out)
    if failed:
        sys.exit(1)


def _render(console: Console, out: dict[str, Any]) -> None:
    if "events" in out:
        _render_explain(console, out)
        return
    if "violation" in out:
        v = out["violation"]
        if v is None:
            console.print(
                f"[green]all invariants hold[/green] over {out['events_checked']} events "
                f"({out['decisions_checked']} decisions)"
            )
        else:
            console.print(
                f"[red]invariant violated[/red] at offset {v['offset']} ({v['event_type']})"
            )
            console.print(f"  {v['error']} (invariant {v['invariant']}): {v['message']}")
            for gid, hist in v["group_histories"].items():
                console.print(f"  history of group {gid}:")
                for e in hist:
                    console.print(f"    {e['offset']:>8}  {e['type']}  {e['event']}")
        return
    if "mismatch" in out:
        m = out["mismatch"]
        if m is None:
            console.print(
                f"[green]every decision reproduces[/green]: {out['decisions_verified']} verified, "
                f"{out['decisions_skipped']} with outside inputs skipped"
            )
        else:
            console.print(f"[red]decision differs[/red] at offset {m['offset']} ({m['command']})")
            console.print_json(json.dumps(m, default=str))
        return
    console.print_json(json.dumps(out, default=str))


#: Event fields left out of ``--explain`` details: long identifiers and fields the
#: target already names (the group or prompt asked about).
_EXPLAIN_HIDDEN = ("payload_id",)


def _render_explain(console: Console, out: dict[str, Any]) -> None:
    """One entry per event: a header line (offset, epoch, step, type; abandoned events
    marked) and the event's fields wrapped beneath it, legible at 80 columns."""
    target = out["target"]
    console.print(f"[bold]history of {target} in run {out['run_id']}[/bold]", highlight=False)
    console.print(
        "[dim]offset, epoch, train step, event (abandoned: rolled back by a restore)[/dim]",
        highlight=False,
    )
    kind, _, value = target.partition(":")
    hidden = {*_EXPLAIN_HIDDEN, "group_id" if kind == "group" else "prompt_index"}
    for e in out["events"]:
        mark = "" if e["in_history"] else "  [red]abandoned[/red]"
        console.print(
            f"[bold]{e['offset']:>7}[/bold]  e{e['epoch']}  step {e['train_step']}  "
            f"[cyan]{e['type']}[/cyan]{mark}",
            highlight=False,
        )
        fields = {
            k: v
            for k, v in e["event"].items()
            if k not in hidden and k != "run_id" and v is not None
        }
        if kind == "group" and str(e["event"].get("group_id", value)) != value:
            fields["group_id"] = e["event"]["group_id"]
        if fields:
            details = Text("  ".join(f"{k}={_short(v)}" for k, v in fields.items()), style="dim")
            console.print(Padding(details, (0, 0, 0, 9)), overflow="fold")


def _short(value: Any) -> str:
    """A field value for one line: long lists and strings cut with their length."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and len(value) > 8:
        return f"[{', '.join(map(str, value[:8]))}, ... ({len(value)} items)]"
    text = str(value)
    return text if len(text) <= 60 else f"{text[:57]}..."

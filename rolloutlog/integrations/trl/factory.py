"""Worker factories: the rolloutlog worker built from a ``WorkerContext``.

:func:`bench_worker_factory` is what ``rolloutlog bench trl`` measures against the
in-memory worker, and what the CPU training harness (``rolloutlog/integrations/trl/cpu.py``)
and ``rolloutlog demo --trainer trl`` train TRL's real ``AsyncGRPOTrainer`` with.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .weights import NoOpWeightTransfer, RolloutlogWeightTransfer
from .worker import RolloutlogWorker

if TYPE_CHECKING:
    from rolloutlog.bench.trl_bench import WorkerContext, WorkerParts

#: The log's file in the run's output folder (unless ``context.extra["store"]`` names one).
STORE_FILE = "rolloutlog.db"


def store_url(output_dir: Path) -> str:
    """The SQLite log of a run whose trainer writes to ``output_dir``."""
    return f"sqlite:///{Path(output_dir).resolve() / STORE_FILE}"


def bench_worker_factory(context: WorkerContext) -> WorkerParts:
    """A :class:`RolloutlogWorker` for ``context``, its weight transfer and its callback.

    The log lives in ``context.output_dir`` (the trainer's ``output_dir``), so a resumed
    run in the same folder finds it; the callback restores the worker from
    ``checkpoint-N/rolloutlog_state.json`` when the trainer resumes. ``context.extra``
    may set ``store`` (a log URL), ``lookahead``, ``passes``, ``timeout_s``,
    ``wait_for_publish`` (default ``False``: publishes run off the trainer's step) and
    ``max_inflight_groups`` (the groups generating at once, as the in-memory worker's
    option of that name; default: the runtime's sibling bound).
    """
    from rolloutlog.bench.trl_bench import WorkerParts
    from rolloutlog.controller.backends import make_backend
    from rolloutlog.controller.rollout_runtime import GenerationConfig

    extra: dict[str, Any] = dict(context.extra)
    if context.backend == "deterministic":
        # The deterministic backend generates from a seed, not from weights: it records
        # each publish's version, and no weights travel (``NoOpWeightTransfer``).
        options: dict[str, Any] = {"weight_shapes": None}
        if context.generation_latency_s:
            options["latency"] = context.generation_latency_s
        backend = make_backend(
            "deterministic", model_dir=context.model_dir, seed=context.seed, **options
        )
    else:
        backend = context.make_backend()
    generation = None
    if extra.get("max_inflight_groups"):
        generation = GenerationConfig(
            max_tokens=context.max_completion_length,
            max_in_flight_siblings=int(extra["max_inflight_groups"]) * context.num_generations,
        )
    worker = RolloutlogWorker(
        store=str(extra.get("store") or store_url(context.output_dir)),
        train_dataset=context.dataset,
        processing_class=context.tokenizer,
        reward_funcs=context.reward_funcs,
        backend=backend,
        args=context.config,
        num_generations=context.num_generations,
        lookahead=extra.get("lookahead"),
        generation=generation,
        passes=int(extra.get("passes", 1000)),
        timeout_s=float(extra.get("timeout_s", 120.0)),
        wait_for_publish=bool(extra.get("wait_for_publish", False)),
    )
    # A backend that serves the policy (torch, vLLM) gets the trainer's weights at each
    # sync: RolloutlogWeightTransfer hands them to the worker, which loads them with the
    # publish it records.
    transfer = (
        NoOpWeightTransfer()
        if context.backend == "deterministic"
        else RolloutlogWeightTransfer(worker)
    )
    return WorkerParts(worker, transfer, [worker.callback])

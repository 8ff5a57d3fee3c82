"""``rolloutlog demo --trainer trl``: TRL's real trainer, a SIGKILL, a resume, a checked log.

1. A child process trains TRL's ``AsyncGRPOTrainer`` on CPU (the tiny local Llama, the
   opt-in CPU reference attention of :mod:`.cpu`) with :class:`RolloutlogWorker` on the
   deterministic backend, saving ``checkpoint-N/`` every ``checkpoint_every`` steps.
2. One step after the first checkpoint (groups of later steps in flight and queued) the
   demo kills the child's process group with SIGKILL.
3. A new child resumes with ``trainer.train(resume_from_checkpoint=...)``; the worker's
   callback restores the log from the checkpoint's ``rolloutlog_state.json``.
4. The summary is computed, not asserted: prompts lost / trained twice and groups
   salvaged from the SQL log (:func:`.audit.audit_run`), samples TRL dropped as stale from
   TRL's own ``sample/dropped_stale_total`` metric in both children's logs.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from .audit import audit_run
from .checkpoint import read_checkpoint

#: TRL's stale-drop metric, as its PrinterCallback prints it (one dict per logged step).
_DROPPED = re.compile(r"'sample/dropped_stale_total': '?([0-9.eE+-]+)'?")


def samples_dropped_by_trl(*logs: Path) -> float:
    """The ``sample/dropped_stale_total`` TRL logged in these training logs (sum)."""
    total = 0.0
    for path in logs:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        total += sum(float(m) for m in _DROPPED.findall(text))
    return total


def run_trl_demo(
    *,
    workdir: Path,
    db_url: str,
    steps: int,
    checkpoint_every: int,
    seed: int = 0,
    deadline_s: float = 900.0,
) -> dict[str, Any]:
    """Run the demo (module doc) in ``workdir``; returns its summary."""
    import trl

    from rolloutlog.grpo.tiny_model import TinyModelSpec, build_tiny_model

    from . import cpu

    if steps < checkpoint_every + 2:
        raise ValueError(
            f"the TRL demo needs at least checkpoint_every + 2 = {checkpoint_every + 2} steps "
            f"to crash after a checkpoint and resume; got {steps}"
        )
    started = time.perf_counter()
    model_dir = workdir / "tiny-model"
    if not (model_dir / "config.json").is_file():
        build_tiny_model(model_dir, TinyModelSpec())
    out = workdir / f"trl-demo-{time.strftime('%Y%m%d-%H%M%S')}"
    spec = cpu.TrainRunSpec(
        model_dir=str(model_dir.resolve()),
        output_dir=str(out.resolve()),
        max_steps=steps,
        save_steps=checkpoint_every,
        seed=seed,
        num_prompts=max(16, 4 * steps),
        worker_factory="rolloutlog.integrations.trl:bench_worker_factory",
        # Slow generation and a pause after each step: the kill finds groups in flight.
        generation_latency_s=0.05,
        step_sleep_s=0.5,
        extra={"store": db_url},
    )
    result = cpu.kill_and_resume(
        spec,
        kill_at_step=checkpoint_every + 1,
        checkpoint_ready=cpu.rolloutlog_checkpoint_complete,
        deadline_s=deadline_s,
    )
    ckpt = read_checkpoint(result.checkpoint)
    audit = audit_run(db_url, ckpt.run_id)
    resumed = result.resumed.result or {}
    dropped = samples_dropped_by_trl(out / "first.log", out / "resumed.log")
    dropped += sum(
        float(e.get("sample/dropped_stale_total", 0.0)) for e in resumed.get("log_history", [])
    )
    first_step = resumed.get("first_step")
    return {
        "trl_version": trl.__version__,
        "run_id": ckpt.run_id,
        "db": db_url,
        "output_dir": str(out),
        "steps_planned": steps,
        "trl_global_step": resumed.get("global_step"),
        "killed_after_step": result.killed_at_step,
        "resumed_from_step": None if first_step is None else int(first_step) - 1,
        "resumed_from_checkpoint": str(result.checkpoint),
        "checkpoint_step": ckpt.trl_global_step,
        "restored_from_offset": audit.restored_from_offset,
        "steps_trained": audit.steps_trained,
        "prompts_trained": audit.prompts_trained,
        "prompts_lost": audit.prompts_lost,
        "prompts_trained_twice": audit.prompts_trained_twice,
        "groups_salvaged": audit.groups_salvaged,
        "siblings_salvaged": audit.siblings_salvaged,
        "salvaged_siblings_redispatched": audit.salvaged_siblings_redispatched,
        "unfinished_groups_found": audit.unfinished_groups_found,
        "samples_dropped_by_trl": int(dropped),
        "invariant_violations": audit.invariant_violations,
        "seconds": round(time.perf_counter() - started, 1),
    }


def demo_ok(summary: dict[str, Any]) -> bool:
    """Whether the demo showed a lossless resume (else the command exits 1)."""
    return (
        summary["prompts_lost"] == 0
        and summary["prompts_trained_twice"] == 0
        and summary["samples_dropped_by_trl"] == 0
        and summary["salvaged_siblings_redispatched"] == 0
        and not summary["invariant_violations"]
        and summary["steps_trained"] == summary["steps_planned"]
        and summary["resumed_from_step"] == summary["checkpoint_step"]
    )

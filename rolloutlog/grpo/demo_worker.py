"""The demo's worker process: runs the GRPO loop and prints progress as JSON lines.

Started by ``rolloutlog demo`` (twice: a fresh run that the demo kills with SIGKILL, then
a resume from the newest checkpoint). Usage: ``python -m rolloutlog.grpo.demo_worker
CONFIG_JSON RUN_ID fresh|resume [HOLD_AFTER_STEP]``.

With ``HOLD_AFTER_STEP``, the worker waits after each step report at or past that step
until the demo answers with a line on stdin: the demo decides there whether to crash it,
so a demo that is slow to read (a loaded machine) cannot let the worker train past the
planned crash and finish. EOF (the demo is gone) or :data:`HOLD_TIMEOUT_S` lets it go on.
"""

from __future__ import annotations

import asyncio
import json
import select
import sys
from collections.abc import Callable
from typing import Any

from .run_config import RunConfig


def _emit(msg: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(msg, default=str) + "\n")
    sys.stdout.flush()


#: Longest wait for the demo's answer after a step report (then the worker goes on).
HOLD_TIMEOUT_S = 600.0


def _emitter(hold_after: int | None) -> Callable[[dict[str, Any]], None]:
    """The progress callback: print each message; hold after the steps the demo decides on."""

    def emit(msg: dict[str, Any]) -> None:
        _emit(msg)
        if hold_after is not None and msg.get("event") == "step" and msg["step"] >= hold_after:
            readable, _, _ = select.select([sys.stdin], [], [], HOLD_TIMEOUT_S)
            if readable:
                sys.stdin.readline()  # "go on" (or EOF)

    return emit


def main(argv: list[str]) -> int:
    """Entry point; returns the process exit code."""
    # This process is the demo's own child: its offline and quiet environment comes from
    # the demo (its Popen env); only its own progress bars are switched off here.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from .loop import run_training, vllm_cpu_env

    config_json, run_id, mode, *hold = argv
    cfg = RunConfig.model_validate_json(config_json)
    if cfg.backend == "vllm":
        vllm_cpu_env()
    emit = _emitter(int(hold[0]) if hold else None)
    try:
        result = asyncio.run(
            run_training(cfg, run_id=run_id, resume=mode == "resume", progress=emit)
        )
    except Exception as exc:
        _emit({"event": "error", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    _emit({"event": "done", "steps_trained": result.steps_trained, "first_step": result.first_step})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

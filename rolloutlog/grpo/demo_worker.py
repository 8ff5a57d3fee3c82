"""The demo's worker process: runs the GRPO loop and prints progress as JSON lines.

Started by ``rolloutlog demo`` (twice: a fresh run that the demo kills with SIGKILL, then
a resume from the newest checkpoint). Usage: ``python -m rolloutlog.grpo.demo_worker
CONFIG_JSON RUN_ID fresh|resume``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from .run_config import RunConfig


def _emit(msg: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(msg, default=str) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    """Entry point; returns the process exit code."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from .loop import run_training

    config_json, run_id, mode = argv
    cfg = RunConfig.model_validate_json(config_json)
    try:
        result = asyncio.run(
            run_training(cfg, run_id=run_id, resume=mode == "resume", progress=_emit)
        )
    except Exception as exc:
        _emit({"event": "error", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    _emit({"event": "done", "steps_trained": result.steps_trained, "first_step": result.first_step})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

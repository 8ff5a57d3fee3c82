"""TRL's real ``AsyncGRPOTrainer.train()`` on CPU with the in-memory rollout worker.

The tiny local Llama, the CPU tree attention (``trl_on_cpu``), an ``AsyncGRPOConfig``
for CPU and :class:`~rolloutlog.bench.trl_bench.InMemoryRolloutWorker` on the
deterministic backend: the trainer takes N optimizer steps, saves ``checkpoint-N/`` on
``save_steps``, and ``train(resume_from_checkpoint=...)`` carries on from there.
"""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rolloutlog.bench import trl_bench
from rolloutlog.integrations.trl import cpu as trl_cpu

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("trl_on_cpu")]


class _Recorder:
    """A worker factory that keeps what it built."""

    def __init__(self) -> None:
        self.parts: list[trl_bench.WorkerParts] = []
        self.contexts: list[trl_bench.WorkerContext] = []

    def __call__(self, context: trl_bench.WorkerContext) -> trl_bench.WorkerParts:
        parts = trl_bench.in_memory_worker(context)
        self.contexts.append(context)
        self.parts.append(parts)
        return parts


def _steps(trainer: Any) -> list[int]:
    return [entry["step"] for entry in trainer.state.log_history if "loss" in entry]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_train_saves_checkpoints_and_resumes(trl_tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    spec = trl_cpu.TrainRunSpec(
        model_dir=str(trl_tiny_model), output_dir=str(out), max_steps=4, save_steps=2
    )
    recorder = _Recorder()
    trainer = trl_cpu.build_trainer(spec, factory=recorder)
    parts = recorder.parts[0]
    worker = parts.rollout_worker
    assert trainer.rollout_worker is worker and trainer.weight_transfer is parts.weight_transfer
    assert trainer.args.token_budget == 0 and not trainer.args.bf16
    assert trainer.model.config._attn_implementation == trl_cpu.TREE_ATTENTION

    result = trainer.train()

    assert trainer.state.global_step == 4
    assert _steps(trainer) == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in trainer.state.log_history[:4])
    assert result.training_loss == pytest.approx(
        sum(e["loss"] for e in trainer.state.log_history[:4]) / 4, rel=1e-3
    )
    # The trainer drove the worker: one weight sync at train begin and one per step,
    # each announced as a new model version; it stopped the worker at the end.
    assert parts.weight_transfer.syncs == 5
    assert worker.model_version == trainer.model_version == 5
    assert not any(t.name == "rolloutlog-trl-in-memory-worker" for t in threading.enumerate())
    # What TRL consumed came from the worker: 4 steps x 4 samples, none dropped as stale.
    assert worker.samples_enqueued >= 16
    assert not any("sample/dropped_stale_total" in e for e in trainer.state.log_history)
    # Worker metrics went through metrics_queue into TRL's logs.
    assert all("rollout/group_s" in e for e in trainer.state.log_history[:4])

    for step in (2, 4):
        checkpoint = out / f"checkpoint-{step}"
        assert trl_cpu.checkpoint_complete(checkpoint)
        for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"):
            assert (checkpoint / name).is_file(), name
        # TRL writes rollout_state.json for its own worker only.
        assert not (checkpoint / "rollout_state.json").exists()
    # The optimizer steps moved the weights.
    initial, trained = _weights(trl_tiny_model), _weights(out / "checkpoint-4")
    moved = [k for k in initial if not torch.equal(initial[k], trained[k])]
    assert moved, "no weight changed in 4 optimizer steps"

    # Resume from checkpoint-2 to step 6: the trainer restores step, weights and optimizer.
    resume = replace(spec, max_steps=6, resume_from_checkpoint=str(out / "checkpoint-2"))
    seen: dict[str, Any] = {}

    def snapshot(context: trl_bench.WorkerContext) -> trl_bench.WorkerParts:
        seen["resume_from_checkpoint"] = context.resume_from_checkpoint
        return recorder(context)

    resumed = trl_cpu.build_trainer(resume, factory=snapshot, callbacks=[_FirstStepWeights(seen)])
    resumed.train(resume_from_checkpoint=resume.resume_from_checkpoint)

    assert seen["resume_from_checkpoint"] == out / "checkpoint-2"
    assert resumed.state.global_step == 6
    # Steps 1-2 come from the checkpoint's trainer state; 3-6 were trained now.
    assert _steps(resumed) == [1, 2, 3, 4, 5, 6]
    assert recorder.parts[1].weight_transfer.syncs == 5  # train begin + steps 3..6
    # Training restarted from checkpoint-2's weights, not the initial ones.
    at_checkpoint = _weights(out / "checkpoint-2")
    for name, tensor in seen["weights_at_begin"].items():
        torch.testing.assert_close(tensor, at_checkpoint[name])
    assert trl_cpu.checkpoint_complete(out / "checkpoint-6")
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6 and state["max_steps"] == 6


class _FirstStepWeights:
    """Records the model's weights when training begins (after the resume loaded them)."""

    def __new__(cls, seen: dict[str, Any]) -> Any:
        from transformers import TrainerCallback

        class Callback(TrainerCallback):  # type: ignore[misc]
            def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                model = kw["model"]
                seen["weights_at_begin"] = {
                    name: p.detach().clone() for name, p in model.named_parameters()
                }

        return Callback()

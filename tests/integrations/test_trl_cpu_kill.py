"""The SIGKILL harness on TRL's real trainer, with the in-memory rollout worker.

:func:`trl_cpu.kill_and_resume` trains in a child process (own process group), kills it
with SIGKILL once ``checkpoint-2`` is saved and step 3 is done, and resumes from the
checkpoint with ``resume_from_checkpoint``. The in-memory worker keeps nothing, so all
this shows for it is that the trainer resumes and reaches its target step; the same
harness takes rolloutlog's worker (``worker_factory``) for the lossless-resume checks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rolloutlog.integrations.trl import cpu as trl_cpu

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("trl_installed")]


def test_sigkill_after_checkpoint_then_resume_reaches_the_target_step(
    trl_tiny_model: Path, tmp_path: Path
) -> None:
    spec = trl_cpu.TrainRunSpec(
        model_dir=str(trl_tiny_model),
        output_dir=str(tmp_path / "run"),
        max_steps=4,
        save_steps=2,
        worker_factory="rolloutlog.bench.trl_bench:in_memory_worker",
        # Slow generation and a pause after each step: the kill finds groups in
        # flight, and the parent sees step 3 before step 4 ends.
        generation_latency_s=0.05,
        step_sleep_s=0.5,
    )
    result = trl_cpu.kill_and_resume(spec, kill_at_step=3, deadline_s=400)

    first, resumed = result.first, result.resumed
    assert first.killed and first.returncode == -9
    assert first.result is None  # killed before it could report
    assert result.killed_at_step == 3
    assert result.checkpoints_at_kill == ["checkpoint-2"]
    assert result.checkpoint == tmp_path / "run" / "checkpoint-2"

    assert resumed.returncode == 0 and resumed.result is not None
    assert resumed.result["resumed_from"] == str(result.checkpoint)
    # The resumed process trained steps 3 and 4 (not from step 1) and stopped at 4.
    assert resumed.result["first_step"] == 3
    assert resumed.result["global_step"] == spec.max_steps
    logged = [e["step"] for e in resumed.result["log_history"] if "loss" in e]
    assert logged == [1, 2, 3, 4]  # 1-2 restored from checkpoint-2's trainer state
    assert trl_cpu.checkpoint_complete(tmp_path / "run" / "checkpoint-4")
    # Nothing of either child is left: the harness kills and reaps the process groups.
    for child in (first, resumed):
        with pytest.raises(ProcessLookupError):
            os.killpg(child.pid, 0)


def test_harness_refuses_a_kill_step_outside_the_run(tmp_path: Path) -> None:
    spec = trl_cpu.TrainRunSpec(model_dir=str(tmp_path), output_dir=str(tmp_path / "o"))
    with pytest.raises(ValueError, match="kill_at_step 9"):
        trl_cpu.kill_and_resume(spec, kill_at_step=9)
    with pytest.raises(ValueError, match="save_steps 4 must be below"):
        trl_cpu.kill_and_resume(trl_cpu.TrainRunSpec(str(tmp_path), str(tmp_path), save_steps=4))
    assert not os.listdir(tmp_path)

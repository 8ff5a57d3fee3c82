"""``rolloutlog bench trl``: the in-memory worker measured (against itself until
rolloutlog's TRL worker exists), and the callback timing measured for real."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import pytest
from click.testing import CliRunner

from rolloutlog.bench import trl_bench
from rolloutlog.cli import main

pytestmark = pytest.mark.usefixtures("trl_installed")


def test_bench_trl_json_keys() -> None:
    result = CliRunner().invoke(
        main,
        ["bench", "trl", "--backend", "deterministic", "--steps", "3", "--rounds", "1",
         "--batch-size", "4", "--num-generations", "2", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    expected = "in_memory" if trl_bench.rolloutlog_factory() is None else "rolloutlog"
    assert data["worker_under_test"] == expected
    assert data["backend"] == "deterministic" and data["trl_version"]
    ratio = data["samples_per_s_vs_in_memory_worker"]
    assert math.isfinite(ratio) and ratio > 0
    assert data["samples_per_s_in_memory_worker"] > 0
    assert ratio == pytest.approx(
        data["samples_per_s_worker_under_test"] / data["samples_per_s_in_memory_worker"]
    )
    if expected == "in_memory":
        assert data["callback_ms_per_step"] == 0.0  # the in-memory worker has none
    assert data["goals"] == {"samples_per_s_vs_in_memory_worker": 0.97, "callback_ms_per_step": 1.0}


class _SlowCallbackFactory:
    """The in-memory worker plus a callback that takes 2 ms per ``on_step_end``."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def __call__(self, context: trl_bench.WorkerContext) -> trl_bench.WorkerParts:
        from transformers import TrainerCallback

        events = self.events

        class Slow(TrainerCallback):  # type: ignore[misc]
            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                events.append(("step_end", state.global_step))
                time.sleep(0.002)

            def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                assert kw["train_dataloader"] is not None
                events.append(("save", state.global_step))

        parts = trl_bench.in_memory_worker(context)
        return trl_bench.WorkerParts(parts.rollout_worker, parts.weight_transfer, [Slow()])


def test_callback_time_is_measured_per_step() -> None:
    factory = _SlowCallbackFactory()
    data = trl_bench.run_trl_benchmark(
        backend="deterministic", steps=4, batch_size=4, num_generations=2,
        max_completion_length=4, save_steps=2, rounds=1, worker_factory=factory,
    )  # fmt: skip
    assert data["worker_under_test"] == "_SlowCallbackFactory"
    # Warm-up step 1 plus 4 timed steps; on_save at steps 2 and 4.
    assert [e for e in factory.events if e[0] == "step_end"] == [
        ("step_end", s) for s in range(1, 6)
    ]
    assert [e for e in factory.events if e[0] == "save"] == [("save", 2), ("save", 4)]
    assert data["callback_ms_per_step"] >= 2.0
    by_event = data["callback_ms_per_step_by_event"]
    assert by_event["on_step_end"] >= 2.0
    assert sum(by_event.values()) == pytest.approx(data["callback_ms_per_step"])


def test_a_factory_that_builds_no_worker_is_refused() -> None:
    with pytest.raises(TypeError, match="not a TRL rollout worker: no 'rollout_buffer'"):
        trl_bench.as_parts(object())

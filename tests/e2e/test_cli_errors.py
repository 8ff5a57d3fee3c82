"""Config and CLI failure paths (issue 9, item 14): a non-UTF-8 config, booleans given
for numbers, a resume with nothing left to train, and errors reaching the CLI as one
clear line with a nonzero exit (the traceback behind ``--debug``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from pydantic import ValidationError

from rolloutlog.cli import main
from rolloutlog.controller.config import RolloutConfig
from rolloutlog.controller.rollout_runtime import RunStoppedError
from rolloutlog.eventstore import EventStore
from rolloutlog.grpo import loop as grpo_loop
from rolloutlog.grpo.run_config import load_run_config

from .conftest import REPO


def _config(tmp_path: Path, **over: Any) -> Path:
    cfg = yaml.safe_load((REPO / "configs" / "sqlite-torch.yaml").read_text())
    cfg["checkpoint_dir"] = str(tmp_path / "checkpoints")
    cfg["model"]["dir"] = str(tmp_path / "tiny-model")
    cfg["store"]["url"] = f"sqlite:///{tmp_path / 'log.db'}"
    for key, value in over.items():
        section, _, name = key.partition("__")
        if name:
            cfg.setdefault(section, {})[name] = value
        else:
            cfg[key] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def test_a_non_utf8_config_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("run_id: caf\u00e9\nsteps: 2\n".encode("latin-1"))
    res = _cli("run", str(path))
    assert res.exit_code == 1, res.output
    assert "is not UTF-8 text" in res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "log.db").exists()


@pytest.mark.parametrize(
    ("field", "named"),
    [
        ("steps", "steps"),
        ("checkpoint_every", "checkpoint_every"),
        ("rollout__group_size", "rollout.group_size"),
        ("store__snapshot_interval", "store.snapshot_interval"),
        ("rollout__min_step_fraction", "rollout.min_step_fraction"),
        ("generation__max_tokens", "generation.max_tokens"),
        ("trainer__seed", "trainer.seed"),
    ],
)
def test_a_boolean_is_not_a_number(tmp_path: Path, field: str, named: str) -> None:
    cfg = _config(tmp_path, **{field: True})
    res = _cli("run", str(cfg))
    assert res.exit_code == 1, res.output
    assert f"{named}: a boolean (true)" in res.output
    assert not (tmp_path / "log.db").exists()  # nothing was started


def test_yaml_numbers_and_real_booleans_still_load(tmp_path: Path) -> None:
    cfg = load_run_config(
        _config(tmp_path, steps=3, rollout__min_step_fraction=1, telemetry__enabled=True)
    )
    assert (cfg.steps, cfg.rollout.min_step_fraction, cfg.telemetry.enabled) == (3, 1.0, True)
    # The models themselves take no boolean for a number (strict), in code too.
    with pytest.raises(ValidationError, match="group_size"):
        RolloutConfig(group_size=True)  # type: ignore[arg-type]


def test_errors_reach_the_cli_as_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def stopped(*_a: Any, **_k: Any) -> Any:
        raise RunStoppedError("the rollout pump stopped: backend unreachable\nsecond line")

    monkeypatch.setattr(grpo_loop, "run_training", stopped)
    cfg = _config(tmp_path)
    res = _cli("run", str(cfg))
    assert res.exit_code == 1
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert lines == [
        "Error: RunStoppedError: the rollout pump stopped: backend unreachable "
        "(run with --debug for the traceback)"
    ]
    debug = _cli("--debug", "run", str(cfg))
    assert isinstance(debug.exception, RunStoppedError)  # the traceback is kept


@pytest.mark.slow
def test_resume_with_nothing_left_to_train_writes_nothing(tmp_path: Path) -> None:
    cfg = _config(tmp_path, steps=2, checkpoint_every=2, backend="deterministic")
    first = _cli("run", str(cfg), "--run-id", "done")
    assert first.exit_code == 0, first.output
    store = EventStore.open(f"sqlite:///{tmp_path / 'log.db'}")
    before = store.get_run("done")
    for _ in range(2):
        again = _cli("run", str(cfg), "--resume", "--run-id", "done")
        assert again.exit_code == 0, again.output
        assert "nothing left to train" in again.output
        after = store.get_run("done")
        assert (after.last_seq, after.current_epoch) == (before.last_seq, before.current_epoch)
    store.close()

"""The demo's worker runs in its own process group and the whole group is killed: no
process the worker started (vLLM's EngineCore and workers, 1.8 GB each) outlives it.

The fast test stands in a tiny worker that starts a helper grandchild (the same
mechanism as the vLLM engine's processes); the vLLM test runs the real demo once, and
checks the resume on vLLM from its log.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rolloutlog.controller.domain.events import RunRestored, SiblingDispatched
from rolloutlog.controller.replay_tool import check_history
from rolloutlog.controller.rollout_controller import iter_history
from rolloutlog.eventstore import EventStore
from rolloutlog.grpo import demo
from rolloutlog.grpo.run_config import RunConfig

from .conftest import require_vllm, rolloutlog

FAKE_WORKER = """
import json, subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(json.dumps({"event": "helper", "pid": helper.pid}), flush=True)
steps = 3 if sys.argv[1] == "exit" else 10**6
for step in range(steps):
    print(json.dumps({"event": "step", "step": step}), flush=True)
    time.sleep(0.05)
"""


def _stat(pid: int) -> list[str] | None:
    """``state ppid pgrp session ...`` of a process, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"  # a zombie holds nothing


def _survivors(group_ids: set[int], deadline_s: float = 10.0) -> list[int]:
    """Live processes whose process group or session is one of ``group_ids``."""
    deadline = time.monotonic() + deadline_s
    while True:
        found = []
        for entry in Path("/proc").iterdir():
            stat = _stat(int(entry.name)) if entry.name.isdigit() else None
            if stat and stat[0] != "Z" and ({int(stat[2]), int(stat[3])} & group_ids):
                found.append(int(entry.name))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)  # SIGKILLed processes disappear within moments


def _cfg(tmp_path: Path) -> RunConfig:
    return RunConfig.model_validate(
        {
            "store": {"url": f"sqlite:///{tmp_path / 'log.db'}"},
            "model": {"dir": str(tmp_path), "build": "tiny"},
        }
    )


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
@pytest.mark.parametrize("ending", ["killed", "exit"])
def test_no_process_of_the_worker_survives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    # The stand-in ignores the hold argument: the demo kills it at its first step report.
    monkeypatch.setattr(
        demo,
        "_worker_argv",
        lambda _cfg, _rid, _mode, _hold=None: [sys.executable, str(script), ending],
    )
    seen: list[dict[str, Any]] = []
    helper: int | None = None
    try:
        out = demo._run_worker(
            _cfg(tmp_path),
            "r",
            "fresh",
            kill_after_step=2 if ending == "killed" else None,
            on_message=seen.append,
        )
        helper = next(m["pid"] for m in seen if m["event"] == "helper")
        assert out.killed is (ending == "killed")
        assert out.pid is not None
        assert _survivors({out.pid}) == []
        assert not _alive(helper), f"the worker's helper process {helper} survived"
    finally:
        if helper is not None and _alive(helper):
            with contextlib.suppress(ProcessLookupError):
                os.kill(helper, signal.SIGKILL)


@pytest.mark.vllm
@pytest.mark.slow
def test_demo_vllm_leaves_no_engine_process(tmp_path: Path) -> None:
    """The real demo with the vLLM backend: the first worker is SIGKILLed after step 4,
    the second resumes from the newest checkpoint (step 3) in a fresh engine. After it, nothing of
    either worker runs; the log is whole, no prompt is lost or trained twice, and the
    resumed engine served the trainer's checkpointed weights from its first dispatch
    (``sync_weights`` before the pump started).

    It also stands for ``run_training`` on vLLM with a resume: that test did the same two
    engine starts with a clean stop instead of a SIGKILL (most of either test's time)."""
    require_vllm()
    db = f"sqlite:///{tmp_path / 'demo.db'}"
    proc = rolloutlog(
        "demo",
        "--json",
        "--backend",
        "vllm",
        "--steps",
        "8",
        "--checkpoint-every",
        "3",
        "--workdir",
        str(tmp_path),
        "--db",
        db,
        timeout=570,  # within the suite's 600 s per-test limit
    )
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True
    assert summary["steps_trained"] == 8 and summary["killed_after_step"] == 4
    assert summary["prompts_lost"] == 0 and summary["prompts_trained_twice"] == 0
    assert summary["invariant_violations"] == []
    pids = set(summary["worker_pids"])
    assert len(pids) == 2
    assert _survivors(pids) == [], "processes of the demo's workers outlived them"

    with EventStore.open(db) as store:
        assert check_history(store, summary["run_id"]).violation is None
        history = list(iter_history(store, summary["run_id"]))
    restores = [(row.seq, ev) for row, ev in history if isinstance(ev, RunRestored)]
    assert len(restores) == 1
    restored_at, restored = restores[0]
    # From the newest checkpoint the first worker recorded before its kill.
    newest = max(
        row.seq for row, ev in history[:restored_at] if ev.event_type == "CheckpointMarked"
    )
    assert restored.from_offset == newest == summary["restored_from_offset"]
    assert restored.checkpoint_weight_version == 3  # the checkpoint after step 3
    versions = {
        ev.weight_version
        for row, ev in history
        if row.seq > restored_at and isinstance(ev, SiblingDispatched)
    }
    assert versions and min(versions) >= restored.checkpoint_weight_version, versions


HANGING_WORKER = """
import json, os, sys, time
print(json.dumps({"event": "step", "step": 0}), flush=True)
os.close(1)  # its output ends, as at a clean exit
sys.stdout = open(os.devnull, "w")
time.sleep(600)  # but its shutdown hangs
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_worker_that_closes_its_output_but_never_exits_is_killed_and_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waiting for the worker's exit has a deadline: past it the demo kills the worker's
    group and fails with one line saying so (never a clean-looking return)."""
    script = tmp_path / "hanging_worker.py"
    script.write_text(HANGING_WORKER)
    monkeypatch.setattr(
        demo,
        "_worker_argv",
        lambda _cfg, _rid, _mode, _hold=None: [sys.executable, str(script)],
    )
    monkeypatch.setattr(demo, "_EXIT_GRACE_S", 0.5)
    seen: list[dict[str, Any]] = []
    with pytest.raises(demo.DemoError, match=r"closed its output but did not exit within 0\.5 s"):
        demo._run_worker(_cfg(tmp_path), "r", "fresh", kill_after_step=None, on_message=seen.append)
    assert seen == [{"event": "step", "step": 0}]

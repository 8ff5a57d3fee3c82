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


# A stand-in "python" for the engines a run launches: it ignores ``-m vllm...`` and serves
# the fake HTTP engine (real tensors of the model directory, deterministic generation) on
# the requested port, so the whole fleet.launch route runs without vLLM.
FAKE_SERVER = r"""
import asyncio, json, sys
from pathlib import Path
from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.backends.fake_engine import FakeEngineServer
args = sys.argv[1:]
def arg(name):
    return args[args.index(name) + 1]
model, port, max_len = Path(arg("--model")), int(arg("--port")), int(arg("--max-model-len"))
spec = json.loads((model / "config.json").read_text())
async def main():
    backend = DeterministicBackend(
        vocab_size=spec["vocab_size"], max_model_len=max_len, eos_token_id=spec["eos_token_id"]
    )
    server = FakeEngineServer(backend, max_model_len=max_len, port=port, model_dir=model)
    await server.start()
    await asyncio.Event().wait()
asyncio.run(main())
"""


# On Ray the server listens on --host (0.0.0.0) and is reached at the node's address.
ANY_HOST = r"""
import asyncio
_start_server = asyncio.start_server
async def _any_host(cb, host=None, port=None, **kw):
    return await _start_server(cb, "0.0.0.0", port, **kw)
asyncio.start_server = _any_host
"""


def _fake_engine_python(tmp_path: Path, any_host: bool = False) -> str:
    import stat
    import sys

    script = tmp_path / "fake_server.py"
    script.write_text((ANY_HOST if any_host else "") + FAKE_SERVER)
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def _free_ports(count: int) -> int:
    """A base port with ``count`` free ports from it, below the ephemeral range (32768+):
    a probe of a port there that nothing listens on yet can connect to itself."""
    import random
    import socket

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
    import os

    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_run_launches_its_fleet_and_stops_it(tmp_path: Path) -> None:
    """``backend: vllm-fleet`` with a ``fleet.launch`` section: the run starts two engines
    (stand-in servers, each in its own process group), generates on both, and stops them
    at its end."""
    fleet = {
        "launch": {
            "count": 2,
            "port_base": _free_ports(2),
            "ready_timeout_s": 90,
            "stop_timeout_s": 5,
            "log_dir": str(tmp_path / "engine-logs"),
        },
        "python": _fake_engine_python(tmp_path),
    }
    cfg = _config(tmp_path, steps=2, checkpoint_every=2, backend="vllm-fleet", fleet=fleet)
    done = rolloutlog("run", str(cfg), "--run-id", "f1", "--json", timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    messages = json_lines(done.stdout)
    engines = next(m for m in messages if m.get("event") == "engines")
    assert engines["source"] == "launch"
    assert [e["engine_id"] for e in engines["engines"]] == ["engine-0", "engine-1"]
    assert messages[-1]["event"] == "summary" and messages[-1]["steps_trained"] == 2
    assert not any(_group_alive(e["pid"]) for e in engines["engines"])
    with EventStore.open(f"sqlite:///{tmp_path / 'log.db'}") as store:
        from rolloutlog.controller.rollout_controller import iter_history

        history = [ev for _row, ev in iter_history(store, "f1")]
    joined = {ev.engine_id: ev.address for ev in history if ev.event_type == "EngineJoined"}
    assert joined == {e["engine_id"]: e["url"] for e in engines["engines"]}
    served = {ev.engine_id for ev in history if ev.event_type == "SiblingCompleted"}
    assert served == {"engine-0", "engine-1"}


def test_run_takes_the_engines_of_a_state_file(tmp_path: Path) -> None:
    """``fleet.state_file``: the engines ``rolloutlog engines start`` recorded (here two
    in-process fake engines); the run leaves them running."""
    import asyncio
    import json

    from rolloutlog.controller.backends.fake_engine import FakeEngineServer
    from rolloutlog.grpo.loop import run_training
    from rolloutlog.grpo.run_config import load_run_config
    from rolloutlog.grpo.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny-model")
    state = tmp_path / "engines.json"

    async def scenario() -> list[int]:
        servers = [
            FakeEngineServer(
                DeterministicBackend(vocab_size=55, max_model_len=64, eos_token_id=2),
                max_model_len=64,
                model_dir=model_dir,
            )
            for _ in range(2)
        ]
        for s in servers:
            await s.start()
        try:
            recorded = [{"engine_id": f"engine-{i}", "url": s.url} for i, s in enumerate(servers)]
            state.write_text(json.dumps({"engines": recorded}))
            cfg = _config(tmp_path, steps=1, backend="vllm-fleet", fleet={"state_file": str(state)})
            await run_training(load_run_config(cfg), run_id="s1", resume=False)
            # Still up: the run does not stop engines it did not start.
            return [len(s.served_with) for s in servers]
        finally:
            for s in servers:
                await s.stop()

    served = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert sum(served) > 0


@pytest.mark.parametrize(
    ("fleet", "named"),
    [
        ({}, "backend vllm-fleet needs its engines: fleet.launch"),
        ({"state_file": "nope.json"}, "fleet.state_file nope.json does not exist"),
        (
            {"urls": ["http://127.0.0.1:1"], "launch": {"count": 1}},
            "give one of fleet.urls, fleet.launch and fleet.state_file",
        ),
        ({"launch": {"count": 1, "model_dir": "/elsewhere"}}, "is not the run's model.dir"),
        ({"launch": {"count": 1, "max_model_len": 8}}, "fleet.launch.max_model_len 8"),
        ({"launch": {"placement": "moon"}}, "fleet.launch.placement"),
    ],
)
def test_a_fleet_section_without_usable_engines_is_refused_up_front(
    tmp_path: Path, fleet: dict[str, Any], named: str
) -> None:
    cfg = _config(tmp_path, steps=1, backend="vllm-fleet", fleet=fleet)
    res = _cli("run", str(cfg))
    assert res.exit_code == 1, res.output
    assert named in res.output
    assert not (tmp_path / "log.db").exists()  # nothing was started


def test_a_launch_section_needs_the_fleet_backend(tmp_path: Path) -> None:
    res = _cli("run", str(_config(tmp_path, steps=1, fleet={"launch": {"count": 1}})))
    assert res.exit_code == 1, res.output
    assert "fleet.launch is for backend vllm-fleet (backend: torch)" in res.output


@pytest.mark.slow
def test_a_sigkilled_run_takes_its_launched_engines_with_it(tmp_path: Path) -> None:
    """The engines a run launched are tethered to it: SIGKILL of the run (no ``finally``
    runs) still leaves no engine process behind."""
    import contextlib
    import json
    import os
    import signal
    import subprocess
    import threading
    import time

    from .conftest import rolloutlog_exe

    fleet = {
        "launch": {"count": 2, "port_base": _free_ports(2), "ready_timeout_s": 90,
                   "stop_timeout_s": 3, "log_dir": str(tmp_path / "engine-logs")},
        "python": _fake_engine_python(tmp_path),
    }  # fmt: skip
    cfg = _config(tmp_path, steps=50, backend="vllm-fleet", fleet=fleet)
    proc = subprocess.Popen(
        [*rolloutlog_exe(), "run", str(cfg), "--run-id", "k1", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()
    pgids: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while not any('"event": "step"' in ln for ln in lines):
            assert proc.poll() is None, lines
            assert time.monotonic() < deadline, f"no step within 180 s: {lines}"
            time.sleep(0.2)
        engines = next(json.loads(ln) for ln in lines if '"event": "engines"' in ln)
        pgids = [e["pid"] for e in engines["engines"]]
        assert all(_group_alive(p) for p in pgids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # The tether polls its parent every 0.2 s, then SIGTERM, SIGKILL after 3 s.
        deadline = time.monotonic() + 30
        while any(_group_alive(p) for p in pgids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in pgids if _group_alive(p)] == []
    finally:
        for pgid in [proc.pid, *pgids]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.mark.slow
def test_run_launches_its_fleet_on_a_ray_cluster(tmp_path: Path) -> None:
    """``fleet.launch`` with ``placement: ray`` and ``ray_address``: the run starts one
    engine actor per engine on an existing Ray cluster (a head started here; stand-in
    servers, no vLLM), trains on them and stops them (the actors and their servers) at
    its end.

    Not with a real vLLM engine: one vLLM server takes 1.5-4 minutes to answer /health on
    the shared two-core CI machine (plus the Ray head), far above the 90 s such a test may
    cost; the Ray launcher's own vLLM test (tests/engines/test_ray_launcher.py) covers
    vLLM inside an actor, and this test the config route to it."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (extra [ray])")
    from engines.test_ray_launcher import _processes_running, _ray_head

    from rolloutlog.controller.engines.local import health_ok

    python = _fake_engine_python(tmp_path, any_host=True)
    with _ray_head(tmp_path) as (address, _head):
        fleet = {
            "launch": {"count": 2, "placement": "ray", "ray_address": address,
                       "ready_timeout_s": 120, "stop_timeout_s": 5,
                       "log_dir": str(tmp_path / "engine-logs")},
            "python": python,
        }  # fmt: skip
        cfg = _config(tmp_path, steps=2, checkpoint_every=2, backend="vllm-fleet", fleet=fleet)
        done = rolloutlog("run", str(cfg), "--run-id", "ray1", "--json", timeout=400)
        assert done.returncode == 0, done.stderr[-3000:]
        messages = json_lines(done.stdout)
        engines = next(m for m in messages if m.get("event") == "engines")["engines"]
        assert [e["engine_id"] for e in engines] == ["engine-0", "engine-1"]
        assert messages[-1]["event"] == "summary" and messages[-1]["steps_trained"] == 2
        assert not any(m.get("event") == "engines_not_stopped" for m in messages)
        assert not any(health_ok(e["url"]) for e in engines)
        with EventStore.open(f"sqlite:///{tmp_path / 'log.db'}") as store:
            from rolloutlog.controller.rollout_controller import iter_history

            history = [ev for _row, ev in iter_history(store, "ray1")]
        served = {ev.engine_id for ev in history if ev.event_type == "SiblingCompleted"}
        assert served == {"engine-0", "engine-1"}
    assert _processes_running(str(tmp_path / "fake_server.py")) == []


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

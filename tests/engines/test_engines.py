"""Engine launch and fleet configuration (no vLLM: a stand-in server process).

The local launcher is exercised with the stand-in "python" of ``conftest.py`` (serves
``/health`` after starting a child of its own): so start (own process group, health
deadline), SIGKILL of the group, restart and stop (SIGTERM to the group, SIGKILL after
the deadline) are real.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from rolloutlog.cli import main
from rolloutlog.controller.engines.config import FleetConfig, LaunchConfig
from rolloutlog.controller.engines.local import (
    EngineLaunchError,
    LocalEngineLauncher,
    server_command,
    server_env,
)


def _free_port(count: int = 2) -> int:
    """A base port with ``count`` free ports from it (engine i listens on base + i; a
    base alone once found base + 1 taken: 'Address already in use')."""
    import socket

    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        try:
            for port in range(base, base + count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise AssertionError(f"no {count} consecutive free ports")


def _config(model_dir: Path, tmp_path: Path, **kw: object) -> LaunchConfig:
    base = dict(
        count=2,
        model_dir=model_dir,
        port_base=_free_port(4),
        ready_timeout_s=30,
        stop_timeout_s=2,
        log_dir=tmp_path / "logs",
    )
    base.update(kw)
    return LaunchConfig(**base)  # type: ignore[arg-type]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_server_command_and_env_are_cpu_safe(model_dir: Path) -> None:
    config = LaunchConfig(model_dir=model_dir, max_model_len=96, extra_args=("--block-size", "32"))
    cmd = server_command(config, 8123, "py")
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in (("--port", "8123"), ("--max-model-len", "96"), ("--dtype", "float32")):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--enforce-eager" in cmd and cmd[-2:] == ["--block-size", "32"]
    # Seeded sampling after a split prefill kills a CPU engine (see cpu_engine_defaults).
    assert "--no-enable-chunked-prefill" in cmd
    chosen = config.model_copy(update={"extra_args": ("--enable-chunked-prefill",)})
    assert "--no-enable-chunked-prefill" not in server_command(chosen, 8123, "py")
    env = server_env(config, base={})
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["HF_HUB_OFFLINE"] == "1"


@pytest.mark.slow
def test_start_kill_restart_stop_process_groups(
    stand_in_python: str, model_dir: Path, tmp_path: Path
) -> None:
    from rolloutlog.controller.engines.local import health_ok

    launcher = LocalEngineLauncher(_config(model_dir, tmp_path), python=stand_in_python)
    with launcher:
        engines = launcher.start()
        assert [e.engine_id for e in engines] == ["engine-0", "engine-1"]
        assert all(health_ok(e.url) for e in engines)
        assert all(os.getpgid(e.pid) == e.pid for e in engines)  # own process groups
        victim = engines[1].pid
        launcher.kill("engine-1", signal.SIGKILL)
        assert not health_ok(engines[1].url)
        deadline = time.monotonic() + 10
        while _group_alive(victim) and time.monotonic() < deadline:  # the child went too
            time.sleep(0.05)
        assert not _group_alive(victim)
        again = launcher.restart("engine-1")
        assert again.port == engines[1].port and health_ok(again.url)
        pids = [e.pid for e in launcher.engines]
    assert not any(_group_alive(p) for p in pids)


@pytest.mark.slow
def test_stop_kills_a_group_that_ignores_sigterm(
    stand_in_python: str, model_dir: Path, tmp_path: Path
) -> None:
    config = _config(model_dir, tmp_path, count=1, extra_args=("--ignore-term",))
    launcher = LocalEngineLauncher(config, python=stand_in_python)
    (engine,) = launcher.start()
    t0 = time.monotonic()
    launcher.stop()
    assert not _group_alive(engine.pid)
    assert time.monotonic() - t0 >= config.stop_timeout_s * 0.9  # waited, then SIGKILL


@pytest.mark.slow
def test_a_server_that_exits_fails_fast_with_its_log(
    stand_in_python: str, model_dir: Path, tmp_path: Path
) -> None:
    config = _config(model_dir, tmp_path, count=1, extra_args=("--fail",))
    launcher = LocalEngineLauncher(config, python=stand_in_python)
    with pytest.raises(EngineLaunchError, match=r"(?s)exited with 3.*failing on purpose"):
        launcher.start()


def test_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EngineLaunchError, match="no model at"):
        LocalEngineLauncher(LaunchConfig(model_dir=tmp_path / "nowhere"))


def test_fleet_config_takes_urls_or_a_launch_section(model_dir: Path) -> None:
    assert FleetConfig(urls=("http://a:1", "http://b:2")).urls == ("http://a:1", "http://b:2")
    assert FleetConfig(launch=LaunchConfig(model_dir=model_dir)).launch is not None
    with pytest.raises(ValidationError, match="exactly one"):
        FleetConfig()
    with pytest.raises(ValidationError, match="exactly one"):
        FleetConfig(urls=("http://a:1",), launch=LaunchConfig(model_dir=model_dir))
    with pytest.raises(ValidationError, match="http"):
        FleetConfig(urls=("a:1",))
    with pytest.raises(ValidationError, match="duplicates"):
        FleetConfig(urls=("http://a:1", "http://a:1"))
    with pytest.raises(ValidationError):
        LaunchConfig(model_dir=model_dir, count=0)


def test_cli_engines_start_and_stop_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    state = tmp_path / "engines.json"
    result = runner.invoke(
        main, ["engines", "start", "--model", str(tmp_path / "none"), "--state-file", str(state)]
    )
    assert result.exit_code != 0 and "no model at" in result.output
    assert not state.exists()
    result = runner.invoke(main, ["engines", "stop", "--state-file", str(state)])
    assert result.exit_code != 0 and "nothing to stop" in result.output
    state.write_text(json.dumps({"engines": []}))
    result = runner.invoke(main, ["engines", "start", "--model", "x", "--state-file", str(state)])
    assert result.exit_code != 0 and "exists" in result.output
    assert "engines restart" in result.output


@pytest.mark.parametrize("model", [FleetConfig, LaunchConfig], ids=lambda m: m.__name__)
def test_fleet_config_fields_documented_with_defaults(model: type) -> None:
    """docs/configuration.md has a row per field with its default (as for RunConfig)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    start = text.index(f"— `{model.__name__}`")
    section = text[start : text.find("\n## ", start)]
    for name, field in model.model_fields.items():
        line = next((ln for ln in section.splitlines() if ln.startswith(f"| `{name}` |")), None)
        assert line is not None, f"{model.__name__}.{name} has no row"
        if field.is_required():
            assert "required" in line
            continue
        default = field.get_default(call_default_factory=True)
        shown = json.dumps(list(default) if isinstance(default, tuple) else default)
        if isinstance(default, str | int | float) and not isinstance(default, bool):
            shown = str(default)
        assert f"`{shown}`" in line, f"{model.__name__}.{name}: `{shown}` not in {line}"


@pytest.mark.slow
def test_cli_engines_restart(stand_in_python: str, model_dir: Path, tmp_path: Path) -> None:
    """`engines restart` stops and starts the recorded engines on their ports with the
    recorded settings (all, or --engine), and rewrites the state file for `stop`."""
    from rolloutlog.controller.engines.local import health_ok

    state = tmp_path / "engines.json"
    launcher = LocalEngineLauncher(_config(model_dir, tmp_path), python=stand_in_python)
    engines = launcher.start()
    state.write_text(json.dumps(launcher.state()))
    old = [e.pid for e in engines]
    new: list[int] = []
    runner = CliRunner()
    try:
        result = runner.invoke(
            main, ["engines", "restart", "--state-file", str(state), "--engine", "engine-1"]
        )
        assert result.exit_code == 0, result.output
        assert result.output == f"restarted engine-1 {engines[1].url}\n"
        recorded = json.loads(state.read_text())["engines"]
        assert recorded[0]["pid"] == old[0] and recorded[1]["pid"] != old[1]
        assert not _group_alive(old[1]) and _group_alive(old[0])
        assert health_ok(engines[1].url)
        result = runner.invoke(main, ["engines", "restart", "--state-file", str(state), "--json"])
        assert result.exit_code == 0, result.output
        doc = json.loads(result.output)
        assert doc == {"restarted": ["engine-0", "engine-1"], "urls": [e.url for e in engines]}
        new = [e["pid"] for e in json.loads(state.read_text())["engines"]]
        assert not any(_group_alive(p) for p in old) and all(_group_alive(p) for p in new)
        assert all(health_ok(e.url) for e in engines)
    finally:
        result = runner.invoke(main, ["engines", "stop", "--state-file", str(state)])
        launcher.stop()
    assert result.exit_code == 0, result.output
    assert not any(_group_alive(p) for p in new)


def test_cli_engines_restart_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    state = tmp_path / "engines.json"
    result = runner.invoke(main, ["engines", "restart", "--state-file", str(state)])
    assert result.exit_code != 0 and "nothing to restart" in result.output
    state.write_text(json.dumps({"engines": [], "stop_timeout_s": 1}))
    result = runner.invoke(main, ["engines", "restart", "--state-file", str(state)])
    assert result.exit_code != 0 and "no launch settings" in result.output
    state.write_text(
        json.dumps({"engines": [], "launch": {"model_dir": str(tmp_path)}, "python": "py"})
    )
    result = runner.invoke(
        main, ["engines", "restart", "--state-file", str(state), "--engine", "engine-9"]
    )
    assert result.exit_code != 0 and "records no engine ['engine-9']" in result.output


def test_health_probe_of_a_peer_that_is_not_http_is_not_healthy() -> None:
    """A reply that is not HTTP (here: the request echoed back, as a TCP self-connect on a
    port nothing listens on yet reads it) is "not healthy", not an exception that stops
    the launch."""
    import socket
    import threading

    from rolloutlog.controller.engines.local import health_ok

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(conn.recv(4096))

    thread = threading.Thread(target=echo)
    thread.start()
    try:
        assert health_ok(f"http://127.0.0.1:{server.getsockname()[1]}", timeout=5) is False
    finally:
        thread.join(timeout=10)
        server.close()

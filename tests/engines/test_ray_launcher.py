"""The Ray launcher.

Two vLLM server engines inside Ray actors on a local Ray instance (``vllm``); and, without
vLLM, the stand-in server of ``conftest.py`` in actors on a real Ray head started by the
tests in its own process group: SIGKILL of an actor, a wrong address, an engine that exits
early, a failed actor start, and ``rolloutlog engines start|stop --placement ray``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rolloutlog.controller.engines.config import LaunchConfig
from rolloutlog.controller.engines.local import EngineLaunchError, health_ok, stop_group
from rolloutlog.grpo.tiny_model import build_tiny_model


@pytest.mark.vllm
@pytest.mark.slow
def test_two_engine_actors_serve_and_one_can_be_killed(tmp_path: Path) -> None:
    for module in ("ray", "vllm", "httpx"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (extras [ray], [fleet], vllm)")
    from rolloutlog.controller.backends import GroupRequest, SamplingConfig, SiblingSpec
    from rolloutlog.controller.backends.fleet import EngineHealth, FleetBackend
    from rolloutlog.controller.backends.vllm_server import VLLMServerBackend
    from rolloutlog.controller.engines.ray_launcher import RayEngineLauncher

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    model_dir = build_tiny_model(tmp_path / "tiny")
    logs = tmp_path / "logs"
    logs.mkdir()
    launcher = RayEngineLauncher(
        LaunchConfig(
            placement="ray",
            count=2,
            model_dir=model_dir,
            max_model_len=128,
            ready_timeout_s=600,
            stop_timeout_s=15,
            log_dir=logs,
        )
    )
    try:
        urls = launcher.start()
        assert len(urls) == 2 and all(health_ok(u) for u in urls)

        async def scenario() -> None:
            fleet = FleetBackend(
                [
                    VLLMServerBackend(u, model_dir=model_dir, max_model_len=128, engine_id=f"r{i}")
                    for i, u in enumerate(urls)
                ],
                health_interval=0.2,
                dead_after=2,
            )
            await fleet.start()
            try:
                request = GroupRequest(1, (1, 4, 5, 6), (SiblingSpec(0, 0), SiblingSpec(1, 0)))
                results = await asyncio.gather(
                    *(fleet.generate(request) for _ in range(4)), return_exceptions=False
                )
                assert {r.engine_id for rs in results for r in rs} == {"r0", "r1"}
                await asyncio.to_thread(launcher.kill_actor, 1)
                deadline = asyncio.get_running_loop().time() + 30
                while fleet.health()["r1"] is not EngineHealth.DEAD:
                    assert asyncio.get_running_loop().time() < deadline, fleet.health()
                    await asyncio.sleep(0.1)
                again = await fleet.generate(
                    GroupRequest(2, (1, 4), (SiblingSpec(0, 0),), SamplingConfig(max_tokens=4))
                )
                assert again[0].engine_id == "r0"
            finally:
                await fleet.close()

        asyncio.run(scenario())
        assert not health_ok(urls[1])
    finally:
        launcher.stop()


# --- A real Ray head (own process group) and a stand-in server: no vLLM -----------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ray_cli() -> list[str]:
    return [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]


@contextlib.contextmanager
def _ray_head(tmp: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A Ray head in a process group of its own; the whole group is gone afterwards."""
    # Ray's socket paths under --temp-dir must fit AF_UNIX's 107 bytes.
    short_tmp = tempfile.mkdtemp(prefix="rl-ray-")
    port = _free_port()
    # No OOM killing of workers: the stand-ins are small, and on a shared machine other
    # processes' memory would otherwise get the tests' actors killed.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_memory_monitor_refresh_ms": "0"}
    head = subprocess.Popen(
        [
            *_ray_cli(), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
            "--include-dashboard=false", "--object-store-memory=200000000",
            f"--ray-client-server-port={_free_port()}",
            f"--dashboard-agent-listen-port={_free_port()}",
            f"--temp-dir={short_tmp}", "--disable-usage-stats",
        ],
        env=env, stdout=(tmp / "head.log").open("wb"), stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        # ~10 s on 2 idle cores; minutes when the machine is loaded.
        deadline = time.monotonic() + 240
        # Up once its raylet has registered (`ray start` says so), not when the GCS listens.
        while "Ray runtime started" not in (tmp / "head.log").read_text(errors="replace"):
            assert head.poll() is None, (tmp / "head.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the Ray head did not start within 240 s"
            time.sleep(0.5)
        yield f"127.0.0.1:{port}", head
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        stop_group(head.pid, 5.0)  # SIGKILL after 5 s: nothing of it may survive
        head.wait(timeout=10)
        shutil.rmtree(short_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One Ray head for the module's tests."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (extra [ray])")
    with _ray_head(tmp_path_factory.mktemp("ray")) as (address, _):
        yield address


def _ray_config(address: str, model: Path, logs: Path, **kw: object) -> LaunchConfig:
    logs.mkdir(exist_ok=True)
    base: dict[str, object] = dict(
        placement="ray", count=1, model_dir=model, ray_address=address, ready_timeout_s=60,
        stop_timeout_s=3, log_dir=logs,
    )  # fmt: skip
    base.update(kw)
    return LaunchConfig(**base)  # type: ignore[arg-type]


def _ppid(pid: int) -> int:
    # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces, so split after ")".
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _processes_running(needle: str) -> list[str]:
    """Command lines of live processes that mention ``needle`` (zombies excluded)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if needle in cmdline and state != "Z":
            found.append(cmdline)
    return found


def _tether_processes(pgid: int) -> list[int]:
    """The tether and its guard in a server's process group (not the server)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            if os.getpgid(int(proc.name)) == pgid and "engines.tether" in cmdline:
                found.append(int(proc.name))
        except (OSError, ProcessLookupError):
            continue
    return found


def _kill_groups_of(needle: str) -> None:
    """SIGKILL the process group of every live process that mentions ``needle``."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if needle in (proc / "cmdline").read_bytes().decode(errors="replace"):
                os.killpg(os.getpgid(int(proc.name)), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def _wait_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gone(pgid):
            return True
        time.sleep(0.1)
    return _gone(pgid)


@pytest.fixture
def ray_launcher_cls(ray_head: str) -> Iterator[type]:
    from rolloutlog.controller.engines.ray_launcher import RayEngineLauncher

    yield RayEngineLauncher
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.mark.slow
def test_sigkilled_actor_takes_its_server_with_it(
    ray_launcher_cls: type, ray_head: str, stand_in_python: str, model_dir: Path, tmp_path: Path
) -> None:
    import ray

    launcher = ray_launcher_cls(
        _ray_config(ray_head, model_dir, tmp_path / "logs"), python=stand_in_python
    )
    pgid = -1
    try:
        (url,) = launcher.start()
        pgid = ray.get(launcher.actors[0].pid.remote(), timeout=30)
        actor_pid = _ppid(pgid)  # the server group's leader is the actor's child
        os.kill(actor_pid, signal.SIGKILL)
        assert _wait_gone(pgid, 15), "the server group outlived its SIGKILLed actor"
        assert not health_ok(url)
        assert launcher.stop() == []
    finally:
        launcher.stop()
        if pgid > 0:
            stop_group(pgid, 5.0)  # nothing of the test survives it, even when it fails


@pytest.mark.slow
def test_stop_reports_a_server_it_cannot_reach(
    ray_launcher_cls: type, ray_head: str, stand_in_python: str, model_dir: Path, tmp_path: Path
) -> None:
    import ray

    launcher = ray_launcher_cls(
        _ray_config(ray_head, model_dir, tmp_path / "logs"), python=stand_in_python
    )
    pgid = -1
    try:
        (url,) = launcher.start()
        pgid = ray.get(launcher.actors[0].pid.remote(), timeout=30)
        # The actor, its server's tether and the tether's guard all die at once: the
        # server is orphaned and serves on.
        actor_pid = _ppid(pgid)
        for pid in [actor_pid, *_tether_processes(pgid)]:
            os.kill(pid, signal.SIGKILL)
        not_stopped = launcher.stop()
        assert len(not_stopped) == 1, not_stopped
        assert url in not_stopped[0] and "still answers" in not_stopped[0]
    finally:
        launcher.stop()
        if pgid > 0:
            stop_group(pgid, 5.0)


def _start_in_subprocess(address: str, model: Path, deadline_s: float) -> str:
    """``RayEngineLauncher.start()`` on ``address`` in a process of its own; its output."""
    code = (
        "from rolloutlog.controller.engines.config import LaunchConfig\n"
        "from rolloutlog.controller.engines.ray_launcher import RayEngineLauncher\n"
        "from rolloutlog.controller.engines.local import EngineLaunchError\n"
        f"c = LaunchConfig(placement='ray', model_dir={str(model)!r}, "
        f"ray_address={address!r})\n"
        "try:\n"
        "    RayEngineLauncher(c).start()\n"
        "except EngineLaunchError as exc:\n"
        "    print('ERROR:', exc)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        stop_group(proc.pid, 5.0)
        proc.communicate()
        pytest.fail(f"start() on a wrong Ray address was still blocked after {deadline_s} s")
    return out.decode()


@pytest.mark.slow
def test_wrong_ray_address_is_one_line_within_a_deadline(tmp_path: Path, model_dir: Path) -> None:
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (extra [ray])")
    address = f"127.0.0.1:{_free_port()}"  # nothing listens there
    out = _start_in_subprocess(address, model_dir, 60)
    lines = [ln for ln in out.splitlines() if ln.startswith("ERROR:")]
    assert lines == [
        f"ERROR: cannot reach the Ray cluster at {address} within 10 s (Connection refused); "
        "is `ray start --head` running there?"
    ], out


@pytest.mark.slow
def test_an_address_that_is_not_ray_is_one_line_within_a_deadline(model_dir: Path) -> None:
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (extra [ray])")
    import http.server
    import threading

    # An HTTP server where the Ray head should be (say, the dashboard's port).
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    server.RequestHandlerClass.log_message = lambda *a: None  # type: ignore[method-assign]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        out = _start_in_subprocess(address, model_dir, 60)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    lines = [ln for ln in out.splitlines() if ln.startswith("ERROR:")]
    assert lines == [
        f"ERROR: {address} answers, but not as a Ray cluster (no gRPC there); give the head's "
        "GCS address (`ray start --head` prints it, port 6379 by default)"
    ], out


@pytest.mark.slow
def test_engine_that_exits_before_ready_names_cause_and_log(
    ray_launcher_cls: type, ray_head: str, stand_in_python: str, model_dir: Path, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    config = _ray_config(ray_head, model_dir, logs, extra_args=("--fail",))
    launcher = ray_launcher_cls(config, python=stand_in_python)
    with pytest.raises(EngineLaunchError) as info:
        launcher.start()
    message = str(info.value)
    assert "engine-0" in message and "exited with 3 before it was ready" in message
    assert f"log {logs / 'engine-0.log'}" in message
    assert "stand-in: failing on purpose" in message
    assert launcher.actors == []


@pytest.mark.slow
def test_a_failed_actor_start_stops_the_servers_already_started(
    ray_launcher_cls: type, ray_head: str, stand_in_python: str, model_dir: Path, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "engine-1.log").mkdir()  # engine 1's actor cannot open its log
    config = _ray_config(ray_head, model_dir, logs, count=2)
    launcher = ray_launcher_cls(config, python=stand_in_python)
    try:
        with pytest.raises(EngineLaunchError, match=r"engine-1: its Ray actor could not start"):
            launcher.start()
        assert (logs / "engine-0.log").is_file()  # engine 0's server had been started
        deadline = time.monotonic() + 10
        stand_in_dir = str(Path(stand_in_python).parent)
        while _processes_running(stand_in_dir):
            assert time.monotonic() < deadline, _processes_running(stand_in_dir)
            time.sleep(0.2)
    finally:
        launcher.stop()


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``rolloutlog ARGS`` in a process of its own (its own group; killed at the deadline)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "from rolloutlog.cli import main; main()", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_group(proc.pid, 5.0)
        proc.communicate()
        pytest.fail(f"rolloutlog {' '.join(args)} still running after {timeout} s")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
def test_cli_starts_engines_on_a_ray_cluster_and_stops_them(
    ray_head: str, stand_in_python: str, model_dir: Path, tmp_path: Path
) -> None:
    state = tmp_path / "engines.json"
    started = _cli(
        "engines", "start", "--placement", "ray", "--ray-address", ray_head, "--count", "2",
        "--model", str(model_dir), "--python", stand_in_python, "--log-dir", str(tmp_path),
        "--state-file", str(state), "--json",
    )  # fmt: skip
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        urls = json.loads(started.stdout.splitlines()[-1])["urls"]
        assert len(urls) == 2
        # The command has exited; its detached actors and their servers serve on.
        assert all(health_ok(u) for u in urls)
        assert json.loads(state.read_text())["placement"] == "ray"
        stopped = _cli("engines", "stop", "--state-file", str(state))
        assert stopped.returncode == 0, stopped.stderr[-3000:]
        assert stopped.stdout.split("\n")[:2] == ["stopped engine-0", "stopped engine-1"]
        assert not any(health_ok(u) for u in urls)
        assert not state.exists()
    finally:
        if state.exists():
            _cli("engines", "stop", "--state-file", str(state))
    assert _processes_running(str(Path(stand_in_python).parent)) == []


def test_cli_ray_placement_needs_an_address(model_dir: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from rolloutlog.cli import main

    result = CliRunner().invoke(
        main,
        ["engines", "start", "--placement", "ray", "--model", str(model_dir),
         "--state-file", str(tmp_path / "s.json")],
    )  # fmt: skip
    assert result.exit_code == 1
    assert result.output.strip() == (
        "Error: --placement ray needs --ray-address HOST:PORT of a running cluster "
        "(`ray start --head` prints it)"
    )


@pytest.mark.slow
def test_engines_go_down_with_their_ray_cluster(
    stand_in_python: str, model_dir: Path, tmp_path: Path
) -> None:
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (extra [ray])")
    state = tmp_path / "engines.json"
    (tmp_path / "ray").mkdir()
    try:
        with _ray_head(tmp_path / "ray") as (address, head):
            started = _cli(
                "engines", "start", "--placement", "ray", "--ray-address", address,
                "--model", str(model_dir), "--python", stand_in_python, "--count", "1",
                "--log-dir", str(tmp_path), "--state-file", str(state), "--json",
            )  # fmt: skip
            assert started.returncode == 0, started.stderr[-3000:]
            (url,) = json.loads(started.stdout.splitlines()[-1])["urls"]
            assert health_ok(url)
            # The cluster goes (what `ray stop --force` or a lost head does to its workers).
            os.killpg(head.pid, signal.SIGKILL)
            deadline = time.monotonic() + 20
            while _processes_running(str(Path(stand_in_python).parent)):
                assert time.monotonic() < deadline, "a server outlived its Ray cluster"
                time.sleep(0.2)
            assert not health_ok(url)
    finally:
        _kill_groups_of(str(Path(stand_in_python).parent))  # anything left when the test failed

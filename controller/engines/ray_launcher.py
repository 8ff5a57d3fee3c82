"""Each vLLM OpenAI server inside a Ray actor (``[ray]`` extra).

An :class:`EngineActor` reserves no CPU (``num_cpus=0``: the server's own threads do
the work, and Ray would otherwise refuse to place more actors than cores). It starts
the same server command as the local launcher
(:func:`~rolloutlog.controller.engines.local.server_command`,
:func:`~rolloutlog.controller.engines.local.server_env`) as a child process in its own process group
on the actor's node, picks a free port there, and reports the URL. The controller then talks HTTP to
the engines exactly as to any other engine; Ray only places and supervises them. Works on a local
``ray.init()`` and on an existing cluster by address.

Locally: ``ray.init(num_cpus=2, object_store_memory=200 MiB, include_dashboard=False)``
(the object store is otherwise capped by a container's small ``/dev/shm``), and
``RAY_AUTH_MODE=disabled`` for the Ray processes it starts (Ray 2.60 turns token auth on
by default). Ray reads that variable from this process's environment while ``ray.init``
starts the head node, and would otherwise write ``token`` there itself, so it is set for
the duration of that call only and the environment is given back as it was found.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from rolloutlog.controller.engines.config import LaunchConfig
from rolloutlog.controller.engines.local import EngineLaunchError


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise EngineLaunchError(
            "ray is not importable; install the ray extra: pip install 'rolloutlog[ray]'"
        ) from exc
    return ray


class _EngineActorImpl:
    """The body of :data:`EngineActor` (a plain class, so it can be read and tested)."""

    def __init__(self, config_json: str, index: int) -> None:
        self.config = LaunchConfig.model_validate_json(config_json)
        self.index = index
        self.proc: Any = None
        self.url = ""

    def start(self) -> str:
        """Start the server on a free port of this node; returns its URL."""
        import subprocess
        import sys

        from rolloutlog.controller.engines.local import server_command, server_env

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        host = _node_ip()
        config = self.config.model_copy(update={"host": "0.0.0.0"})
        log_dir = self.config.log_dir or "/tmp"
        log = open(f"{log_dir}/ray-engine-{self.index}-{port}.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            server_command(config, port, sys.executable),
            env=server_env(config),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.url = f"http://{host}:{port}"
        return self.url

    def alive(self) -> bool:
        """Whether the server process is still running."""
        return self.proc is not None and self.proc.poll() is None

    def pid(self) -> int:
        """The server's pid (= its process group id)."""
        return int(self.proc.pid) if self.proc is not None else -1

    def stop(self) -> bool:
        """Stop the server's process group (SIGTERM, then SIGKILL after the deadline)."""
        from rolloutlog.controller.engines.local import stop_group

        if self.proc is None:
            return False
        return stop_group(self.proc.pid, self.config.stop_timeout_s)


_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _environment(defaults: dict[str, str]) -> Iterator[None]:
    """``defaults`` (where the process has no value of its own) in ``os.environ`` for the
    duration of the block, for the children started in it; afterwards every variable is
    what it was before, including one the block's callee wrote itself."""
    with _ENV_LOCK:
        saved = {name: os.environ.get(name) for name in defaults}
        try:
            for name, value in defaults.items():
                os.environ.setdefault(name, value)
            yield
        finally:
            for name, before in saved.items():
                if before is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = before


def _node_ip() -> str:
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:
        return "127.0.0.1"


class RayEngineLauncher:
    """Start ``config.count`` engine actors on Ray and wait until their servers answer."""

    def __init__(self, config: LaunchConfig) -> None:
        if config.placement != "ray":
            raise ValueError(f"placement {config.placement!r}: use the local launcher")
        self.config = config
        self.actors: list[Any] = []
        self.urls: list[str] = []
        self._ray_started_here = False

    def init_ray(self) -> None:
        """Connect to ``ray_address``, or start a small local Ray instance."""
        ray = _ray()
        if ray.is_initialized():
            return
        if self.config.ray_address:
            ray.init(address=self.config.ray_address)
        else:
            with _environment({"RAY_AUTH_MODE": "disabled"}):
                ray.init(
                    num_cpus=2,
                    object_store_memory=200 * 1024 * 1024,
                    include_dashboard=False,
                    log_to_driver=False,
                )
            self._ray_started_here = True

    def start(self) -> list[str]:
        """Start the actors and their servers; returns the URLs once all are healthy."""
        from rolloutlog.controller.engines.local import health_ok

        ray = _ray()
        self.init_ray()
        actor_cls = ray.remote(num_cpus=0)(_EngineActorImpl)
        payload = self.config.model_dump_json()
        self.actors = [actor_cls.remote(payload, i) for i in range(self.config.count)]
        self.urls = list(ray.get([a.start.remote() for a in self.actors], timeout=120))
        deadline = time.monotonic() + self.config.ready_timeout_s
        pending = list(zip(self.actors, self.urls, strict=True))
        while pending:
            for actor, url in list(pending):
                if not ray.get(actor.alive.remote(), timeout=30):
                    self.stop()
                    raise EngineLaunchError(f"engine server at {url} exited before it was ready")
                if health_ok(url):
                    pending.remove((actor, url))
            if pending and time.monotonic() > deadline:
                self.stop()
                raise EngineLaunchError(
                    f"{[u for _, u in pending]} not ready within {self.config.ready_timeout_s} s"
                )
            if pending:
                time.sleep(0.5)
        return self.urls

    def kill_actor(self, index: int) -> None:
        """Stop one engine's server and kill its actor (fault injection)."""
        ray = _ray()
        actor = self.actors[index]
        try:
            ray.get(actor.stop.remote(), timeout=60)
        finally:
            ray.kill(actor)

    def stop(self) -> None:
        """Stop every server (process group), kill the actors, shut a local Ray down."""
        ray = _ray()
        for actor in self.actors:
            # The actor may already be dead (its server was stopped with it).
            with contextlib.suppress(Exception):
                ray.get(actor.stop.remote(), timeout=self.config.stop_timeout_s + 10)
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self.actors = []
        if self._ray_started_here:
            ray.shutdown()
            self._ray_started_here = False

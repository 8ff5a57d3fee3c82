"""Each vLLM OpenAI server inside a Ray actor (``[ray]`` extra).

An :class:`EngineActor` reserves no CPU (``num_cpus=0``: the server's own threads do
the work, and Ray would otherwise refuse to place more actors than cores). It starts
the same server command as the local launcher
(:func:`~rolloutlog.controller.engines.local.server_command`,
:func:`~rolloutlog.controller.engines.local.server_env`) in its own process group on the
actor's node, under :mod:`~rolloutlog.controller.engines.tether` (the server group dies
with its actor: a SIGKILLed actor or ``ray stop`` leaves no server behind), picks a free
port there, and reports the URL. The controller then talks HTTP to the engines exactly as
to any other engine; Ray only places and supervises them. Works on a local ``ray.init()``
and on an existing cluster by address (probed within a deadline first, see
:func:`probe_address`: ``ray.init`` on a wrong address waits without one).

Locally: ``ray.init(num_cpus=2, object_store_memory=200 MiB, include_dashboard=False)``
(the object store is otherwise capped by a container's small ``/dev/shm``), and
``RAY_AUTH_MODE=disabled`` for the Ray processes it starts (Ray 2.60 turns token auth on
by default). Ray reads that variable from this process's environment while ``ray.init``
starts the head node, and would otherwise write ``token`` there itself, so it is set for
the duration of that call only and the environment is given back as it was found.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rolloutlog.controller.engines.config import LaunchConfig
from rolloutlog.controller.engines.local import EngineLaunchError, log_tail

log = logging.getLogger(__name__)

#: The Ray namespace of the named (detached) engine actors ``rolloutlog engines start`` leaves.
NAMESPACE = "rolloutlog-engines"
#: Seconds to reach a Ray cluster address (TCP, HTTP/2) before ``ray.init``.
CONNECT_TIMEOUT_S = 10.0
#: Seconds for one actor to place itself and start its server process.
ACTOR_START_TIMEOUT_S = 120.0


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise EngineLaunchError(
            "ray is not importable; install the ray extra: pip install 'rolloutlog[ray]'"
        ) from exc
    return ray


class _EngineActorImpl:
    """The body of the engine actor (a plain class, so it can be read and tested)."""

    def __init__(self, config_json: str, index: int, python: str | None = None) -> None:
        self.config = LaunchConfig.model_validate_json(config_json)
        self.index = index
        self.python = python
        self.proc: Any = None
        self.url = ""
        self.log_path = ""

    def start(self) -> str:
        """Start the server on a free port of this node; returns its URL."""
        import subprocess
        import sys
        import tempfile

        from rolloutlog.controller.engines.local import server_command, server_env

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        host = _node_ip()
        config = self.config.model_copy(update={"host": "0.0.0.0"})
        log_dir = Path(self.config.log_dir or tempfile.gettempdir())
        log_dir.mkdir(parents=True, exist_ok=True)  # on this node, as the local launcher does
        self.log_path = str(log_dir / f"engine-{self.index}.log")
        command = server_command(config, port, self.python or sys.executable)
        tether = [sys.executable, "-m", "rolloutlog.controller.engines.tether"]
        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(
                [*tether, str(os.getpid()), str(self.config.stop_timeout_s), "--", *command],
                env=server_env(config),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stopped as a whole
            )
        self.url = f"http://{host}:{port}"
        return self.url

    def alive(self) -> bool:
        """Whether the server process is still running."""
        return self.proc is not None and self.proc.poll() is None

    def exit_info(self) -> tuple[int | None, str, str, str]:
        """(exit status or None, log path, its tail, node address) of the server."""
        code = None if self.proc is None else self.proc.poll()
        return code, self.log_path, log_tail(self.log_path), _node_ip()

    def pid(self) -> int:
        """The server group's id (the tether process's pid)."""
        return int(self.proc.pid) if self.proc is not None else -1

    def actor_pid(self) -> int:
        """This actor's worker process (fault injection)."""
        return os.getpid()

    def stop(self) -> bool:
        """Stop the server's process group (SIGTERM, then SIGKILL after the deadline)."""
        from rolloutlog.controller.engines.local import stop_group

        if self.proc is None:
            return False
        killed = stop_group(self.proc.pid, self.config.stop_timeout_s)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=1)
        return killed


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


#: The HTTP/2 client connection preface and an empty SETTINGS frame (RFC 9113 3.4, 6.5).
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def probe_address(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Raise :class:`EngineLaunchError` (one line) unless ``address`` answers like Ray's GCS.

    ``ray.init(address=...)`` retries a wrong address with no deadline. The probe connects
    (TCP) and opens an HTTP/2 connection, as a gRPC client does: Ray's GCS (and a Ray
    client server, ``ray://``) answers with a SETTINGS frame; a closed port, a host that
    does not answer or a service of another protocol (the dashboard's HTTP port) fails
    within ``timeout``. ``auto`` and ``local`` are Ray's own lookups and are not probed.
    """
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port_text = hostport.rpartition(":")
    if not sep or not port_text.isdigit() or not host:
        raise EngineLaunchError(f"Ray address {address!r} is not HOST:PORT (or ray://HOST:PORT)")
    try:
        with socket.create_connection((host.strip("[]"), int(port_text)), timeout=timeout) as s:
            s.sendall(_H2_PREFACE)
            head = _read_exactly(s, 9, time.monotonic() + timeout)
    except OSError as exc:
        reason = "no answer" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        raise EngineLaunchError(
            f"cannot reach the Ray cluster at {address} within {timeout:g} s ({reason}); "
            f"is `ray start --head` running there?"
        ) from None
    if len(head) < 9 or head[3] != 0x04:  # frame type SETTINGS
        raise EngineLaunchError(
            f"{address} answers, but not as a Ray cluster (no gRPC there); give the head's "
            f"GCS address (`ray start --head` prints it, port 6379 by default)"
        )


def _read_exactly(s: socket.socket, n: int, deadline: float) -> bytes:
    data = b""
    while len(data) < n:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = s.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


class RayEngineLauncher:
    """Start ``config.count`` engine actors on Ray and wait until their servers answer.

    ``detached`` makes named actors in :data:`NAMESPACE` that outlive this process
    (``rolloutlog engines start --placement ray``); :meth:`state` records them for
    :func:`stop_from_state`. ``python`` is the interpreter that runs each server (default:
    the actor's).
    """

    def __init__(
        self, config: LaunchConfig, *, python: str | None = None, detached: bool = False
    ) -> None:
        if config.placement != "ray":
            raise ValueError(f"placement {config.placement!r}: use the local launcher")
        self.config = config
        self.python = python
        self.detached = detached
        self.actors: list[Any] = []
        self.actor_names: list[str] = []
        self.urls: list[str] = []
        self._ray_started_here = False

    def init_ray(self) -> None:
        """Connect to ``ray_address`` (probed within a deadline), or start a local Ray."""
        ray = _ray()
        if ray.is_initialized():
            return
        if self.config.ray_address:
            probe_address(self.config.ray_address)
            ray.init(
                address=self.config.ray_address,
                namespace=NAMESPACE,
                log_to_driver=False,
            )
        else:
            with _environment({"RAY_AUTH_MODE": "disabled"}):
                ray.init(
                    num_cpus=2,
                    object_store_memory=200 * 1024 * 1024,
                    include_dashboard=False,
                    log_to_driver=False,
                    namespace=NAMESPACE,
                )
            self._ray_started_here = True

    def start(self) -> list[str]:
        """Start the actors and their servers; returns the URLs once all are healthy.

        On any failure every server and actor already started is stopped first.
        """
        try:
            return self._start()
        except BaseException:
            not_stopped = self.stop()
            if not_stopped:
                log.error("after a failed start, not stopped: %s", "; ".join(not_stopped))
            raise

    def _start(self) -> list[str]:
        from rolloutlog.controller.engines.local import health_ok

        ray = _ray()
        self.init_ray()
        actor_cls = ray.remote(num_cpus=0)(_EngineActorImpl)
        payload = self.config.model_dump_json()
        run_id = uuid.uuid4().hex[:8]
        for i in range(self.config.count):
            options: dict[str, Any] = {}
            if self.detached:
                name = f"engine-{run_id}-{i}"
                options = {"name": name, "namespace": NAMESPACE, "lifetime": "detached"}
                self.actor_names.append(name)
            self.actors.append(actor_cls.options(**options).remote(payload, i, self.python))
        refs = [a.start.remote() for a in self.actors]
        self.urls = []
        for i, ref in enumerate(refs):
            try:
                self.urls.append(str(ray.get(ref, timeout=ACTOR_START_TIMEOUT_S)))
            except ray.exceptions.GetTimeoutError:
                raise EngineLaunchError(
                    f"engine-{i}: its Ray actor did not start within {ACTOR_START_TIMEOUT_S:g} s "
                    f"(no room on the cluster?)"
                ) from None
            except ray.exceptions.RayError as exc:
                cause = getattr(exc, "cause", None) or exc
                first = next((ln for ln in str(cause).splitlines() if ln.strip()), "")
                raise EngineLaunchError(
                    f"engine-{i}: its Ray actor could not start the server: "
                    f"{type(cause).__name__}: {first[:300]}"
                ) from None
        deadline = time.monotonic() + self.config.ready_timeout_s
        pending = list(enumerate(zip(self.actors, self.urls, strict=True)))
        while pending:
            for item in list(pending):
                i, (actor, url) = item
                if not ray.get(actor.alive.remote(), timeout=30):
                    code, log_path, tail, node = ray.get(actor.exit_info.remote(), timeout=30)
                    raise EngineLaunchError(
                        f"engine-{i} ({url}) exited with {code} before it was ready; "
                        f"log {log_path} on {node}:\n{tail}"
                    )
                if health_ok(url):
                    pending.remove(item)
            if pending and time.monotonic() > deadline:
                i, (actor, url) = pending[0]
                _, log_path, tail, node = ray.get(actor.exit_info.remote(), timeout=30)
                raise EngineLaunchError(
                    f"{[f'engine-{j}' for j, _ in pending]} not ready within "
                    f"{self.config.ready_timeout_s} s; log tail of {log_path} on {node}:\n{tail}"
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

    def stop(self) -> list[str]:
        """Stop every server (process group), kill the actors, shut a local Ray down.

        Returns what it could not stop, one line each (also logged): an engine whose actor
        is gone and whose server still answers ``/health`` after ``stop_timeout_s``.
        """
        ray = _ray()
        ids = [f"engine-{i}" for i in range(len(self.actors))]
        not_stopped = _stop_actors(ray, self.actors, self.urls, ids, self.config.stop_timeout_s)
        self.actors = []
        self.actor_names = []
        if self._ray_started_here:
            ray.shutdown()
            self._ray_started_here = False
        return not_stopped

    def state(self) -> dict[str, object]:
        """What ``rolloutlog engines stop`` needs to find the (detached) actors again."""
        return {
            "placement": "ray",
            "ray_address": self.config.ray_address,
            "namespace": NAMESPACE,
            "engines": [
                {"engine_id": f"engine-{i}", "url": url, "actor": name}
                for i, (url, name) in enumerate(zip(self.urls, self.actor_names, strict=False))
            ],
            "stop_timeout_s": self.config.stop_timeout_s,
            "launch": self.config.model_dump(mode="json"),
        }


def _stop_actors(
    ray: Any, actors: list[Any], urls: list[str], ids: list[str], stop_timeout_s: float
) -> list[str]:
    from rolloutlog.controller.engines.local import health_ok

    not_stopped: list[str] = []
    for i, actor in enumerate(actors):
        url = urls[i] if i < len(urls) else None  # None: its start never reported a URL
        engine_id = ids[i] if i < len(ids) else f"engine-{i}"
        try:
            ray.get(actor.stop.remote(), timeout=stop_timeout_s + 10)
        except ray.exceptions.RayActorError:
            # Its actor died first: its server's tether stops the server; confirm it.
            deadline = time.monotonic() + stop_timeout_s + 5
            while url and health_ok(url, timeout=1.0) and time.monotonic() < deadline:
                time.sleep(0.2)
            if url and health_ok(url, timeout=1.0):
                not_stopped.append(
                    f"{engine_id} ({url}): its Ray actor is gone and its server still answers"
                )
        except Exception as exc:  # a timeout, a lost node: name it, stop the rest
            not_stopped.append(f"{engine_id} ({url}): stop failed: {type(exc).__name__}: {exc}")
        with contextlib.suppress(Exception):
            ray.kill(actor)
    for line in not_stopped:
        log.error("not stopped: %s", line)
    return not_stopped


def stop_from_state(state: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Stop the detached engine actors recorded by ``engines start --placement ray``.

    Returns (stopped engine ids, lines naming what could not be stopped).
    """
    ray = _ray()
    address = state.get("ray_address")
    if not address:
        raise EngineLaunchError("the state file records no Ray address")
    if not ray.is_initialized():
        probe_address(str(address))
        ray.init(address=address, namespace=state.get("namespace", NAMESPACE), log_to_driver=False)
    from rolloutlog.controller.engines.local import health_ok

    actors: list[Any] = []
    urls: list[str] = []
    ids: list[str] = []
    gone: list[str] = []
    problems: list[str] = []
    for engine in state["engines"]:
        engine_id, url = str(engine["engine_id"]), str(engine["url"])
        try:
            actors.append(ray.get_actor(engine["actor"], namespace=state.get("namespace")))
        except ValueError:  # no such actor: gone already, and its server with it?
            if health_ok(url):
                problems.append(
                    f"{engine_id} ({url}): its Ray actor is gone and its server still answers"
                )
            else:
                gone.append(engine_id)
            continue
        urls.append(url)
        ids.append(engine_id)
    problems += _stop_actors(ray, actors, urls, ids, float(state.get("stop_timeout_s", 20.0)))
    stopped = [e for e in ids if not any(n.startswith(f"{e} ") for n in problems)]
    return stopped + gone, problems

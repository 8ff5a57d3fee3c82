"""A real Prometheus server for the observability tests (Debian's ``prometheus``).

The test set-up (``scripts/setup.sh``, as root) installs it. Missing binaries skip the
tests, except in CI (``CI`` set), where they fail: CI must test against the real server.
The server runs in its own process group with a temporary config and data folder, on a
free port of 127.0.0.1, and is killed (the whole group) when the test ends.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def require_binary(name: str) -> str:
    """The path of ``name``; skips the test (fails in CI) when it is not installed."""
    path = shutil.which(name)
    if path is None:
        reason = (
            f"{name} is not installed (Debian: apt-get install -y prometheus chromium, "
            "or scripts/setup.sh as root)"
        )
        if IN_CI:
            pytest.fail(f"{reason}; CI must run this test", pytrace=False)
        pytest.skip(reason)
    return path


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """Kill a child started with ``start_new_session=True`` and everything it started."""
    if proc.poll() is None:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


class Prometheus:
    """A running server: PromQL over its HTTP API."""

    def __init__(self, url: str, proc: subprocess.Popen[Any]) -> None:
        self.url = url
        self.proc = proc

    def api(self, path: str, **params: Any) -> Any:
        """GET ``/api/v1/<path>``; returns ``data`` (raises on an error status)."""
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path} {params}: {exc} {exc.read()[:500]!r}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result list."""
        params: dict[str, Any] = {"query": promql}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return list(self.api("query", **params)["result"])

    def wait_until_rules(self, timeout: float = 30.0) -> list[dict[str, Any]]:
        """The rule groups once every rule has been evaluated at least once."""
        deadline = time.monotonic() + timeout
        while True:
            groups = list(self.api("rules")["groups"])
            rules = [r for g in groups for r in g["rules"]]
            if rules and all(r.get("health") != "unknown" for r in rules):
                return groups
            if time.monotonic() > deadline:
                raise AssertionError(f"rules not evaluated within {timeout} s: {groups}")
            time.sleep(0.25)

    def wait_until(self, promql: str, ok: Any, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Query until ``ok(result)``; fails after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(promql)
            if ok(result):
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting on {promql!r}: last result {result}")
            time.sleep(0.25)


@contextmanager
def prometheus(
    tmp: Path, targets: dict[str, str], *, rule_files: tuple[Path, ...] = ()
) -> Iterator[Prometheus]:
    """Start Prometheus scraping ``targets`` (job name -> host:port) every second."""
    binary = require_binary("prometheus")
    port = free_port()
    jobs = "\n".join(
        f"  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']"
        for job, target in targets.items()
    )
    rules = "".join(f"\n  - {p}" for p in rule_files)
    config = tmp / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n  evaluation_interval: 1s\n"
        + (f"rule_files:{rules}\n" if rules else "")
        + f"scrape_configs:\n{jobs}\n"
    )
    log = (tmp / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    server = Prometheus(f"http://127.0.0.1:{port}", proc)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise AssertionError(
                    f"prometheus exited ({proc.returncode}): {(tmp / 'prometheus.log').read_text()}"
                )
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("prometheus did not become ready within 60 s")
            time.sleep(0.2)
        yield server
    finally:
        kill_group(proc)
        log.close()

"""Fixtures of the end-to-end tests: the ``rolloutlog`` CLI and the example as real
subprocesses, and the vLLM policy of ``tests/backends/conftest.py`` (without the
``vllm`` module a vLLM test skips, except in CI, where it fails)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def rolloutlog_exe() -> list[str]:
    """The command line that runs the ``rolloutlog`` CLI of this interpreter."""
    script = Path(sys.executable).parent / "rolloutlog"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "from rolloutlog.cli import main; main()"]


def run_cmd(
    args: list[str], *, timeout: float, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``args`` to completion (offline, quiet transformers) and return the result."""
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error"
    )
    # Its own process group: on a timeout (or when it leaves children behind, e.g. vLLM's
    # engine processes) the whole group is killed, so nothing of it outlives the test.
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd or REPO,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, err = proc.communicate(timeout=30)
        raise AssertionError(
            f"{' '.join(args)} did not finish in {timeout} s; stderr: {err[-3000:]}"
        ) from None
    finally:
        _kill_group(proc.pid)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _kill_group(pgid: int) -> None:
    """SIGKILL every process left in the process group ``pgid`` (none: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def rolloutlog(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``rolloutlog ARGS`` as a subprocess."""
    return run_cmd([*rolloutlog_exe(), *args], timeout=timeout)


def json_lines(stdout: str) -> list[dict[str, Any]]:
    """The JSON objects printed one per line (other lines ignored)."""
    out = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def require_vllm() -> None:
    """Skip (fail in CI) when the vllm module is missing."""
    if importlib.util.find_spec("vllm") is None:
        reason = "the vllm module is not installed (scripts/setup.sh --vllm)"
        if IN_CI:
            pytest.fail(f"vLLM is required in CI but unavailable: {reason}", pytrace=False)
        pytest.skip(f"vLLM unavailable: {reason}")

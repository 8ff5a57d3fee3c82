"""The light core install: ``pip install rolloutlog`` (no extras) in a fresh venv.

The log, audit, replay, metrics and the CLI work on a demo database made by the full
install, ``rolloutlog db upgrade`` finds the migrations inside the installed wheel (no
editable install, no source tree on the path), there is no torch, and the commands
that need torch name the extra to install.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _run(
    args: list[str], *, cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run a child in its own process group; kill the whole group if it overruns."""
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{args} ran past {timeout}s:\n{out}\n{err[-3000:]}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with only ``pip install <repo>`` (a wheel built from a copy of the tree)."""
    root = tmp_path_factory.mktemp("core")
    src = root / "src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "runs", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"
        ),
    )
    venv = root / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = _run([base, "-m", "venv", str(venv)], cwd=root, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
    proc = _run([*pip, "install", str(src)], cwd=root, env=env, timeout=900)
    if proc.returncode != 0 and "No matching distribution" in proc.stderr:
        pytest.skip(f"no package index reachable for the core install: {proc.stderr[-500:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return venv


@pytest.fixture(scope="module")
def demo_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A demo database written by the full install (this interpreter, with torch)."""
    pytest.importorskip("torch")
    work = tmp_path_factory.mktemp("demo")
    url = f"sqlite:///{work / 'demo.db'}"
    args = [sys.executable, "-c", "from rolloutlog.cli import main; main()", "demo", "--json"]
    args += ["--steps", "8", "--checkpoint-every", "3", "--workdir", str(work), "--db", url]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = _run(args, cwd=work, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["ok"] is True
    return url


def _core_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _core(venv: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return _run(
        [str(venv / "bin" / "rolloutlog"), *args], cwd=venv, env=_core_env(), timeout=timeout
    )


def test_core_has_no_torch_and_comes_from_the_wheel(core_venv: Path) -> None:
    code = (
        "import importlib.util, json, rolloutlog.migrations as m\n"
        "print(json.dumps([m.__file__, [n for n in ('torch', 'transformers', 'tokenizers',\n"
        "    'safetensors', 'vllm') if importlib.util.find_spec(n) is not None]]))\n"
    )
    py = str(core_venv / "bin" / "python")
    proc = _run([py, "-c", code], cwd=core_venv, env=_core_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    migrations_file, heavy = json.loads(proc.stdout)
    assert "site-packages" in migrations_file
    assert heavy == []
    proc = _run([py, "-c", "import torch"], cwd=core_venv, env=_core_env(), timeout=60)
    assert proc.returncode != 0 and "No module named 'torch'" in proc.stderr


def test_core_commands_on_a_demo_database(core_venv: Path, demo_db: str, tmp_path: Path) -> None:
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    proc = _core(core_venv, "db", "upgrade", fresh)
    assert proc.returncode == 0, proc.stderr
    proc = _core(core_venv, "db", "check", demo_db)
    assert proc.returncode == 0, proc.stderr

    proc = _core(core_venv, "audit", demo_db, "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert len(rows) == 1

    proc = _core(core_venv, "replay", demo_db, "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr

    proc = _core(core_venv, "metrics", demo_db, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)


def test_core_serve_metrics(core_venv: Path, demo_db: str) -> None:
    args = [str(core_venv / "bin" / "rolloutlog"), "serve-metrics", demo_db]
    args += ["--port", "0", "--host", "127.0.0.1", "--interval", "0.1"]
    proc = subprocess.Popen(
        args,
        cwd=core_venv,
        env={**_core_env(), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    try:
        line = lines.get(timeout=60)
        assert "serving metrics of run" in line, line
        port = int(line.split("(port ")[1].split(")")[0])
        deadline = time.monotonic() + 30
        body = ""
        while time.monotonic() < deadline and "rollout_" not in body:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
                body = resp.read().decode()
        assert "rollout_" in body
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_core_demo_names_the_torch_extra(core_venv: Path, tmp_path: Path) -> None:
    proc = _core(
        core_venv, "demo", "--workdir", str(tmp_path), "--db", f"sqlite:///{tmp_path}/d.db"
    )
    assert proc.returncode != 0
    assert "pip install 'rolloutlog[torch]'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1

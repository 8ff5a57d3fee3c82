"""Fixtures of the engine-launcher tests: a stand-in server and a model folder (no vLLM).

The stand-in "python" ignores the vLLM module it is told to run and serves ``/health`` on
``--host`` (default 127.0.0.1) and ``--port``, after starting a child in its own process
group (like vLLM's engine core); ``--fail`` exits 3 at once and ``--ignore-term`` ignores
SIGTERM. The local and the Ray launcher tests start it alike.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

STAND_IN = r"""
import http.server, subprocess, sys, time
args = sys.argv[1:]
host = args[args.index("--host") + 1] if "--host" in args else "127.0.0.1"
port = int(args[args.index("--port") + 1])
if "--fail" in args:
    print("stand-in: failing on purpose", flush=True)
    sys.exit(3)
if "--ignore-term" in args:
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
# A child in the same process group, like vLLM's engine core.
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
time.sleep(0.3)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer((host, port), H).serve_forever()
"""


@pytest.fixture
def stand_in_python(tmp_path: Path) -> str:
    """A "python" for the launchers that runs the stand-in server instead of vLLM."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    exe = tmp_path / "python"
    # The launchers call "python -m vllm.entrypoints...": drop those two words.
    exe.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A model folder the launchers accept (the stand-in never reads it)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d

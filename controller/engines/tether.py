"""Run an engine server tied to the life of a parent process (a Ray engine actor).

``python -m rolloutlog.controller.engines.tether PARENT_PID GRACE_S -- COMMAND...``
runs COMMAND as a child in this process's group (the caller starts this process in a
session of its own) and waits for it. If PARENT_PID stops being this process's parent
(the actor was SIGKILLed, or ``ray stop`` took its worker), the whole group gets SIGTERM,
then SIGKILL after GRACE_S: a server must not outlive the actor that owns it, serving and
taking refits nobody can stop. SIGTERM to the group (the actor's own stop) reaches the
server directly; this process then just waits for the server to exit.

Polling ``getppid`` rather than ``PR_SET_PDEATHSIG``: the death signal fires when the
parent *thread* that forked exits, and Ray runs actor methods on threads of its own.

A Ray worker that exits SIGKILLs its own children (this process) but not theirs: so a
guard (``--guard TETHER_PID SERVER_PID GRACE_S``, a child of this process in the same
group) does the same for this process: when the tether is gone, it stops the group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

_POLL_S = 0.2


def main(argv: list[str]) -> int:
    """Run the command after ``--``; returns its exit status."""
    if len(argv) == 4 and argv[0] == "--guard":
        return _guard(int(argv[1]), int(argv[2]), float(argv[3]))
    if len(argv) < 4 or argv[2] != "--":
        print("usage: tether PARENT_PID GRACE_S -- COMMAND...", file=sys.stderr)
        return 2
    parent, grace, command = int(argv[0]), float(argv[1]), argv[3:]
    # A handler (not SIG_IGN, which the server would inherit): the group's SIGTERM is the
    # server's to act on; this process leaves once the server has gone.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server = subprocess.Popen(command)
    guard = subprocess.Popen(
        [sys.executable, "-m", "rolloutlog.controller.engines.tether",
         "--guard", str(os.getpid()), str(server.pid), str(grace)],
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    while server.poll() is None:
        if os.getppid() != parent:
            print("tether: the actor is gone; stopping its server", flush=True)
            _stop_group(lambda: server.poll() is not None, grace)
            return 1
        time.sleep(_POLL_S)
    with contextlib.suppress(ProcessLookupError):
        guard.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        guard.wait(timeout=5)
    return int(server.returncode)


def _guard(tether: int, server: int, grace: float) -> int:
    signal.signal(signal.SIGTERM, lambda *_: None)  # a group stop: leave with the server
    while _alive(server):
        if os.getppid() != tether:
            print("tether guard: the tether is gone; stopping its server", flush=True)
            _stop_group(lambda: not _alive(server), grace)
            return 1
        time.sleep(_POLL_S)
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) is gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _stop_group(gone: Callable[[], bool], grace: float) -> None:
    """SIGTERM this process's group, SIGKILL it (this process too) after ``grace`` s."""
    pgid = os.getpgid(0)
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while not gone() and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    os.killpg(pgid, signal.SIGKILL)  # the server's own children, and this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

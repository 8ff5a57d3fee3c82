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
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

_POLL_S = 0.2


def main(argv: list[str]) -> int:
    """Run the command after ``--``; returns its exit status."""
    if len(argv) < 4 or argv[2] != "--":
        print("usage: tether PARENT_PID GRACE_S -- COMMAND...", file=sys.stderr)
        return 2
    parent, grace, command = int(argv[0]), float(argv[1]), argv[3:]
    # A handler (not SIG_IGN, which the server would inherit): the group's SIGTERM is the
    # server's to act on; this process leaves once the server has gone.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server = subprocess.Popen(command)
    while server.poll() is None:
        if os.getppid() != parent:
            _stop_own_group(server, grace)
            return 1
        time.sleep(_POLL_S)
    return int(server.returncode)


def _stop_own_group(server: subprocess.Popen[bytes], grace: float) -> None:
    print(f"tether: parent gone; stopping the server group (SIGKILL after {grace} s)", flush=True)
    pgid = os.getpgid(0)
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while server.poll() is None and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    os.killpg(pgid, signal.SIGKILL)  # the server's own children, and this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A live run process for the kill and takeover tests.

Usage: python kill_worker.py URL RUN_ID start|open|restore STEPS
Prints ``READY``, then ``ACK <offset>`` each time flush() acknowledged durability, and
``DONE`` at the end. On losing the run to another epoch it prints ``FENCED <message>``
and exits with status 3.

``python kill_worker.py --fork-server FD``: a process that has imported all of the above
once (torch and rolloutlog: seconds of a kill's start on 2 cores) and forks one worker per
request on the socket FD (``reliability_harness.ForkServer``), each running ``main`` in its
own session with the stdout and stderr the request passed. The kill loop uses it: the same
worker code and the same SIGKILL of a live process, without the interpreter's start-up in
every kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reliability_harness import WEIGHTS, Prompts, backend, rollout_config

from rolloutlog.controller.config import StoreConfig
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.eventstore import EpochFencedError, EventStore


class BigPrompts(Prompts):
    """Enough prompts that a run never runs out during the kill loop."""

    num_prompts = 1_000_000


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def fenced_cause(exc: BaseException) -> EpochFencedError | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, EpochFencedError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


async def main(url: str, run_id: str, mode: str, steps: int) -> int:
    store = EventStore.open(url)
    cfg = StoreConfig(group_commit_window_ms=2, snapshot_interval=200)
    if mode == "start":
        ctl = RolloutController.start(
            store,
            run_id,
            rollout_config(),
            dataset_fingerprint=BigPrompts.fingerprint,
            dataset_size=BigPrompts.num_prompts,
            store_config=cfg,
        )
        say(f"ACK {ctl.checkpoint(0)}")
    elif mode == "open":
        ctl = RolloutController.open(store, run_id, store_config=cfg)
    else:
        offset = max(r.seq for r in store.read_history(run_id) if r.type == "CheckpointMarked")
        ctl, _report = RolloutController.restore(store, run_id, offset, store_config=cfg)
    runtime = RolloutRuntime(ctl, backend(), BigPrompts(), GenerationConfig(max_tokens=4))
    await runtime.start()
    say(f"READY epoch={ctl.epoch} step={ctl.state.train_step}")
    try:
        await runtime.sync_weights(WEIGHTS, ctl.state.weight_version)
        while ctl.state.train_step < steps:
            step = ctl.state.train_step
            await runtime.next_batch(step, timeout=60)
            say(f"ACK {ctl.committer.durable_seq}")
            await runtime.report_trained(step, step + 1)
            await runtime.publish_weights(WEIGHTS, step + 1)
            say(f"ACK {await runtime.checkpoint(step + 1)}")
        say("DONE")
        return 0
    except Exception as exc:
        cause = fenced_cause(exc)
        if cause is not None:
            say(f"FENCED {cause}")
            return 3
        raise
    finally:
        try:
            await runtime.close()  # raises a failed final flush (a fenced one here)
        except Exception as exc:
            if fenced_cause(exc) is None:
                raise
        try:
            ctl.close()
        except Exception as exc:
            if fenced_cause(exc) is None:
                raise


def serve_forks(fd: int) -> int:
    """Fork a worker per request on the SOCK_SEQPACKET socket ``fd`` until it closes.

    A request is a JSON ``[url, run_id, mode, steps]`` with two descriptors (the worker's
    stdout and stderr); the answer is ``PID <pid>``, and ``EXIT <pid> <status>`` (the
    ``Popen.returncode`` convention) once the worker is reaped. When the test closes its
    end, workers still running are SIGKILLed and reaped before this process exits.
    """
    import json
    import os
    import select
    import signal
    import socket
    import traceback
    import warnings

    sock = socket.socket(fileno=fd)
    children: set[int] = set()

    def reap(block: bool) -> None:
        for pid in list(children):
            done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
            if done:
                children.discard(pid)
                with contextlib.suppress(OSError):  # the test has gone: nobody to tell
                    sock.send(f"EXIT {pid} {os.waitstatus_to_exitcode(status)}".encode())

    try:
        while True:
            reap(block=False)
            if not select.select([sock], [], [], 0.02)[0]:
                continue
            msg, fds, _flags, _addr = socket.recv_fds(sock, 65536, 2)
            if not msg:
                return 0
            args = json.loads(msg)
            with warnings.catch_warnings():  # torch's idle native thread: fork is safe here
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                status = 1
                try:
                    os.setsid()
                    os.dup2(fds[0], 1)
                    os.dup2(fds[1], 2)
                    for extra in (*fds, sock.fileno()):
                        os.close(extra)
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    status = asyncio.run(main(args[0], args[1], args[2], int(args[3])))
                except BaseException:
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(status)
            for extra in fds:
                os.close(extra)
            children.add(pid)
            sock.send(f"PID {pid}".encode())
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        reap(block=True)


if __name__ == "__main__":
    if sys.argv[1] == "--fork-server":
        sys.exit(serve_forks(int(sys.argv[2])))
    url, run_id, mode, steps = sys.argv[1:5]
    sys.exit(asyncio.run(main(url, run_id, mode, int(steps))))

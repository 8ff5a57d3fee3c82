"""Shared drivers for the reliability tests: a scripted run with failures, borrows and
evictions, copying a log prefix (a crash at offset k), and the exactly-once check."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch

from rolloutlog.controller.backends.base import BackendError
from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.domain.invariants import find_violations
from rolloutlog.controller.prompt_ledger import build_ledger, cross_check
from rolloutlog.controller.rollout_controller import RolloutController, replay
from rolloutlog.controller.rollout_index import read_indexed
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.eventstore import MemoryEventStore, NewEvent

DATASET = 120  # for the crash-at-every-offset run
FINGERPRINT = "reliability-v1"
WEIGHTS = [("w", torch.zeros(1))]


class Prompts:
    """A synthetic dataset with a cheap deterministic reward."""

    fingerprint = FINGERPRINT
    num_prompts = DATASET

    def prompt_token_ids(self, index: int) -> list[int]:
        return [1 + index % 11, 2, 3]

    def reward(self, index: int, completion_token_ids: Sequence[int]) -> float:
        return float(completion_token_ids[-1] % 3 == 0)


def rollout_config(sampler: str = "in_order") -> RolloutConfig:
    """Small groups, a lookahead of 2 and a tight staleness bound: borrows and evictions."""
    return RolloutConfig(
        group_size=2,
        groups_per_step=3,
        sampler=sampler,  # type: ignore[arg-type]
        lookahead=2,
        staleness_bound=1,
        spare_pool_size=2,
        drop_policy="replace",
        attempts_per_sibling=2,
    )


def failures(request: Any, spec: Any) -> BackendError | bool:
    """Some groups fail for good (their prompts are dropped), some fail once and retry."""
    if request.group_id % 7 == 3:
        return BackendError(f"scripted fatal failure of group {request.group_id}", retryable=False)
    return request.group_id % 5 == 1 and spec.attempt == 1


def backend(version: int = 0) -> DeterministicBackend:
    """The test backend with the scripted failures and a little latency."""
    return DeterministicBackend(
        vocab_size=32, latency=0.0005, fail=failures, weight_version=version
    )


async def drive(ctl: RolloutController, steps: int, *, checkpoint_every: int = 1) -> None:
    """Train up to ``steps`` steps (or until the dataset runs out) with checkpoints."""
    # A fresh backend (as after a crash) serves the initial weights until synced.
    runtime = RolloutRuntime(ctl, backend(), Prompts(), GenerationConfig(max_tokens=4))
    await runtime.start()
    try:
        await runtime.sync_weights(WEIGHTS, ctl.state.weight_version)
        while ctl.state.train_step < steps:
            step = ctl.state.train_step
            await runtime.next_batch(step, timeout=30)
            await runtime.report_trained(step, step + 1)
            await runtime.publish_weights(WEIGHTS, step + 1)
            if (step + 1) % checkpoint_every == 0:
                await runtime.checkpoint(step + 1)
    finally:
        await runtime.close()


def store_config() -> StoreConfig:
    """A snapshot every 25 events and a 1 ms commit window: for starts and restores alike
    (a restore given no store config falls back to the default of 50,000 events)."""
    return StoreConfig(snapshot_interval=25, group_commit_window_ms=1)


def start(store: Any, run_id: str = "r", sampler: str = "in_order") -> RolloutController:
    """A new run with a checkpoint at train step 0, so every crash has one to return to."""
    ctl = RolloutController.start(
        store,
        run_id,
        rollout_config(sampler),
        dataset_fingerprint=FINGERPRINT,
        dataset_size=DATASET,
        store_config=store_config(),
    )
    ctl.checkpoint(0)
    return ctl


def copy_prefix(source: Any, run_id: str, k: int) -> MemoryEventStore:
    """A new store holding the first ``k`` events of ``run_id``: the log a crash at k left."""
    info = source.get_run(run_id)
    target = MemoryEventStore()
    target.create_run(
        run_id, config_fingerprint=info.config_fingerprint, config_json=info.config_json
    )
    rows = [
        NewEvent(
            r.type,
            r.schema_version,
            r.payload,
            r.recorded_at,
            (r.group_id, r.prompt_index, r.target_step, r.train_step, r.weight_version),
        )
        for r in read_indexed(source, run_id, 1, k)
    ]
    target.append(run_id, rows, expected_seq=1, epoch=1)
    # Payloads referenced by completions are needed to assemble batches after restore.
    for r in source.read(run_id, 1, k):
        if r.type == "SiblingCompleted":
            import json

            pid = json.loads(r.payload)["payload_id"]
            target.put_payload(run_id, pid, "sibling", source.get_payload(run_id, pid))
    return target


def newest_checkpoint(store: Any, run_id: str, k: int) -> int:
    """Offset of the newest CheckpointMarked at or before ``k``."""
    best = 0
    for r in store.read(run_id, 1, k):
        if r.type == "CheckpointMarked":
            best = r.seq
    if best == 0:
        raise AssertionError(f"no checkpoint at or before offset {k}")
    return best


def exactly_once(store: Any, run_id: str) -> dict[str, Any]:
    """The ledger check: nothing lost, nothing trained twice, invariants hold."""
    state = replay(store, run_id).state
    ledger = build_ledger(store, run_id)
    check = cross_check(ledger, state)
    return {
        "lost": check.lost,
        "trained_twice": check.trained_twice,
        "violations": [str(v) for v in find_violations(state)],
        "trained": check.prompts_trained,
        "dropped": check.prompts_dropped,
        "evicted": check.prompts_evicted,
        "live": check.prompts_live,
        "pulled": check.prompts_pulled,
        "dropped_reasons": dict(ledger.dropped),
        "evicted_reasons": dict(ledger.evicted),
    }


def run(coro: Any) -> Any:
    """asyncio.run, for sync tests."""
    return asyncio.run(coro)


# ---------------------------------------------------------------- live worker processes


KILL_WORKER = __import__("pathlib").Path(__file__).with_name("kill_worker.py")


class Worker:
    """A ``kill_worker.py`` process whose stdout and stderr are collected by reader threads.

    The process runs in its own session (so its whole process group can be killed), and
    every wait on it has a deadline: a worker that hangs fails the test with its output
    tails instead of blocking it.
    """

    def __init__(
        self, url: str, run_id: str, mode: str, steps: int, forks: ForkServer | None = None
    ) -> None:
        import subprocess
        import sys
        import threading

        self.mode = mode
        self.proc: subprocess.Popen[str] | ForkedProcess
        if forks is not None:  # forked from a process that has done the imports
            self.proc = forks.spawn(url, run_id, mode, steps)
        else:
            self.proc = subprocess.Popen(
                [sys.executable, str(KILL_WORKER), url, run_id, mode, str(steps)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        self.lines: list[str] = []
        self._err_lines: list[str] = []
        self._cond = threading.Condition()
        self._out = threading.Thread(target=self._pump_out, daemon=True)
        self._err = threading.Thread(target=self._pump_err, daemon=True)
        self._out.start()
        self._err.start()

    @property
    def stderr(self) -> str:
        """What the process wrote to stderr so far."""
        with self._cond:
            return "".join(self._err_lines)

    def _pump_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cond:
                self._err_lines.append(line)

    def describe(self) -> str:
        """Exit status and output tails, for assertion messages."""
        return (
            f"{self.mode} worker (rc={self.proc.poll()}): stdout tail {self.lines[-5:]}, "
            f"stderr tail {self.stderr[-2000:]!r}"
        )

    def wait_for(self, prefix: str, timeout: float = 180.0, count: int = 1) -> str:
        """Block until ``count`` lines starting with ``prefix`` were printed; return the last."""
        import time

        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                hits = [x for x in self.lines if x.startswith(prefix)]
                if len(hits) >= count:
                    return hits[count - 1]
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._out.is_alive()):
                    break
                self._cond.wait(min(left, 0.2))
        raise AssertionError(f"no {prefix!r} line within {timeout}s; {self.describe()}")

    def finish(self, timeout: float = 90.0) -> int:
        """Wait (at most ``timeout`` s) for the process to exit; return its status.

        A process still running then is killed and the test fails with its output.
        """
        import subprocess

        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill_group()
            self.proc.wait(timeout=30)
            self._join()
            raise AssertionError(
                f"worker still running after {timeout}s; {self.describe()}"
            ) from None
        self._join()
        return rc

    def _join(self) -> None:
        self._out.join(timeout=10)
        self._err.join(timeout=10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None and not self._out.is_alive() and not self._err.is_alive():
                pipe.close()

    def _kill_group(self) -> None:
        import contextlib
        import os
        import signal

        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if isinstance(self.proc, ForkedProcess) and self.proc.returncode is None:
            # Forked a moment ago, it may not lead its own group yet (setsid comes first).
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)

    def acks(self) -> list[int]:
        """Every offset the process reported durable."""
        return [int(x.split()[1]) for x in self.lines if x.startswith("ACK")]

    def kill(self) -> None:
        """SIGKILL the process and its whole group (test cleanup; idempotent)."""
        self._kill_group()
        self.finish(timeout=30)


class ForkedProcess:
    """A worker forked by a ``ForkServer``: the part of ``subprocess.Popen`` that ``Worker``
    uses (pid, stdout, stderr, poll, wait, returncode). Its exit status comes from the
    server, which reaps it."""

    def __init__(self, server: ForkServer, pid: int, stdout: Any, stderr: Any) -> None:
        self._server = server
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr

    @property
    def returncode(self) -> int | None:
        return self._server.exit_status(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        status = self._server.wait_exit(self.pid, 600.0 if timeout is None else timeout)
        if status is None:
            raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout or 600.0)
        return status


class ForkServer:
    """``kill_worker.py --fork-server``: one process that imports torch and rolloutlog once
    and forks a worker per ``spawn`` (each in its own session). A kill then costs a fork
    instead of an interpreter's start-up and imports; the worker code and the SIGKILL of a
    live process are the same. Use as a context manager: leaving it closes the socket, and
    the server SIGKILLs any worker still running and exits (waited for, with a deadline).
    """

    def __init__(self, start_timeout: float = 180.0) -> None:
        import socket
        import subprocess
        import sys
        import threading

        self.start_timeout = start_timeout
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, str(KILL_WORKER), "--fork-server", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        finally:
            theirs.close()
        self._cond = threading.Condition()
        self._pids: list[int] = []
        self._exits: dict[int, int] = {}
        self._closed = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                msg = self._sock.recv(256).decode()
            except OSError:
                msg = ""
            with self._cond:
                if not msg:
                    self._closed = True
                    self._cond.notify_all()
                    return
                kind, *rest = msg.split()
                if kind == "PID":
                    self._pids.append(int(rest[0]))
                else:
                    self._exits[int(rest[0])] = int(rest[1])
                self._cond.notify_all()

    def _stderr_tail(self) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return "(fork server running)"
        return f"fork server rc={self.proc.returncode}: {self.proc.stderr.read()[-2000:]!r}"

    def spawn(self, url: str, run_id: str, mode: str, steps: int) -> ForkedProcess:
        """Fork a worker running ``main(url, run_id, mode, steps)``; its pid once forked."""
        import json
        import os
        import socket
        import time

        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            request = json.dumps([url, run_id, mode, steps]).encode()
            socket.send_fds(self._sock, [request], [out_w, err_w])
        finally:
            os.close(out_w)
            os.close(err_w)
        # The first request waits for the server's imports.
        deadline = time.monotonic() + self.start_timeout
        with self._cond:
            while not self._pids:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    os.close(out_r)
                    os.close(err_r)
                    raise AssertionError(
                        f"the fork server forked no worker within {self.start_timeout}s; "
                        f"{self._stderr_tail()}"
                    )
                self._cond.wait(min(left, 0.2))
            pid = self._pids.pop(0)
        return ForkedProcess(self, pid, os.fdopen(out_r), os.fdopen(err_r))

    def exit_status(self, pid: int) -> int | None:
        with self._cond:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float) -> int | None:
        """The worker's exit status once the server reaped it; None after ``timeout`` s."""
        import time

        deadline = time.monotonic() + timeout
        with self._cond:
            while pid not in self._exits:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return self._exits.get(pid)
                self._cond.wait(min(left, 0.2))
            return self._exits[pid]

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the socket; the server kills what is left and exits (SIGKILL after 30 s)."""
        import contextlib
        import os
        import signal
        import socket
        import subprocess

        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._reader.join(timeout=10)
        self._sock.close()
        if self.proc.stderr is not None:
            self.proc.stderr.close()

"""``rolloutlog demo``: a small GRPO run with a real crash and a resume.

1. A worker process trains the tiny torch policy on the toy task, checkpointing the
   model together with the rollout offset every few steps.
2. Part-way through (between checkpoints, with generation in flight) the demo kills the
   worker with SIGKILL.
3. A new worker restores from the newest checkpoint offset and finishes the run.
4. The summary comes from the log alone: reward per step, what the restore reused,
   salvaged and re-ran, and an independent ledger check that no prompt was lost or
   trained twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rolloutlog.controller.domain.events import (
    CODEC,
    EngineJoined,
    EngineLost,
    EngineRefit,
    RolloutEvent,
    SiblingDispatched,
)
from rolloutlog.controller.domain.invariants import find_violations
from rolloutlog.controller.domain.trajectory import (
    TURN_EVENT_TYPES,
    ModelCallCompleted,
    ToolCallCompleted,
    ToolCallFailed,
    TrajectoryCompleted,
    TrajectoryResumed,
    TrajectoryStarted,
    TrajectoryTooStale,
)
from rolloutlog.controller.prompt_ledger import build_ledger, cross_check
from rolloutlog.controller.rollout_controller import replay
from rolloutlog.controller.rollout_index import read_indexed
from rolloutlog.eventstore import EventStore
from rolloutlog.eventstore.errors import RolloutlogError

from .run_config import RunConfig

_ERROR_LINE = re.compile(r"\b[A-Z]\w*(?:Error|Exception): \S.*$")


class DemoError(RolloutlogError, RuntimeError):
    """The demo could not complete (a worker failed); the message says where."""


@dataclass
class WorkerOutcome:
    """What one worker process printed before it ended."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    killed: bool = False
    returncode: int | None = None
    #: The worker's pid, which is also its process group and session id.
    pid: int | None = None


def _root_cause(stderr: str) -> str | None:
    """The first ``SomethingError: message`` line of a worker's stderr (vLLM's engine
    processes log the real cause there and raise a generic error afterwards)."""
    for line in stderr.splitlines():
        m = _ERROR_LINE.search(line)
        if m and "See root cause above" not in line:
            return m.group(0).strip()
    return None


def _worker_argv(
    cfg: RunConfig, run_id: str, mode: str, hold_after: int | None = None
) -> list[str]:
    """The command line of one demo worker process (``hold_after``: see demo_worker)."""
    argv = [
        sys.executable,
        "-m",
        "rolloutlog.grpo.demo_worker",
        cfg.model_dump_json(),
        run_id,
        mode,
    ]
    return argv if hold_after is None else [*argv, str(hold_after)]


def _answer(proc: subprocess.Popen[str]) -> None:
    """Let a worker that holds after a step report go on (see demo_worker)."""
    assert proc.stdin is not None
    try:
        proc.stdin.write("\n")
        proc.stdin.flush()
    except (BrokenPipeError, OSError):  # it died meanwhile: the loop notices its exit
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process of the group ``pgid`` is left.

    Reads /proc where there is one (a zombie holds no memory, and in a container whose
    init does not reap, orphaned zombies never go away); elsewhere asks the kernel.
    """
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        # pid (comm) state ppid pgrp session ...: comm may contain spaces and parens.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


#: How long a worker that closed its output (or was killed) may take to exit: its
#: shutdown (engines, flushes) past it is a hang, not a slow exit.
_EXIT_GRACE_S = 120.0


def _kill_group(proc: subprocess.Popen[str], *, wait_s: float = 10.0) -> None:
    """SIGKILL every process of the worker's group and wait (bounded) until none is left.

    The worker's children (vLLM's EngineCore and its workers, 1.8 GB each) are in its
    process group: killing only the worker would leave them running as orphans.
    """
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return  # nothing of the group is left
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        proc.poll()  # reap the worker itself
        if not _group_alive(proc.pid):
            return
        time.sleep(0.05)  # killed processes vanish within moments; bounded by the deadline


def _run_worker(
    cfg: RunConfig,
    run_id: str,
    mode: str,
    *,
    kill_after_step: int | None,
    on_message: Callable[[dict[str, Any]], None],
    may_kill: Callable[[], bool] = lambda: True,
    kill_when: Callable[[], bool] | None = None,
) -> WorkerOutcome:
    """Run one worker; SIGKILL its process group after the first step report at or past
    ``kill_after_step`` for which ``may_kill()`` holds (None: let it finish). With
    ``kill_when``, from that step report on the demo also asks ``kill_when()`` every
    few milliseconds while the worker runs, and kills it as soon as it holds (a crash
    with generation in flight, not at a step boundary)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    # stderr goes to a file, not a pipe: a chatty worker (vLLM logs a lot) would fill a
    # pipe nobody reads until the end and block forever.
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as errfile:
        # Its own session and process group: the crash kills the worker and every
        # process it started (the vLLM engine's), and nothing of it outlives the demo.
        proc = subprocess.Popen(
            _worker_argv(cfg, run_id, mode, kill_after_step),
            # Past kill_after_step the worker waits for a line after each step report:
            # it cannot run past the crash while this process is slow to read.
            stdin=subprocess.PIPE if kill_after_step is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=errfile,
            text=True,
            env=env,
            start_new_session=True,
        )
        out = WorkerOutcome(pid=proc.pid)
        assert proc.stdout is not None
        stdout = proc.stdout
        # A reader thread, so the loop below notices the worker's exit even while a
        # process it started still holds its stdout open (no EOF until that one dies).
        lines: queue.Queue[str | None] = queue.Queue()

        def read_lines() -> None:
            for raw in stdout:
                lines.put(raw)
            lines.put(None)

        reader = threading.Thread(target=read_lines, name="demo-worker-stdout", daemon=True)
        reader.start()
        read_all = False
        armed = False
        hung = False
        try:
            while True:
                try:
                    line = lines.get(timeout=0.02 if armed else 0.5)
                except queue.Empty:
                    if armed and kill_when is not None and kill_when():
                        _kill_group(proc)  # a real crash, mid-step
                        out.killed = True
                        break
                    if proc.poll() is not None:
                        _kill_group(proc)  # its leftovers hold the pipe: end them
                    continue
                if line is None:
                    read_all = True
                    break
                line = line.strip()
                if not line.startswith("{"):
                    continue
                msg = json.loads(line)
                out.messages.append(msg)
                on_message(msg)
                if (
                    kill_after_step is not None
                    and msg.get("event") == "step"
                    and msg["step"] >= kill_after_step
                ):
                    if may_kill():
                        # A real crash: no cleanup, no flush, generation still in flight.
                        _kill_group(proc)
                        out.killed = True
                        break
                    armed = kill_when is not None
                    _answer(proc)  # not yet: the worker goes on to its next step
        finally:
            if not read_all:
                # Stopped reading early (a crash, an error, ^C): nothing of the worker
                # may outlive this function.
                _kill_group(proc)
            try:
                proc.wait(timeout=_EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                # It closed its output but does not exit (a shutdown that hangs): end it
                # and what it started; a worker killed here never counts as a success.
                hung = True
                _kill_group(proc)
                proc.wait(timeout=_EXIT_GRACE_S)
            if proc.stdin is not None:
                with contextlib.suppress(OSError):  # a dead reader's pipe may not flush
                    proc.stdin.close()
            # A worker that exited on its own may still leave engine processes behind.
            _kill_group(proc, wait_s=5.0)
            reader.join(timeout=10)
            if not reader.is_alive():
                stdout.close()
        out.returncode = proc.returncode
        if hung and not out.killed:
            raise DemoError(
                f"the {mode} worker closed its output but did not exit within "
                f"{_EXIT_GRACE_S} s; it was killed"
            )
        if not out.killed and proc.returncode != 0:
            errfile.seek(0)
            err = errfile.read()
            last = next((m for m in reversed(out.messages) if m.get("event") == "error"), None)
            tail = err.strip().splitlines()[-1:] or ["(no output)"]
            detail = last["error"] if last else tail[0]
            cause = _root_cause(err)
            if cause and cause not in detail:
                detail += f" (root cause: {cause})"
            raise DemoError(f"the {mode} worker failed (exit {proc.returncode}): {detail}")
    return out


def _launch_engines(cfg: RunConfig) -> tuple[RunConfig, Any]:
    """Start ``cfg.fleet.engines`` local vLLM servers on the run's model (built first when
    it is the tiny demo model); returns the config pointing at them and the launcher."""
    import socket

    from rolloutlog.controller.engines.config import LaunchConfig
    from rolloutlog.controller.engines.local import LocalEngineLauncher
    from rolloutlog.grpo.workload import prepare_model_dir

    model_dir = prepare_model_dir(cfg.model)
    count = cfg.fleet.engines
    for _ in range(50):  # a base port with count free ports after it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + count < 65536 and all(_port_free(base + i) for i in range(count)):
            break
    else:
        raise DemoError(f"found no {count} consecutive free ports for the engines")
    launcher = LocalEngineLauncher(
        LaunchConfig(
            count=count,
            model_dir=str(model_dir),
            max_model_len=cfg.model.max_model_len,
            port_base=base,
            seed=cfg.seed,
            # /load reports the requests in flight: the demo kills an engine that has some.
            extra_args=["--enable-server-load-tracking"],
        ),
        # Tied to this process: a demo killed (SIGKILL, an interrupted test) leaves no
        # engine behind, as `rolloutlog run`'s launched fleet.
        tethered=True,
    )
    launcher.start(wait=True)  # stops what it started when an engine fails to start
    urls = [e.url for e in launcher.engines]
    fleet = cfg.fleet.model_copy(update={"urls": urls})
    return cfg.model_copy(update={"fleet": fleet}), launcher


def _server_load(url: str) -> int:
    """Requests in flight on a vLLM server (``/load``; needs --enable-server-load-tracking)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/load", timeout=1.0) as resp:
            return int(json.loads(resp.read())["server_load"])
    except (OSError, ValueError, KeyError):
        return 0


def _kill_and_restart(
    launcher: Any, notify: Callable[[dict[str, Any]], None], killed: threading.Event
) -> None:
    """SIGKILL the last engine's process group once it has requests in flight (within a
    bounded wait), then restart it on the same port and wait until it is ready."""
    victim = launcher.engines[-1]
    deadline = time.monotonic() + 60.0
    while _server_load(victim.url) == 0 and time.monotonic() < deadline:
        time.sleep(0.005)  # polling a local endpoint; bounded by the deadline
    launcher.kill(victim.engine_id, signal.SIGKILL)
    killed.set()
    notify({"event": "engine_killed", "engine": victim.engine_id})
    launcher.restart(victim.engine_id)


def _engine_loss_recorded(url: str, run_id: str) -> bool:
    """Whether the run's log holds an EngineLost event yet (a read-only look)."""
    from rolloutlog.controller.rollout_index import read_where

    try:
        with EventStore.open(url, readonly=True) as store:
            return bool(read_where(store, run_id, event_type="EngineLost"))
    except Exception:  # not created yet, or busy: ask again at the next step
        return False


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def kill_step(steps: int, checkpoint_every: int) -> int:
    """The step after which the demo kills the worker: past a checkpoint, before the next."""
    target = max(checkpoint_every + 1, (steps * 3) // 5)
    if target % checkpoint_every == checkpoint_every - 1:
        target -= 1  # not the step right before a checkpoint: leave work to recover
    return min(target, steps - 2)


def engine_summary(log: list[tuple[bool, RolloutEvent]]) -> dict[str, int]:
    """Engine membership of a run's whole log, for the demo's summary.

    ``log``: every event of the run, oldest first, each with whether it lies in the
    current history (``False``: in a range a restore abandoned). Engine membership is
    what the fleet saw, and a restore does not undo a dead engine: an engine lost after
    the last checkpoint still counts, and ``engine_losses_abandoned`` says how many of
    the losses lie in an abandoned range (the resumed worker found the engine restarted).

    ``siblings_redispatched_after_engine_loss``: attempts in flight on a lost engine
    whose sibling was dispatched again (a new attempt). The new attempt may precede the
    EngineLost event: a killed engine's requests fail (connections reset) before the
    health probes declare it dead.
    """
    lost: set[tuple[int, int, int]] = set()  # group, sibling, attempt
    losses = abandoned = 0
    for in_history, ev in log:
        if isinstance(ev, EngineLost):
            losses += 1
            abandoned += not in_history
            for rid in ev.in_flight:
                g, s, a = (int(part[1:]) for part in rid.split("-"))
                lost.add((g, s, a))
    newest: dict[tuple[int, int], int] = {}
    for _in_history, ev in log:
        if isinstance(ev, SiblingDispatched):
            key = (ev.group_id, ev.sibling)
            newest[key] = max(newest.get(key, 0), ev.attempt)
    redispatched = sum(1 for g, s, a in lost if newest.get((g, s), 0) > a)
    return {
        "engines": len({ev.engine_id for _h, ev in log if isinstance(ev, EngineJoined)}),
        "engines_lost": losses,
        "engine_losses_abandoned": abandoned,
        "engines_refit": sum(1 for _h, ev in log if isinstance(ev, EngineRefit)),
        "siblings_redispatched_after_engine_loss": redispatched,
    }


class OpenTrajectoryWatch:
    """Reads a run's log as it grows (read-only, incrementally): whether it holds a
    trajectory with a durable model call and no end yet, i.e. a crash now lands
    mid-conversation."""

    def __init__(self, url: str, run_id: str) -> None:
        self.url = url
        self.run_id = run_id
        self._store: EventStore | None = None
        self._seq = 0
        self._turns: set[tuple[int, int]] = set()
        self._done: set[tuple[int, int]] = set()

    def __call__(self) -> bool:
        try:
            if self._store is None:
                self._store = EventStore.open(self.url, readonly=True)
            for row in self._store.read(self.run_id, self._seq + 1):
                self._seq = row.seq
                if row.type == "ModelCallCompleted":
                    ev = CODEC.decode(row)
                    self._turns.add((ev.group_id, ev.sibling))  # type: ignore[attr-defined]
                elif row.type == "TrajectoryCompleted":
                    ev = CODEC.decode(row)
                    self._done.add((ev.group_id, ev.sibling))  # type: ignore[attr-defined]
        except Exception:  # not created yet, or busy: ask again
            return False
        return bool(self._turns - self._done)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


def multi_turn_summary(
    store: EventStore, run_id: str, ledger_entries: list[tuple[str, str]]
) -> dict[str, int]:
    """What the crash and the restore did to the run's conversations, from the whole log
    (every epoch, abandoned ranges included) and the calculator's own ledger of
    executions (``key<TAB>result`` per run of the tool).

    - ``trajectories_lost``: trajectories with a durable model call that never completed
      and whose prompt is neither live at the end, nor dropped or evicted (recorded);
    - ``model_calls_regenerated_after_restore``: model calls recorded again for a turn
      that already had one (same group, sibling, prompt and turn), except those made
      again because the staleness policy abandoned the turn (``TrajectoryTooStale``);
    - ``tool_calls_executed_twice``: idempotency keys the tool ran more than once (its
      ledger), or with more than one result in the log;
    - ``turns_salvaged``: recorded model calls a restore reused (``TrajectoryResumed``);
    - ``tool_calls_status_checked``: open tool calls a restore resolved by the tool's
      status check instead of a run.
    """
    state = replay(store, run_id).state
    ledger = build_ledger(store, run_id)
    prompt_of: dict[tuple[int, int], tuple[int, int]] = {}
    calls: dict[tuple[int, int, int, int, int], int] = {}
    abandoned: dict[tuple[int, int, int, int, int], int] = {}
    results: dict[str, int] = {}
    started: set[tuple[int, int, int, int]] = set()
    with_turns: set[tuple[int, int, int, int]] = set()
    completed: set[tuple[int, int, int, int]] = set()
    salvaged = status_checked = 0
    for row in store.read(run_id):
        if row.type not in TURN_EVENT_TYPES:
            continue
        ev = CODEC.decode(row)
        key = (ev.group_id, ev.sibling)  # type: ignore[attr-defined]
        if isinstance(ev, TrajectoryStarted):
            prompt_of[key] = (ev.data_pass, ev.prompt_index)
            started.add((*key, *prompt_of[key]))
            continue
        prompt = prompt_of.get(key)
        if prompt is None:
            continue
        traj = (*key, *prompt)
        if isinstance(ev, ModelCallCompleted):
            turn = (*traj, ev.turn)
            calls[turn] = calls.get(turn, 0) + 1
            with_turns.add(traj)
        elif isinstance(ev, ToolCallCompleted | ToolCallFailed):
            results[ev.idempotency_key] = results.get(ev.idempotency_key, 0) + 1
            if isinstance(ev, ToolCallCompleted) and ev.source == "status_check":
                status_checked += 1
        elif isinstance(ev, TrajectoryCompleted):
            completed.add(traj)
        elif isinstance(ev, TrajectoryResumed):
            salvaged += ev.model_calls_reused
        elif isinstance(ev, TrajectoryTooStale):
            for t in range(ev.turns_kept, ev.turns_kept + ev.turns_abandoned):
                abandoned[(*traj, t)] = abandoned.get((*traj, t), 0) + 1
    live = {(g.data_pass, g.prompt_index) for g in state.groups.values()}
    settled = live | ledger.dropped_keys | ledger.evicted_keys
    lost = [t for t in with_turns - completed if (t[2], t[3]) not in settled]
    runs: dict[str, int] = {}
    for key, _result in ledger_entries:
        runs[key] = runs.get(key, 0) + 1
    twice = {k for k, n in runs.items() if n > 1} | {k for k, n in results.items() if n > 1}
    return {
        "trajectories": len(started),
        "trajectories_lost": len(lost),
        "model_calls": sum(calls.values()),
        "model_calls_regenerated_after_restore": sum(
            max(0, n - 1 - abandoned.get(k, 0)) for k, n in calls.items()
        ),
        "tool_calls_executed": len(ledger_entries),
        "tool_calls_executed_twice": len(twice),
        "tool_calls_status_checked": status_checked,
        "turns_salvaged": salvaged,
    }


def _whole_log(store: EventStore, run_id: str) -> list[tuple[bool, RolloutEvent]]:
    """Every event of the run (abandoned ranges included), each with whether it lies in
    the current history."""
    segments = store.history_segments(run_id)
    return [
        (any(first <= row.seq <= last for first, last in segments), CODEC.decode(row))
        for row in read_indexed(store, run_id)
    ]


def run_demo(
    cfg: RunConfig,
    *,
    run_id: str | None = None,
    on_message: Callable[[str, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the demo end to end and return its summary (see module docstring)."""
    if cfg.steps < cfg.checkpoint_every + 3:
        raise DemoError(
            f"the demo needs at least checkpoint_every + 3 = {cfg.checkpoint_every + 3} steps "
            f"to crash after a checkpoint and resume; got {cfg.steps}"
        )
    rid = run_id or cfg.run_id or f"demo-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"
    notify = on_message or (lambda _phase, _msg: None)
    started = time.perf_counter()
    kill_at = kill_step(cfg.steps, cfg.checkpoint_every)
    launcher = None
    restarts: list[threading.Thread] = []
    engine_killed = threading.Event()
    if cfg.backend == "vllm-fleet" and not cfg.fleet.urls:
        cfg, launcher = _launch_engines(cfg)
    try:

        def first_message(msg: dict[str, Any]) -> None:
            notify("first", msg)
            if (
                launcher is not None
                and msg.get("event") == "step"
                and msg["step"] == cfg.fleet.kill_engine_at_step
            ):
                # A real engine crash with generation in flight, then a restart on the
                # same port (in a thread: the run goes on with the other engines).
                thread = threading.Thread(
                    target=_kill_and_restart,
                    args=(launcher, lambda m: notify("first", m), engine_killed),
                    name="demo-engine-kill",
                )
                thread.start()
                restarts.append(thread)

        def may_kill_worker() -> bool:
            if watch is not None:
                # Mid-conversation: a trajectory has durable turns and no end yet.
                return watch()
            # With an engine kill planned, the worker crash waits until the worker has
            # recorded that engine's loss: killed first, it never would, and the resumed
            # worker would find the engine restarted.
            if launcher is None or cfg.fleet.kill_engine_at_step is None:
                return True
            return engine_killed.is_set() and _engine_loss_recorded(cfg.store.url, rid)

        watch = None if cfg.multi_turn is None else OpenTrajectoryWatch(cfg.store.url, rid)
        try:
            first = _run_worker(
                cfg,
                rid,
                "fresh",
                kill_after_step=kill_at,
                on_message=first_message,
                may_kill=may_kill_worker,
                kill_when=watch,
            )
        finally:
            if watch is not None:
                watch.close()
        if not first.killed:
            raise DemoError("the first worker finished before the planned crash")
        for thread in restarts:  # the resumed worker finds every engine up
            thread.join(timeout=launcher.config.ready_timeout_s if launcher else 0)
        second = _run_worker(
            cfg, rid, "resume", kill_after_step=None, on_message=lambda m: notify("resume", m)
        )
    finally:
        if launcher is not None:
            for thread in restarts:
                thread.join(timeout=launcher.config.ready_timeout_s)
            launcher.stop()
    restored = next((m for m in second.messages if m.get("event") == "restored"), {})
    worker_pids = [w.pid for w in (first, second)]
    store = EventStore.open(cfg.store.url)
    try:
        state = replay(store, rid).state
        ledger = build_ledger(store, rid)
        check = cross_check(ledger, state)
        violations = [str(v) for v in find_violations(state)]
        last_seq = store.last_seq(rid)
        engines = engine_summary(_whole_log(store, rid))
        multi = None
        if cfg.multi_turn is not None:
            from .loop import tool_ledger_path
            from .multiturn_task import CalculatorLedger

            entries = CalculatorLedger(tool_ledger_path(cfg, rid)).entries()
            multi = multi_turn_summary(store, rid, entries)
    finally:
        store.close()
    steps = sorted(ledger.step_rewards)
    rewards = [ledger.step_rewards[s] for s in steps]
    k = min(3, len(rewards))
    return {
        "run_id": rid,
        "db": cfg.store.url,
        "backend": cfg.backend,
        "steps_trained": len(steps),
        "steps_planned": cfg.steps,
        "reward_first": sum(rewards[:k]) / k if k else 0.0,
        "reward_last": sum(rewards[-k:]) / k if k else 0.0,
        "rewards": rewards,
        # The last step the first worker reported (a multi-turn crash may come later than
        # the planned step: it waits for a conversation in flight).
        "killed_after_step": max(
            (m["step"] for m in first.messages if m.get("event") == "step"), default=kill_at
        ),
        "restored_from_offset": restored.get("from_offset"),
        "recovery": {
            key: restored.get(key)
            for key in (
                "complete_groups_restored",
                "unfinished_groups_found",
                "siblings_reused",
                "siblings_rerun",
                "siblings_salvaged",
                "groups_evicted_stale",
            )
        },
        "prompts_pulled": check.prompts_pulled,
        "prompts_trained": check.prompts_trained,
        "prompts_dropped": check.prompts_dropped,
        "prompts_evicted": check.prompts_evicted,
        "prompts_live_at_end": check.prompts_live,
        "prompts_lost": check.prompts_lost,
        "prompts_trained_twice": check.prompts_trained_twice,
        **engines,
        "invariant_violations": violations,
        "log_events": last_seq,
        "seconds": round(time.perf_counter() - started, 1),
        "worker_pids": worker_pids,
        **({} if multi is None else {"task": "multi-turn", **multi}),
    }

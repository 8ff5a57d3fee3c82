"""The TensorBoard sink (issue 15.4): per-step scalars written during the run, one value
per step of the history after a SIGKILL and a restore (the abandoned branch's steps are
purged the TensorBoard way, steps already written are not written again), and the
same per-step dict for any other tracker."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
from test_prometheus_counters import RUN, Worker

from rolloutlog.controller.metrics import ProjectionFollower, project_history
from rolloutlog.controller.metrics.steps import (
    OFFSET_TAG,
    TENSORBOARD_MISSING,
    StepPublisher,
    TensorBoardSink,
    TensorBoardUnavailableError,
    event_scalars,
    is_purge,
    read_events,
    read_scalars,
    step_scalars,
)
from rolloutlog.eventstore import EventStore
from rolloutlog.grpo.run_config import RunConfig


def test_tensorboard_reads_what_the_sink_writes_with_a_purge(tmp_path: Path) -> None:
    """The sink writes with tensorboardX; TensorBoard's own reader shows the scalars, and
    the purge marker drops the steps written before it from its step on."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    env_before = dict(os.environ)
    sink = TensorBoardSink(tmp_path)
    for step in range(4):
        sink.write_step(step, {"rollout/reward_mean": step / 4, OFFSET_TAG: 10.0 + step}, 1e9)
    sink.purge(2)
    sink.write_step(2, {"rollout/reward_mean": 0.9, OFFSET_TAG: 20.0}, 1e9)
    sink.close()
    assert dict(os.environ) == env_before  # importing tensorboardX changed nothing
    acc = accumulator.EventAccumulator(str(tmp_path), purge_orphaned_data=True)
    acc.Reload()
    shown = [(e.step, e.value) for e in acc.Scalars("rollout/reward_mean")]
    assert shown == [(0, 0.0), (1, 0.25), (2, pytest.approx(0.9))]
    assert read_scalars(tmp_path) == {
        0: {"rollout/reward_mean": 0.0, OFFSET_TAG: 10.0},
        1: {"rollout/reward_mean": 0.25, OFFSET_TAG: 11.0},
        2: {"rollout/reward_mean": pytest.approx(0.9), OFFSET_TAG: 20.0},
    }
    # A torn tail (a crash mid-write) ends the file; what came before is read: here the
    # purge marker stands, the step written after it is lost.
    (path,) = tmp_path.glob("events.out.tfevents.*")
    path.write_bytes(path.read_bytes()[:-3])
    assert sorted(read_scalars(tmp_path)) == [0, 1]


def test_without_tensorboardx_the_sink_says_which_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [m for m in sys.modules if m == "tensorboardX" or m.startswith("tensorboardX.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails
    with pytest.raises(TensorBoardUnavailableError) as err:
        TensorBoardSink(tmp_path)
    assert str(err.value) == TENSORBOARD_MISSING
    assert "rolloutlog[tensorboard]" in TENSORBOARD_MISSING and "\n" not in TENSORBOARD_MISSING


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunConfig, Path]:
    """A worker writing TensorBoard files, killed 3 steps past a checkpoint, resumed."""
    tmp = tmp_path_factory.mktemp("tensorboard")
    cfg = RunConfig.model_validate(
        {
            "steps": 18,
            "checkpoint_every": 5,
            "checkpoint_dir": str(tmp / "checkpoints"),
            "backend": "deterministic",
            "model": {"dir": str(tmp / "model"), "build": "tiny"},
            "store": {"url": f"sqlite:///{tmp / 'log.db'}"},
            "telemetry": {"tensorboard_dir": str(tmp / "tb")},
            "task": {"num_prompts": 1000},
        }
    )
    first = Worker(cfg, "fresh", tmp)
    try:
        msg = first.next()
        while msg.get("step", -1) != 7:  # steps 5, 6, 7 after the checkpoint at 5
            msg = first.next()
        os.killpg(first.proc.pid, 9)
        first.proc.wait(timeout=30)
    finally:
        first.close()
    second = Worker(cfg, "resume", tmp)
    try:
        while second.next()["event"] != "done":
            pass
        assert second.proc.wait(timeout=60) == 0
    finally:
        second.close()
    return cfg, tmp / "tb" / RUN


@pytest.mark.slow
def test_one_value_per_step_of_the_history_after_a_restore(
    killed_run: tuple[RunConfig, Path],
) -> None:
    cfg, board = killed_run
    store = EventStore.open(cfg.store.url)
    try:
        history = project_history(store, RUN).values()["steps"]
    finally:
        store.close()
    assert [r["step"] for r in history] == list(range(cfg.steps))
    shown = read_scalars(board)
    assert sorted(shown) == list(range(cfg.steps))
    for row in history:
        got = shown[row["step"]]
        assert got[OFFSET_TAG] == pytest.approx(row["offset"])
        assert got["rollout/reward_mean"] == pytest.approx(row["reward_mean"], rel=1e-6)
        assert got["rollout/epoch"] == row["epoch"]
    assert {shown[s]["rollout/epoch"] for s in range(5)} == {1.0}
    assert {shown[s]["rollout/epoch"] for s in range(5, cfg.steps)} == {2.0}

    # Two files, one per process. The first holds the abandoned steps 5..7 (at least);
    # the second starts with TensorBoard's purge marker at step 5 and writes steps 5..
    # only: steps already written are not written again.
    first, second = sorted(board.glob("events.out.tfevents.*"))
    first_steps = list(read_events(first))
    assert {e.step for e in first_steps if event_scalars(e)} >= set(range(8))
    events = list(read_events(second))
    purges = [e.step for e in events if is_purge(e)]
    written = [e.step for e in events if event_scalars(e)]
    assert purges == [5]
    assert written == list(range(5, cfg.steps))


@pytest.mark.slow
def test_a_taken_exporter_port_is_one_line_and_tensorboard_keeps_writing(
    tmp_path: Path,
) -> None:
    """Issue 31.9: the exporter's port is taken. The run goes on, the error is one line
    naming the address and the cause (no traceback), and TensorBoard still gets every
    step."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    cfg = RunConfig.model_validate(
        {
            "steps": 6,
            "checkpoint_every": 5,
            "checkpoint_dir": str(tmp_path / "checkpoints"),
            "backend": "deterministic",
            "model": {"dir": str(tmp_path / "model")},
            "store": {"url": f"sqlite:///{tmp_path / 'log.db'}"},
            "telemetry": {"enabled": True, "port": port, "tensorboard_dir": str(tmp_path / "tb")},
            "task": {"num_prompts": 100},
        }
    )
    worker = Worker(cfg, "fresh", tmp_path)
    try:
        while worker.next()["event"] != "done":
            pass
        assert worker.proc.wait(timeout=60) == 0
    finally:
        worker.close()
        holder.close()
    stderr = (tmp_path / "worker-fresh.err").read_text()
    assert "Traceback" not in stderr, stderr
    about_port = [line for line in stderr.splitlines() if str(port) in line]
    assert len(about_port) == 1, stderr
    assert f"the metrics exporter cannot listen on 127.0.0.1:{port}" in about_port[0]
    assert "keep writing" in about_port[0]
    acc = accumulator.EventAccumulator(str(tmp_path / "tb" / RUN), purge_orphaned_data=True)
    acc.Reload()
    assert [e.step for e in acc.Scalars("rollout/epoch")] == list(range(cfg.steps))


class RecordingSink:
    """A tracker hook (what a W&B or trackio sink would see)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.steps: dict[int, Mapping[str, float]] = {}

    def write_step(self, step: int, scalars: Mapping[str, float], wall_time: float) -> None:
        assert wall_time > 1e9
        self.log.append(("write", step))
        self.steps[step] = dict(scalars)

    def purge(self, from_step: int) -> None:
        self.log.append(("purge", from_step))
        self.steps = {s: v for s, v in self.steps.items() if s < from_step}

    def close(self) -> None:
        self.log.append(("close", -1))


@pytest.mark.slow
def test_a_tracker_hook_sees_each_step_once_and_one_purge(
    killed_run: tuple[RunConfig, Path],
) -> None:
    """Following the stored run event by event (as a live listener would), the hook gets
    the steps as they are trained, one purge at the restore, and ends equal to the
    history's per-step dict."""
    cfg, _board = killed_run
    store = EventStore.open(cfg.store.url)
    try:
        follower = ProjectionFollower()
        sink = RecordingSink()
        publisher = StepPublisher(sink)
        for seq in range(1, store.last_seq(RUN) + 25, 25):
            follower.sync(store, RUN, to_seq=seq)
            publisher.publish(follower.projection)
        final = follower.projection
    finally:
        store.close()
    purges = [s for kind, s in sink.log if kind == "purge"]
    assert purges == [5]
    assert sink.steps == {row.step: step_scalars(row) for row in final.steps}
    assert sorted(sink.steps) == list(range(cfg.steps))


@pytest.mark.slow
def test_tensorboard_itself_reads_the_files(killed_run: tuple[RunConfig, Path]) -> None:
    """TensorBoard's own reader (when installed) shows one value per step, the
    abandoned branch's steps purged by the SessionLog.START marker."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    cfg, board = killed_run
    acc = accumulator.EventAccumulator(str(board), purge_orphaned_data=True)
    acc.Reload()
    epochs = [(e.step, e.value) for e in acc.Scalars("rollout/epoch")]
    assert [s for s, _ in epochs] == list(range(cfg.steps))
    assert [v for _, v in epochs] == [1.0] * 5 + [2.0] * (cfg.steps - 5)

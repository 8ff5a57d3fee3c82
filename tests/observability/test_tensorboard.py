"""The TensorBoard sink (issue 15.4): per-step scalars written during the run, one value
per step of the history after a SIGKILL and a restore (the abandoned branch's steps are
purged the TensorBoard way, steps already written are not written again), and the
same per-step dict for any other tracker."""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from pathlib import Path

import pytest
from test_prometheus_counters import RUN, Worker

from rolloutlog.controller.metrics import ProjectionFollower, project_history
from rolloutlog.controller.metrics.steps import (
    OFFSET_TAG,
    StepPublisher,
    crc32c,
    decode_event,
    encode_event,
    frame,
    read_records,
    read_scalars,
    step_scalars,
)
from rolloutlog.eventstore import EventStore
from rolloutlog.grpo.run_config import RunConfig


def test_the_event_file_format() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    record = encode_event(12.5, 7, scalars={"rollout/reward_mean": 0.25, "a/b": 3.0})
    assert decode_event(record) == (12.5, 7, {"rollout/reward_mean": 0.25, "a/b": 3.0}, False)
    purge = encode_event(1.0, 4, session_start=True)
    assert decode_event(purge)[1:] == (4, {}, True)
    framed = frame(record)
    (length,) = struct.unpack("<Q", framed[:8])
    assert length == len(record) and len(framed) == len(record) + 16


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
    first_steps = [decode_event(r) for r in read_records(first)]
    assert {e[1] for e in first_steps if e[2]} >= set(range(8))
    events = [decode_event(r) for r in read_records(second)]
    purges = [e[1] for e in events if e[3]]
    written = [e[1] for e in events if e[2]]
    assert purges == [5]
    assert written == list(range(5, cfg.steps))


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

"""Work that must not stop the event loop: payload reads after a restore, and snapshots
of a large state (encoded a slice per command, finished on the snapshot thread)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from test_runtime_rules import WEIGHTS, _Prompts, _start, _train

from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.domain import AdmitStep, DispatchSiblings, Phase
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.controller.snapshot_encoder import decode_snapshot, encode_snapshot
from rolloutlog.eventstore import EventStore


def test_a_restored_runtime_reads_its_batch_payloads_on_a_worker_thread(sqlite_url: str) -> None:
    store = EventStore.open(sqlite_url)
    ctl = _start(store)
    asyncio.run(_train(ctl, 2))
    offset = ctl.checkpoint(2)
    ctl.close()
    restored, _report = RolloutController.restore(store, "r", offset, rollout=ctl.state.rules)
    threads: list[threading.Thread] = []
    read = store.get_payload

    def recording_get_payload(run_id: str, payload_id: str) -> bytes:
        threads.append(threading.current_thread())
        return read(run_id, payload_id)

    store.get_payload = recording_get_payload  # type: ignore[method-assign]

    async def resume() -> None:
        runtime = RolloutRuntime(
            restored,
            DeterministicBackend(vocab_size=16),
            _Prompts(),
            GenerationConfig(max_tokens=3),
        )
        await runtime.start()
        try:
            await runtime.sync_weights(WEIGHTS, restored.state.weight_version)
            for step in range(restored.state.train_step, 4):
                await runtime.next_batch(step)
                await runtime.report_trained(step, step + 1)
                await runtime.publish_weights(WEIGHTS, step + 1)
        finally:
            await runtime.close()

    try:
        asyncio.run(resume())
    finally:
        restored.close()
        store.close()
    assert restored.state.train_step == 4
    assert threads, "the restored runtime read the payloads it had not generated itself"
    assert threading.main_thread() not in threads  # asyncio.run's loop is the main thread


def test_a_due_snapshot_is_cut_only_after_every_touched_group_is_encoded(sqlite_url: str) -> None:
    """With a tiny slice, the command that makes a snapshot due does not encode the whole
    state: later commands finish it, and what is written is exactly the state at the cut."""
    store = EventStore.open(sqlite_url)
    ctl = RolloutController.start(
        store, "snap", RolloutConfig(group_size=4, groups_per_step=64, lookahead=4),
        dataset_fingerprint="d", dataset_size=2_000,
        store_config=StoreConfig(snapshot_interval=200, snapshot_slice_ms=0.001),
    )  # fmt: skip
    cut_at: list[Any] = []
    encoder = ctl._snapshot_encoder
    original_cut = encoder.cut

    def recording_cut(state: Any) -> Any:
        finish = original_cut(state)
        cut_at.append((state.last_seq, encode_snapshot(state)))
        return finish

    encoder.cut = recording_cut  # type: ignore[method-assign]
    start_seq = ctl.state.last_seq
    due_seq: int | None = None

    def run(command: Any) -> None:
        nonlocal due_seq
        ctl.execute(command)
        if due_seq is None and ctl.state.last_seq - start_seq >= 200:
            due_seq = ctl.state.last_seq  # the first command after which one is due

    try:
        while len(ctl.state.groups) < 256:
            run(AdmitStep())
        for g in [g for g in ctl.state.groups.values() if g.phase is Phase.ADMITTED]:
            run(DispatchSiblings(g.group_id, (0, 1, 2, 3), ctl.state.published_version))
        ctl.flush()
        ctl.close()
        assert cut_at and due_seq is not None, "a snapshot fell due and was cut"
        seq, expected = cut_at[0]
        # The command that made it due did not encode every group: later ones finished it.
        assert seq > due_seq
        snap = store.load_snapshot("snap", at_or_before=seq)
        assert snap is not None and snap.seq == seq
        assert snap.data == expected  # the bytes of a full encoding of the state at the cut
        assert decode_snapshot(snap.data).last_seq == seq
    finally:
        store.close()


def test_a_failing_snapshot_encoding_never_stops_the_run_and_the_next_one_is_whole(
    sqlite_url: str,
) -> None:
    """Faults in both halves of the incremental encoding: on the caller's thread (the
    encoder starts over from a clean slate) and on the snapshot thread (the write is
    skipped). The run goes on, the failures are counted, and a later snapshot restores
    to exactly the live state."""
    from rolloutlog.controller import snapshot_encoder
    from rolloutlog.controller.rollout_controller import replay

    store = EventStore.open(sqlite_url)
    ctl = _start(store, snapshot_interval=20)
    faults = {"refresh": 1, "finish": 1}
    real_refresh = snapshot_encoder.SnapshotEncoder.refresh
    real_cut = snapshot_encoder.SnapshotEncoder.cut

    def refresh(self: Any, state: Any, slice_s: float | None = None) -> bool:
        if faults["refresh"]:
            faults["refresh"] -= 1
            raise RuntimeError("injected encoding fault")
        return real_refresh(self, state, slice_s)

    def cut(self: Any, state: Any) -> Any:
        finish = real_cut(self, state)
        if not faults["finish"]:
            return finish

        def failing() -> bytes:
            faults["finish"] -= 1
            raise RuntimeError("injected compression fault")

        return failing

    snapshot_encoder.SnapshotEncoder.refresh = refresh  # type: ignore[method-assign]
    snapshot_encoder.SnapshotEncoder.cut = cut  # type: ignore[method-assign]
    try:
        asyncio.run(_train(ctl, 6))
        ctl.close()
    finally:
        snapshot_encoder.SnapshotEncoder.refresh = real_refresh  # type: ignore[method-assign]
        snapshot_encoder.SnapshotEncoder.cut = real_cut  # type: ignore[method-assign]
    try:
        assert faults == {"refresh": 0, "finish": 0}
        assert ctl.snapshot_failures == 2
        assert ctl.snapshots_written >= 1
        assert ctl.state.train_step == 6
        fast = replay(store, "r", use_snapshots=True)
        assert fast.snapshot_offset is not None
        assert fast.state.to_snapshot() == ctl.state.to_snapshot()
    finally:
        store.close()

"""Multi-turn rollouts on the runtime: turns recorded, loss mask and versions, resume."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from mt_task import RUN, TOKENIZER, Ledger, operands, runtime, start

from rolloutlog.controller.domain.events import CODEC
from rolloutlog.controller.domain.trajectory import (
    TURN_EVENT_TYPES,
    TrajectoryCompleted,
    fold_trajectories,
)
from rolloutlog.eventstore import EventStore, decode_arrays

WEIGHTS = [("w", torch.zeros(1))]


def _turn_events(store: Any) -> list[tuple[int, Any]]:
    return [(r.epoch, CODEC.decode(r)) for r in store.read(RUN) if r.type in TURN_EVENT_TYPES]


async def _train(ctl: Any, ledger: Ledger, steps: int, books: list[Any] | None = None) -> list[Any]:
    rt, multi, _ = runtime(ctl, ledger)
    batches = []
    await rt.start()
    try:
        for step in range(ctl.state.train_step, steps):
            batch = await rt.next_batch(step, timeout=60)
            batches.append(batch)
            if books is not None:
                books.append(multi.sample_masks(batch))  # before report_trained
            await rt.report_trained(step, step + 1)
            await rt.publish_weights(WEIGHTS, step + 1)
    finally:
        await rt.close()
    if books is not None:
        books.append(multi.book)
    return batches


def test_a_trajectory_records_every_turn_and_trains_with_its_mask(
    db_url: str, tmp_path: Path
) -> None:
    store = EventStore.open(db_url)
    ctl = start(store)
    ledger = Ledger(tmp_path / "ledger.tsv")
    books: list[Any] = []
    batches = asyncio.run(_train(ctl, ledger, 2, books))
    ctl.close()
    samples = [s for b in batches for s in b.samples]
    assert len(samples) == 8
    masks = [m for step_masks in books[:-1] for m in step_masks]
    assert len(masks) == len(samples)
    for s, (mask, versions) in zip(samples, masks, strict=True):
        text = TOKENIZER.decode(s.completion_token_ids)
        model = "".join(c for c, m in zip(text, mask, strict=True) if m)
        assert model == text.replace("calc:", "").replace(
            f"</tool>{sum(operands(s.prompt_index))}", "</tool>"
        ).replace("received", "")
        assert all((v >= 0) == bool(m) for v, m in zip(versions, mask, strict=True))
    for s in samples:
        a, b = operands(s.prompt_index)
        text = TOKENIZER.decode(s.completion_token_ids)
        # The whole response, model and tool tokens, in context order.
        assert text == (
            f'calc:<tool>add {{"a":{a},"b":{b}}}</tool>{a + b}'
            f'<tool>submit {{"answer":{a + b}}}</tool>receivedok.'
        )
        assert s.reward == 1.0  # the environment's get_reward
    events = _turn_events(store)
    kinds = [type(e).__name__ for _, e in events]
    # The lookahead's trajectories were cut by the close: started, not completed.
    assert kinds.count("TrajectoryStarted") >= kinds.count("TrajectoryCompleted") >= 8
    assert "LateResultRefused" not in kinds and "TrajectoryResumed" not in kinds
    # Each tool ran once per request, and only after its request was in the log.
    keys = [k for k, _ in ledger.entries()]
    requested = [e.idempotency_key for _, e in events if type(e).__name__ == "ToolCallRequested"]
    assert len(keys) == len(set(keys)) and set(keys) <= set(requested)
    done = {(e.group_id, e.sibling) for _, e in events if isinstance(e, TrajectoryCompleted)}
    model = [e for _, e in events if type(e).__name__ == "ModelCallCompleted"]
    assert sum((e.group_id, e.sibling) in done for e in model) == 3 * len(done)
    book = fold_trajectories(events)
    # The log read back (this dialect) folds to the live book (which forgets trained groups).
    assert books[-1] and {k: book[k] for k in books[-1]} == books[-1]
    for _, ev in events:
        if not isinstance(ev, TrajectoryCompleted):
            continue
        arrays = decode_arrays(store.get_payload(RUN, ev.payload_id))
        traj = book[(ev.group_id, ev.sibling)]
        mask = arrays["loss_mask"].tolist()
        assert mask == traj.loss_mask()
        text = TOKENIZER.decode(arrays["token_ids"].tolist())
        model_text = "".join(c for c, m in zip(text, mask, strict=True) if m)
        assert model_text.startswith("<tool>add") and model_text.endswith("ok.")
        assert "calc:" not in model_text and "received" not in model_text  # tool/env: 0
        versions = arrays["weight_versions"].tolist()
        assert all((v >= 0) == bool(m) for v, m in zip(versions, mask, strict=True))
        assert all(lp == 0.0 for lp, m in zip(arrays["logprobs"], mask, strict=True) if not m)
        assert ev.model_tokens == sum(mask) and ev.final_reward == 1.0
    store.close()


def test_an_aborted_trajectory_resumes_its_turns_under_a_new_attempt(
    sqlite_url: str, tmp_path: Path
) -> None:
    """The backend aborts every sibling's second model call once: the runtime re-dispatches
    it (attempt 2), which resumes after the durable turns: no model call regenerated, no
    tool run twice."""
    store = EventStore.open(sqlite_url)
    ctl = start(store)
    ledger = Ledger(tmp_path / "ledger.tsv")
    seen: set[tuple[int, int]] = set()

    async def main() -> None:
        rt, multi, inner = runtime(ctl, ledger)

        def latency(request: Any) -> float:
            (spec,) = request.siblings
            ctx = TOKENIZER.decode(request.prompt_token_ids)
            key = (request.group_id, spec.sibling)
            if "<tool>add" in ctx and "<tool>submit" not in ctx and key not in seen:
                seen.add(key)
                asyncio.get_running_loop().call_soon(
                    lambda: asyncio.ensure_future(inner.abort(request.group_id))
                )
                return 5.0
            return 0.0

        inner.latency = latency
        await rt.start()
        try:
            batch = await rt.next_batch(0, timeout=60)
            assert all(s.reward == 1.0 for s in batch.samples)
        finally:
            await rt.close()
        assert multi.stats.trajectories_resumed >= 2
        assert multi.stats.model_calls_reused >= multi.stats.trajectories_resumed

    asyncio.run(main())
    ctl.close()
    events = _turn_events(store)
    resumed = [e for _, e in events if type(e).__name__ == "TrajectoryResumed"]
    assert resumed and all(
        e.model_calls_reused == 1 and e.tool_results_reused == 1 for e in resumed
    )
    # No model call of a (sibling, turn) was generated twice.
    calls = [
        (e.group_id, e.sibling, e.turn)
        for _, e in events
        if type(e).__name__ == "ModelCallCompleted"
    ]
    assert len(calls) == len(set(calls))
    keys = [k for k, _ in ledger.entries()]
    assert len(keys) == len(set(keys))
    store.close()


def test_a_non_idempotent_tool_interrupted_mid_call_is_not_run_twice(
    sqlite_url: str, tmp_path: Path
) -> None:
    """The process dies while a tool with side effects and no status check runs: the
    takeover records the call as failed (``not_rerun``) instead of running it again."""
    from rolloutlog.controller.environments import Tool
    from rolloutlog.controller.rollout_controller import RolloutController

    runs: list[str] = []

    class Crash(BaseException):
        """Stands for the process dying inside the tool."""

    def add(a: int, b: int) -> str:
        runs.append(f"{a}+{b}")
        if len(runs) == 1:
            raise Crash  # the side effect happened; its result never reached the log
        return str(a + b)

    store = EventStore.open(sqlite_url)
    ctl = start(store)

    async def first() -> None:
        rt, multi, _ = runtime(ctl, Ledger(tmp_path / "unused"))
        multi.tools = (Tool("add", add),)
        await rt.start()
        try:
            with pytest.raises(Exception, match="pump"):
                await rt.next_batch(0, timeout=60)
        finally:
            await rt.close()

    asyncio.run(first())
    ctl.close()
    ctl = RolloutController.open(store, RUN)
    stats: dict[str, Any] = {}

    async def second() -> None:
        rt, multi, _ = runtime(ctl, Ledger(tmp_path / "unused"))
        multi.tools = (Tool("add", add),)
        await rt.start()
        try:
            batch = await rt.next_batch(0, timeout=60)
            stats["rewards"] = sorted(s.reward for s in batch.samples)
        finally:
            await rt.close()
        stats["not_rerun"] = multi.stats.tool_calls_not_rerun

    asyncio.run(second())
    ctl.close()
    events = [e for _, e in _turn_events(store)]
    failed = [e for e in events if type(e).__name__ == "ToolCallFailed"]
    assert [f.outcome for f in failed] == ["not_rerun"] and stats["not_rerun"] == 1
    first_key = failed[0].idempotency_key
    assert "not run a second time" in failed[0].reason
    # The interrupted call ran once; every other call ran once too.
    requested = [
        e.idempotency_key
        for e in events
        if type(e).__name__ == "ToolCallRequested" and e.tool == "add"
    ]
    assert len(runs) == len(requested) == len(set(requested)) and first_key in requested
    # The trajectory went on with the failure fed back: it could not submit the sum.
    assert stats["rewards"][0] == 0.0 and stats["rewards"][-1] == 1.0
    store.close()


def test_a_late_tool_result_is_refused_and_recorded(sqlite_url: str, tmp_path: Path) -> None:
    """A tool result arriving after its attempt was superseded is refused (recorded as
    ``LateResultRefused``); the new attempt resolves the call by its status check."""
    from rolloutlog.controller.domain import commands
    from rolloutlog.controller.environments import Tool

    ledger = Ledger(tmp_path / "ledger.tsv")
    store = EventStore.open(sqlite_url)
    ctl = start(store)
    aborted: list[tuple[int, int]] = []

    async def slow_add(a: int, b: int, idempotency_key: str) -> str:
        result = ledger.add(a, b, idempotency_key)
        if not aborted:
            gid, sib = (
                int(idempotency_key.split("/g")[1].split("/")[0]),
                int(idempotency_key.split("/s")[1].split("/")[0]),
            )
            attempt = ctl.state.groups[gid].sibling(sib).attempt
            ctl.execute(commands.AbortSibling(gid, sib, attempt, "superseded for the test"))
            aborted.append((gid, sib))
        return result

    async def main() -> Any:
        rt, multi, _ = runtime(ctl, ledger)
        multi.tools = (Tool("add", slow_add, status=ledger.status),)
        await rt.start()
        try:
            batch = await rt.next_batch(0, timeout=60)
            assert all(s.reward == 1.0 for s in batch.samples)
        finally:
            await rt.close()
        return multi.stats

    stats = asyncio.run(main())
    ctl.close()
    events = [e for _, e in _turn_events(store)]
    refused = [e for e in events if type(e).__name__ == "LateResultRefused"]
    assert len(refused) == 1 and refused[0].kind == "tool_call"
    assert (refused[0].group_id, refused[0].sibling) == aborted[0]
    assert refused[0].current_attempt == refused[0].attempt  # aborted: none newer yet
    assert stats.late_results_refused == 1 and stats.tool_calls_status_checked == 1
    checked = [e for e in events if type(e).__name__ == "ToolCallCompleted" and e.source != "call"]
    assert len(checked) == 1
    keys = [k for k, _ in ledger.entries()]
    assert len(keys) == len(set(keys))
    store.close()


def test_a_late_model_output_is_refused_and_recorded(sqlite_url: str, tmp_path: Path) -> None:
    """The sibling's attempt is aborted in the log while its model call runs (the engine
    is not told): the output that then arrives is refused, recorded, and regenerated by
    no one: the new attempt makes that turn's call itself, once."""
    from rolloutlog.controller.domain import commands

    store = EventStore.open(sqlite_url)
    ctl = start(store)
    hit: list[tuple[int, int, int]] = []

    async def main() -> Any:
        rt, multi, inner = runtime(ctl, Ledger(tmp_path / "ledger.tsv"))

        def latency(request: Any) -> float:
            (spec,) = request.siblings
            ctx = TOKENIZER.decode(request.prompt_token_ids)
            if not hit and "<tool>add" in ctx and "<tool>submit" not in ctx:
                hit.append((request.group_id, spec.sibling, spec.attempt))
                ctl.execute(
                    commands.AbortSibling(request.group_id, spec.sibling, spec.attempt, "test")
                )
                return 0.05
            return 0.0

        inner.latency = latency
        await rt.start()
        try:
            batch = await rt.next_batch(0, timeout=60)
            assert all(s.reward == 1.0 for s in batch.samples)
        finally:
            await rt.close()
        return multi.stats

    stats = asyncio.run(main())
    ctl.close()
    events = [e for _, e in _turn_events(store)]
    refused = [e for e in events if type(e).__name__ == "LateResultRefused"]
    assert [(e.group_id, e.sibling, e.attempt, e.kind, e.turn) for e in refused] == [
        (*hit[0], "model_call", 1)
    ]
    assert stats.late_results_refused == 1
    calls = [
        (e.group_id, e.sibling, e.turn) for e in events if type(e).__name__ == "ModelCallCompleted"
    ]
    assert len(calls) == len(set(calls)) and (hit[0][0], hit[0][1], 1) in calls
    store.close()


def test_a_generation_failure_mid_conversation_reruns_only_the_current_turn(
    sqlite_url: str, tmp_path: Path
) -> None:
    """An engine error on a sibling's second model call, with no retry within the
    attempt (``model_call_retries=0``), fails that attempt (retryable); the next attempt
    resumes after the durable turns and generates only that turn."""
    from rolloutlog.controller.backends.base import BackendError

    store = EventStore.open(sqlite_url)
    ctl = start(store)
    failed: set[tuple[int, int]] = set()

    def fail(request: Any, spec: Any) -> object:
        ctx = TOKENIZER.decode(request.prompt_token_ids)
        key = (request.group_id, spec.sibling)
        if "<tool>add" in ctx and "<tool>submit" not in ctx and key not in failed:
            failed.add(key)
            return BackendError("engine lost mid-conversation", retryable=True)
        return None

    async def main() -> Any:
        rt, multi, inner = runtime(
            ctl, Ledger(tmp_path / "ledger.tsv"), multi_turn={"model_call_retries": 0}
        )
        inner.fail = fail
        await rt.start()
        try:
            batch = await rt.next_batch(0, timeout=60)
            assert all(s.reward == 1.0 for s in batch.samples)
        finally:
            await rt.close()
        return multi.stats

    stats = asyncio.run(main())
    ctl.close()
    rows = list(store.read(RUN))
    assert sum(r.type == "SiblingFailed" for r in rows) >= 4  # the batch's 4 siblings at least
    events = [e for _, e in _turn_events(store)]
    resumed = [e for e in events if type(e).__name__ == "TrajectoryResumed"]
    assert len(resumed) >= 4 and all(e.model_calls_reused == 1 for e in resumed)
    calls = [
        (e.group_id, e.sibling, e.turn) for e in events if type(e).__name__ == "ModelCallCompleted"
    ]
    assert len(calls) == len(set(calls))  # turn 0 never generated again
    assert stats.model_calls_reused >= 4 and stats.tool_results_reused >= 4
    store.close()


def test_an_engine_lost_mid_call_resends_only_that_call_within_the_attempt(
    sqlite_url: str, tmp_path: Path
) -> None:
    """A retryable engine error on a model call sends that call again (same turn, same
    attempt), recorded on its ModelCallCompleted; past ``model_call_retries`` the attempt
    fails and the next one resumes after the durable turns."""
    from rolloutlog.controller.backends.base import BackendError

    store = EventStore.open(sqlite_url)
    ctl = start(store)
    fails: dict[tuple[int, int], int] = {}
    stubborn: list[tuple[int, int]] = []  # the first sibling to reach turn 1: fails 3 times

    def fail(request: Any, spec: Any) -> object:
        ctx = TOKENIZER.decode(request.prompt_token_ids)
        key = (request.group_id, spec.sibling)
        if "<tool>add" in ctx and "<tool>submit" not in ctx:
            if not stubborn:
                stubborn.append(key)
            if fails.get(key, 0) < (3 if key == stubborn[0] else 1):
                fails[key] = fails.get(key, 0) + 1
                return BackendError(f"engine lost mid-call ({fails[key]})", retryable=True)
        return None

    async def main() -> Any:
        rt, multi, inner = runtime(ctl, Ledger(tmp_path / "ledger.tsv"))
        inner.fail = fail
        await rt.start()
        try:
            batch = await rt.next_batch(0, timeout=60)
            assert all(s.reward == 1.0 for s in batch.samples)
        finally:
            await rt.close()
        return multi.stats

    stats = asyncio.run(main())
    ctl.close()
    failed_rows = [CODEC.decode(r) for r in store.read(RUN) if r.type == "SiblingFailed"]
    # Only the stubborn sibling's request failed (3 failures > model_call_retries = 2):
    # its group's attempts (a request fails whole; its sibling's finished trajectory is
    # taken over whole by the next attempt, nothing run again).
    assert stubborn[0] in {(e.group_id, e.sibling) for e in failed_rows}
    assert {e.group_id for e in failed_rows} == {stubborn[0][0]}
    events = [e for _, e in _turn_events(store)]
    resumed = {
        (e.group_id, e.sibling): e for e in events if type(e).__name__ == "TrajectoryResumed"
    }
    assert set(resumed) == {(e.group_id, e.sibling) for e in failed_rows}
    assert resumed[stubborn[0]].model_calls_reused == 1
    calls = [e for e in events if type(e).__name__ == "ModelCallCompleted"]
    assert len({(e.group_id, e.sibling, e.turn) for e in calls}) == len(calls)
    turn1 = {(e.group_id, e.sibling): e for e in calls if e.turn == 1}
    for key, n in fails.items():
        tries = turn1[key].failed_tries
        if key == stubborn[0]:  # a try and 2 retries failed; the next attempt's succeeded
            assert n == 3 and tries == ()
        else:
            assert len(tries) == n == 1 and "engine lost mid-call (1)" in tries[0]
    assert stats.model_calls_retried == sum(fails.values()) - 1  # the bound's failure
    store.close()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_tool_that_hangs_past_its_deadline_is_recorded_failed_not_run_again(
    sqlite_url: str, tmp_path: Path, kind: str
) -> None:
    """``tool_timeout_s``: a tool call that does not answer in time is recorded as
    ToolCallFailed (outcome ``timeout``), its reason fed back; the trajectory goes on and
    the call is never run again. A hung synchronous tool's thread is abandoned, not joined."""
    import threading
    import time

    from rolloutlog.controller.environments import Tool

    runs: list[str] = []
    release = threading.Event()

    def add(a: int, b: int) -> str:
        runs.append(f"{a}+{b}")
        if len(runs) == 1:
            release.wait(60)  # hangs until the test ends
        return str(a + b)

    async def add_async(a: int, b: int) -> str:
        runs.append(f"{a}+{b}")
        if len(runs) == 1:
            await asyncio.sleep(60)  # cancelled at the deadline
        return str(a + b)

    store = EventStore.open(sqlite_url)
    ctl = start(store)

    async def main() -> Any:
        rt, multi, _ = runtime(ctl, Ledger(tmp_path / "unused"), multi_turn={"tool_timeout_s": 0.5})
        multi.tools = (Tool("add", add if kind == "sync" else add_async),)
        await rt.start()
        try:
            batch = await rt.next_batch(0, timeout=60)
        finally:
            await rt.close()
        return multi.stats, sorted(s.reward for s in batch.samples)

    try:
        stats, rewards = asyncio.run(main())
    finally:
        release.set()
    ctl.close()
    events = [e for _, e in _turn_events(store)]
    failed = [e for e in events if type(e).__name__ == "ToolCallFailed"]
    assert [e.outcome for e in failed] == ["timeout"] and stats.tool_calls_timed_out == 1
    assert "did not answer within 0.5 s" in failed[0].reason
    requested = [e.idempotency_key for e in events if type(e).__name__ == "ToolCallRequested"]
    adds = [k for k in requested if k.endswith("/t0/c0")]
    assert len(runs) == len(adds) == len(set(adds))  # each add call ran once
    # The failure entered the context: that trajectory submitted no correct sum.
    assert rewards[0] == 0.0 and rewards[-1] == 1.0
    deadline = time.monotonic() + 30
    while any(t.name == "rolloutlog-tool-add" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the hung tool's thread did not end"
        time.sleep(0.05)
    store.close()


def test_a_status_check_that_hangs_past_the_deadline_is_a_recorded_refusal(
    sqlite_url: str, tmp_path: Path
) -> None:
    """The process dies inside a tool with a status check; on the takeover the status
    check hangs: past ``tool_timeout_s`` the call is recorded as failed (``timeout``),
    not run again (it may have run)."""
    import threading

    from rolloutlog.controller.environments import Tool
    from rolloutlog.controller.rollout_controller import RolloutController

    runs: list[str] = []
    release = threading.Event()

    class Crash(BaseException):
        """Stands for the process dying inside the tool."""

    def add(a: int, b: int, idempotency_key: str) -> str:
        runs.append(idempotency_key)
        if len(runs) == 1:
            raise Crash
        return str(a + b)

    def status(idempotency_key: str) -> str | None:
        release.wait(60)  # hangs until the test ends
        return None

    store = EventStore.open(sqlite_url)
    ctl = start(store)

    async def first() -> None:
        rt, multi, _ = runtime(ctl, Ledger(tmp_path / "unused"))
        multi.tools = (Tool("add", add, status=status),)
        await rt.start()
        try:
            with pytest.raises(Exception, match="pump"):
                await rt.next_batch(0, timeout=60)
        finally:
            await rt.close()

    asyncio.run(first())
    ctl.close()
    ctl = RolloutController.open(store, RUN)

    async def second() -> Any:
        rt, multi, _ = runtime(ctl, Ledger(tmp_path / "unused"), multi_turn={"tool_timeout_s": 0.5})
        multi.tools = (Tool("add", add, status=status),)
        await rt.start()
        try:
            await rt.next_batch(0, timeout=60)
        finally:
            await rt.close()
        return multi.stats

    try:
        stats = asyncio.run(second())
    finally:
        release.set()
    ctl.close()
    events = [e for _, e in _turn_events(store)]
    failed = [e for e in events if type(e).__name__ == "ToolCallFailed"]
    assert [e.outcome for e in failed] == ["timeout"] and stats.tool_calls_timed_out == 1
    assert "status check" in failed[0].reason and failed[0].idempotency_key == runs[0]
    requested = [e.idempotency_key for e in events if type(e).__name__ == "ToolCallRequested"]
    adds = [k for k in requested if k.endswith("/t0/c0")]
    assert sorted(runs) == sorted(adds)  # each add call ran once, the interrupted one too
    store.close()


def test_attach_reads_only_the_trajectories_a_dispatch_can_reach(
    db_url: str, tmp_path: Path
) -> None:
    """A restore folds the live groups' trajectories and those of ids an abandoned branch
    admitted (admitted again later: what ran there ran), every epoch, through the rollout
    index; trained groups' trajectories are not read."""
    from mt_task import ROLLOUT, Prompts

    from rolloutlog.controller.rollout_controller import RolloutController

    store = EventStore.open(db_url)
    ctl = start(store)
    ledger = Ledger(tmp_path / "ledger.tsv")

    async def drive() -> int:
        rt, _, _ = runtime(ctl, ledger)
        await rt.start()
        checkpoint = 0
        try:
            for step in range(3):
                await rt.next_batch(step, timeout=60)
                await rt.report_trained(step, step + 1)
                await rt.publish_weights(WEIGHTS, step + 1)
                if step == 0:
                    checkpoint = ctl.checkpoint(step + 1)
        finally:
            await rt.close()
        return checkpoint

    checkpoint = asyncio.run(drive())
    ctl.close()
    full = fold_trajectories(_turn_events(store))
    restored, _ = RolloutController.restore(
        store, RUN, checkpoint, rollout=ROLLOUT, dataset_fingerprint=Prompts.fingerprint
    )
    _, multi, _ = runtime(restored, ledger)
    state = restored.state
    reachable = {k for k in full if k[0] in state.groups or k[0] >= state.next_group_id}
    assert multi.book == {k: full[k] for k in reachable}
    assert len(full) > len(reachable)  # trained groups' trajectories were not read
    # The abandoned branch's trajectories (ids not admitted again yet) are in the book.
    assert any(gid >= state.next_group_id for gid, _ in multi.book)
    restored.close()
    store.close()

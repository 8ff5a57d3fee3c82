"""verl's tools through :class:`VerlToolsEnvironment`: classes with the method shapes of
``verl.tools.base_tool.BaseTool`` (verl is not installed here), unchanged, on the
runtime. A process dying inside a tool with side effects is followed by a takeover
that asks the tool's status check instead of running it again; the idempotent tool's
calls are replayed (awaited) to rebuild its instance; every instance is released."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from mt_task import RUN, TOKENIZER, VOCAB, Ledger, Prompts, reset_kwargs, script, start

from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.domain.events import CODEC
from rolloutlog.controller.domain.trajectory import (
    TURN_EVENT_TYPES,
    ToolCallCompleted,
    ToolCallRequested,
    TrajectoryCompleted,
    TrajectoryResumed,
)
from rolloutlog.controller.environments import (
    EnvironmentSession,
    ToolCall,
    VerlToolsEnvironment,
    parse_hermes_tool_calls,
)
from rolloutlog.controller.multiturn import MultiTurnConfig, MultiTurnPrompts, TrajectoryBackend
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.eventstore import EventStore


@dataclass
class ToolResponse:
    """verl's ``verl.tools.schemas.ToolResponse`` (text, image, video)."""

    text: str | None = None
    image: Any = None
    video: Any = None


class Crash(BaseException):
    """Stands for the process dying inside the tool."""


class AddTool:
    """A verl tool with side effects (the calculator ledger), written as verl's BaseTool:
    ``create`` returns ``(instance_id, ToolResponse)`` (newer verl)."""

    def __init__(self, ledger: Ledger, crash_once: bool = False) -> None:
        self.name = "add"
        self.ledger = ledger
        self.crash_once = crash_once
        self._instance_dict: dict[str, dict[str, Any]] = {}
        self.created: list[dict[str, Any]] = []
        self.released: list[str] = []

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> Any:
        instance_id = instance_id or str(uuid4())
        self._instance_dict[instance_id] = {"kwargs": kwargs}
        self.created.append(kwargs)
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        assert instance_id in self._instance_dict
        result = self.ledger.add(parameters["a"], parameters["b"], kwargs["idempotency_key"])
        if self.crash_once:
            self.crash_once = False
            raise Crash  # the side effect happened; its result never reached the log
        return ToolResponse(text=result), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        raise AssertionError("not called")

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instance_dict.pop(instance_id)
        self.released.append(instance_id)


class SubmitTool:
    """An idempotent verl tool keeping its answer per instance; ``create`` returns the
    instance id and ``execute`` a plain text (older verl)."""

    def __init__(self) -> None:
        self.name = "submit"
        self._instance_dict: dict[str, dict[str, Any]] = {}
        self.executed = 0
        self.released: list[str] = []

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        instance_id = instance_id or str(uuid4())
        self._instance_dict[instance_id] = {"answer": None}
        return instance_id

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[str, float, dict[str, Any]]:
        self.executed += 1
        self._instance_dict[instance_id]["answer"] = int(parameters["answer"])
        return "received", 0.0, {}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instance_dict.pop(instance_id)
        self.released.append(instance_id)


def test_verl_tools_are_an_environments_methods() -> None:
    add, submit = AddTool(Ledger(Path("/nonexistent/unused"))), SubmitTool()
    env = VerlToolsEnvironment([add, submit], idempotent=["submit"], status={"add": str})
    session = EnvironmentSession(env)
    assert sorted(session.tools) == ["add", "submit"]
    assert session.tools["submit"].idempotent and session.tools["submit"].status is None
    assert not session.tools["add"].idempotent and session.tools["add"].status is str

    async def main() -> None:
        assert await session.reset(tools_kwargs={"submit": {"create_kwargs": {"x": 1}}}) is None
        assert await session.reward() is None  # calc_reward is async: the run's reward scores
        assert await session.tools["submit"]({"answer": 3}, "k0") == "received"
        assert await session.tools["submit"]({"answer": 4}, "k1") == "received"
        (instance,) = submit._instance_dict
        assert submit._instance_dict[instance] == {"answer": 4}  # one instance per trajectory
        await session.close()
        assert submit.released == [instance] and not submit._instance_dict
        await session.close()  # nothing left to release

    asyncio.run(main())
    with pytest.raises(ValueError, match="no verl tool named"):
        VerlToolsEnvironment([submit], idempotent=["search"])
    with pytest.raises(ValueError, match="same name"):
        VerlToolsEnvironment([submit, SubmitTool()])
    reset_tool = SubmitTool()
    reset_tool.name = "reset"
    with pytest.raises(ValueError, match="cannot be named 'reset'"):
        VerlToolsEnvironment([reset_tool])


def _runtime(
    ctl: RolloutController, add: AddTool, submit: SubmitTool
) -> tuple[RolloutRuntime, TrajectoryBackend, DeterministicBackend]:
    inner = DeterministicBackend(vocab_size=VOCAB, max_model_len=512, script=script)
    multi = TrajectoryBackend(
        inner,
        TOKENIZER,
        environment_factory=lambda: VerlToolsEnvironment(
            [add, submit], idempotent=["submit"], status={"add": add.ledger.status}
        ),
        # verl's per-row tools_kwargs, from the dataset's extra_info.
        reset_kwargs=lambda i: {"tools_kwargs": {"add": {"create_kwargs": reset_kwargs(i)}}},
        config=MultiTurnConfig(max_turns=6, max_tokens_per_turn=40),
    )
    multi.attach(ctl)
    rt = RolloutRuntime(
        ctl,
        multi,
        MultiTurnPrompts(Prompts(), multi),
        GenerationConfig(max_tokens=120, max_in_flight_siblings=8),
    )
    return rt, multi, inner


def test_verl_tools_resume_after_a_crash_inside_a_tool(sqlite_url: str, tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.tsv")
    add, submit = AddTool(ledger, crash_once=True), SubmitTool()
    store = EventStore.open(sqlite_url)
    ctl = start(store)

    async def first() -> None:
        rt, _, _ = _runtime(ctl, add, submit)
        await rt.start()
        try:
            with pytest.raises(Exception, match="pump"):
                await rt.next_batch(0, timeout=60)
        finally:
            await rt.close()

    asyncio.run(first())
    ctl.close()
    ctl = RolloutController.open(store, RUN)  # a takeover: the new attempts resume
    stats: dict[str, Any] = {}

    aborted: set[tuple[int, int]] = set()

    async def second() -> None:
        rt, multi, inner = _runtime(ctl, add, submit)

        def latency(request: Any) -> float:
            """Abort each sibling's last model call once (after its submit): its retry
            resumes and rebuilds the submit tool's instance by replaying the call."""
            (spec,) = request.siblings
            key = (request.group_id, spec.sibling)
            if "<tool>submit" in TOKENIZER.decode(request.prompt_token_ids) and key not in aborted:
                aborted.add(key)
                asyncio.get_running_loop().call_soon(
                    lambda: asyncio.ensure_future(inner.abort(request.group_id))
                )
                return 5.0
            return 0.0

        inner.latency = latency
        await rt.start()
        try:
            batch = await rt.next_batch(0, timeout=60)
            stats["texts"] = [TOKENIZER.decode(s.completion_token_ids) for s in batch.samples]
        finally:
            await rt.close()
        stats["status_checked"] = multi.stats.tool_calls_status_checked

    asyncio.run(second())
    ctl.close()
    events = [CODEC.decode(r) for r in store.read(RUN) if r.type in TURN_EVENT_TYPES]
    store.close()
    # The interrupted call is answered by the status check: the ledger, not a second run.
    keys = [k for k, _ in ledger.entries()]
    assert keys and len(keys) == len(set(keys))
    checked = [e for e in events if isinstance(e, ToolCallCompleted) and e.source == "status_check"]
    assert len(checked) == 1 and stats["status_checked"] >= 1
    for text in stats["texts"]:  # the tools' texts entered the context (ToolResponse.text)
        assert "</tool>receivedok." in text and "calc:" not in text
    assert any(isinstance(e, TrajectoryResumed) for e in events)
    # The idempotent tool's recorded calls were replayed (awaited: it is async) to
    # rebuild the resumed trajectories' instances.
    submits = sum(1 for e in events if isinstance(e, ToolCallRequested) and e.tool == "submit")
    assert aborted and submit.executed > submits
    done = [e for e in events if isinstance(e, TrajectoryCompleted)]
    assert len(done) >= 4 and all(e.final_reward is None for e in done)  # the run's reward
    # Every instance a trajectory created was released, the crashed attempts' included;
    # create received the row's create_kwargs.
    assert not add._instance_dict and not submit._instance_dict
    assert len(add.released) == len(add.created) > 0
    assert all(set(kw) == {"a", "b"} for kw in add.created)


def test_hermes_tool_calls_are_parsed() -> None:
    text = (
        'think <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        '<tool_call>{"name": "submit", "arguments": "{\\"answer\\": 3}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
    )
    assert parse_hermes_tool_calls(text) == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("submit", {"answer": 3}),
        ToolCall("<unparsed>", {"_raw": "{not json}"}),
        ToolCall("<unparsed>", {"_raw": "[1]"}),
    ]
    assert parse_hermes_tool_calls("no call") == []

"""Environments and tools: TRL's environment_factory shape, plain tools, the text
protocol of tool calls, and an environment that answers with steps (number guessing)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
from mt_task import RUN, TOKENIZER, VOCAB, Prompts, start

from rolloutlog.controller.backends.base import GroupRequest, SiblingSpec
from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.domain.events import CODEC
from rolloutlog.controller.domain.trajectory import TURN_EVENT_TYPES, TrajectoryCompleted
from rolloutlog.controller.environments import (
    EnvironmentSession,
    Tool,
    idempotent,
    parse_tool_calls,
)
from rolloutlog.controller.multiturn import MultiTurnConfig, MultiTurnPrompts, TrajectoryBackend
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.eventstore import EventStore, decode_arrays


class TrlEnv:
    """Written for TRL: reset, public methods as tools, get_reward."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def reset(self, **kwargs: Any) -> str:
        return f"hello {kwargs.get('name', '')}".strip()

    def lookup(self, word: str) -> str:
        """A tool."""
        self.calls.append(word)
        return word.upper()

    @idempotent
    def peek(self) -> str:
        return "same"

    def _private(self) -> None:  # not a tool
        raise AssertionError

    def get_reward(self) -> float:
        return float(len(self.calls))


def test_a_trl_environment_runs_unchanged() -> None:
    session = EnvironmentSession(TrlEnv(), [Tool("add", lambda a, b: a + b, idempotent=True)])
    assert sorted(session.tools) == ["add", "lookup", "peek"]
    assert asyncio.run(session.reset(name="x")) == "hello x"
    assert not session.tools["lookup"].idempotent and session.tools["peek"].idempotent
    assert session.tools["lookup"]({"word": "a"}, "k1") == "A"
    assert asyncio.run(session.reward()) == 1.0
    assert session.tools["add"]({"a": 1, "b": 2}, "k2") == 3
    assert not session.steps
    with pytest.raises(ValueError, match="defined twice"):
        EnvironmentSession(TrlEnv(), [Tool("lookup", str)])


def test_a_tool_with_a_status_check_gets_its_idempotency_key() -> None:
    seen: dict[str, str] = {}

    def charge(amount: int, idempotency_key: str) -> str:
        seen[idempotency_key] = f"charged {amount}"
        return seen[idempotency_key]

    tool = Tool("charge", charge, status=seen.get)
    assert tool({"amount": 3}, "run/g0/s0/t0/c0") == "charged 3"
    assert tool.status is not None and tool.status("run/g0/s0/t0/c0") == "charged 3"
    assert tool.status("other") is None

    class Env:
        def reset(self) -> None:
            return None

        def pay(self, amount: int, idempotency_key: str) -> str:
            seen[idempotency_key] = str(amount)
            return "ok"

        def tool_status(self, name: str, key: str) -> str | None:
            return seen.get(key)

    session = EnvironmentSession(Env())
    assert asyncio.run(session.reset()) is None
    pay = session.tools["pay"]
    assert pay({"amount": 5}, "k") == "ok" and pay.status is not None and pay.status("k") == "5"


def test_tool_calls_are_parsed_from_the_text_protocol() -> None:
    text = 'x <tool>add {"a": 1, "b": 2}</tool> y <tool>peek</tool><tool>bad {nope}</tool>'
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [
        ("add", {"a": 1, "b": 2}),
        ("peek", {}),
        ("bad", {"_raw": "{nope}"}),
    ]
    assert parse_tool_calls("no call here") == []


class GuessEnv:
    """Number guessing with higher/lower feedback: an environment that steps."""

    def reset(self, secret: int) -> str:
        self.secret, self.tries = secret, 0
        return "guess:"

    def step(self, text: str) -> tuple[str | None, float | None, bool]:
        self.tries += 1
        match = re.search(r"g(\d)", text)
        guess = int(match.group(1)) if match else -1
        if guess == self.secret:
            return "=", 1.0, True
        return ("+" if guess < self.secret else "-"), 0.0, False


def guesser(request: GroupRequest, spec: SiblingSpec) -> list[int]:
    """Binary search over the feedback in its context."""
    ctx = TOKENIZER.decode(request.prompt_token_ids)
    lo, hi = 0, 9
    for guess, sign in re.findall(r"g(\d)([+-])", ctx):
        if sign == "+":
            lo = int(guess) + 1
        else:
            hi = int(guess) - 1
    return TOKENIZER.encode(f"g{(lo + hi) // 2}")


def test_an_environment_that_steps_ends_the_trajectory_when_done(
    sqlite_url: str, tmp_path: Path
) -> None:
    store = EventStore.open(sqlite_url)
    ctl = start(store)
    inner = DeterministicBackend(vocab_size=VOCAB, max_model_len=512, script=guesser)
    multi = TrajectoryBackend(
        inner,
        TOKENIZER,
        environment_factory=GuessEnv,
        reset_kwargs=lambda index: {"secret": index % 10},
        config=MultiTurnConfig(max_turns=6, max_tokens_per_turn=4, max_context_tokens=64),
    )
    multi.attach(ctl)
    rt = RolloutRuntime(
        ctl, multi, MultiTurnPrompts(Prompts(), multi), GenerationConfig(max_tokens=60)
    )

    async def main() -> Any:
        await rt.start()
        try:
            return await rt.next_batch(0, timeout=60)
        finally:
            await rt.close()

    batch = asyncio.run(main())
    ctl.close()
    assert all(s.reward == 1.0 for s in batch.samples)
    for s in batch.samples:
        text = TOKENIZER.decode(s.completion_token_ids)
        assert text.startswith("guess:") and text.endswith("=")
        assert f"g{s.prompt_index % 10}=" in text
    rows = [CODEC.decode(r) for r in store.read(RUN) if r.type in TURN_EVENT_TYPES]
    steps = [e for e in rows if type(e).__name__ == "EnvironmentStepped"]
    assert steps and all(e.observation in "+-=" for e in steps)
    done = [e for e in rows if isinstance(e, TrajectoryCompleted)]
    assert done and all(e.finish == "done" for e in done)
    for ev in done:
        mask = decode_arrays(store.get_payload(RUN, ev.payload_id))["loss_mask"].tolist()
        assert ev.model_tokens == sum(mask) == 2 * ev.turns  # "gN" per turn, 1 token each
    store.close()


def test_without_an_environment_reward_the_runs_reward_scores_the_response(
    sqlite_url: str, tmp_path: Path
) -> None:
    from mt_task import Ledger, script

    class Scored(Prompts):
        def reward(self, index: int, completion_token_ids: Any) -> float:
            return float(len(completion_token_ids))

    store = EventStore.open(sqlite_url)
    ctl = start(store)
    inner = DeterministicBackend(vocab_size=VOCAB, max_model_len=512, script=script)
    multi = TrajectoryBackend(
        inner,
        TOKENIZER,
        tools=[Ledger(tmp_path / "ledger.tsv").tool()],  # plain tools, no environment
        config=MultiTurnConfig(max_turns=2, max_tokens_per_turn=40),
    )
    multi.attach(ctl)
    rt = RolloutRuntime(
        ctl, multi, MultiTurnPrompts(Scored(), multi), GenerationConfig(max_tokens=120)
    )

    async def main() -> Any:
        await rt.start()
        try:
            return await rt.next_batch(0, timeout=60)
        finally:
            await rt.close()

    batch = asyncio.run(main())
    ctl.close()
    for s in batch.samples:
        assert s.reward == float(len(s.completion_token_ids)) > 0
        # Two turns: add, then submit (an unknown tool here: its error is fed back).
        assert "error: unknown tool 'submit'" in TOKENIZER.decode(s.completion_token_ids)
    done = [CODEC.decode(r) for r in store.read(RUN) if r.type == "TrajectoryCompleted"]
    assert done and all(e.final_reward is None and e.finish == "max_turns" for e in done)
    store.close()


def test_the_deterministic_backend_scripts_outputs_within_the_contract() -> None:
    from rolloutlog.controller.backends.base import SamplingConfig, validate_results

    backend = DeterministicBackend(
        vocab_size=VOCAB, script=lambda req, spec: None if spec.sibling else [5, 6, 7, 8, 9]
    )

    async def main() -> Any:
        await backend.start()
        request = GroupRequest(
            1, (1, 2), (SiblingSpec(0, 1), SiblingSpec(1, 1)), SamplingConfig(max_tokens=3)
        )
        return request, await backend.generate(request)

    request, (scripted, drawn) = asyncio.run(main())
    assert scripted.token_ids == (5, 6, 7) and scripted.finish_reason == "length"
    assert len(scripted.logprobs) == 3 and all(lp < 0 for lp in scripted.logprobs)
    assert drawn.token_ids != (5, 6, 7)  # None: the seeded draw
    validate_results(request, [scripted, drawn], VOCAB)


@pytest.mark.parametrize("kind", ["hanging_sync_step", "hanging_async_step", "raising_reset"])
def test_an_environment_call_that_hangs_or_raises_fails_the_attempt_by_its_deadline(
    sqlite_url: str, kind: str
) -> None:
    """``environment_timeout_s``: the first environment call of the run hangs (a sync
    ``step`` blocks its thread, an async one sleeps) or raises (``reset``). The sibling
    attempt is recorded failed (retryable), the reason naming the call, its turn and the
    deadline; the next attempt resumes and the batch completes. A hung sync call's thread
    is abandoned at the deadline, not joined."""
    import threading
    import time

    release = threading.Event()
    first = [True]

    def trouble() -> bool:
        was, first[0] = first[0], False
        return was

    class Troubled(GuessEnv):
        def reset(self, secret: int) -> str:
            if kind == "raising_reset" and trouble():
                raise RuntimeError("the sandbox did not start")
            return super().reset(secret)

    class SyncHang(Troubled):
        def step(self, text: str) -> tuple[str | None, float | None, bool]:
            if trouble():
                release.wait(60)  # hangs until the test ends
            return super().step(text)

    class AsyncHang(Troubled):
        async def step(self, text: str) -> tuple[str | None, float | None, bool]:  # type: ignore[override]
            if trouble():
                await asyncio.sleep(60)  # cancelled at the deadline
            return GuessEnv.step(self, text)

    factory = {"hanging_sync_step": SyncHang, "hanging_async_step": AsyncHang}.get(kind, Troubled)
    store = EventStore.open(sqlite_url)
    ctl = start(store)
    inner = DeterministicBackend(vocab_size=VOCAB, max_model_len=512, script=guesser)
    multi = TrajectoryBackend(
        inner,
        TOKENIZER,
        environment_factory=factory,
        reset_kwargs=lambda index: {"secret": index % 10},
        config=MultiTurnConfig(
            max_turns=6, max_tokens_per_turn=4, max_context_tokens=64, environment_timeout_s=0.5
        ),
    )
    multi.attach(ctl)
    rt = RolloutRuntime(
        ctl, multi, MultiTurnPrompts(Prompts(), multi), GenerationConfig(max_tokens=60)
    )

    async def main() -> Any:
        await rt.start()
        try:
            return await rt.next_batch(0, timeout=60)
        finally:
            await rt.close()

    try:
        batch = asyncio.run(asyncio.wait_for(main(), timeout=120))
    finally:
        release.set()
    ctl.close()
    assert all(s.reward == 1.0 for s in batch.samples)
    failed = [CODEC.decode(r) for r in store.read(RUN) if r.type == "SiblingFailed"]
    assert failed and all(e.retryable for e in failed)
    if kind == "raising_reset":
        expected = "the environment's reset raised RuntimeError: the sandbox did not start"
        assert multi.stats.environment_calls_failed == 1
    else:
        expected = "the environment's step of turn 0 did not answer within 0.5 s"
        assert multi.stats.environment_calls_timed_out == 1
    assert all(expected in e.reason for e in failed), [e.reason for e in failed]
    store.close()
    deadline = time.monotonic() + 30
    while any(t.name.startswith("rolloutlog-environment") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the hung environment's thread did not end"
        time.sleep(0.05)

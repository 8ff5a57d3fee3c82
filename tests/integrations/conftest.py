"""Fixtures of the TRL integration tests: TRL's ``AsyncGRPOTrainer`` on CPU, offline.

TRL is a test dependency of these tests: without it they skip, except in CI (``CI``
set), where a missing TRL fails them.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rolloutlog.grpo.tiny_model import TinyModelSpec, build_tiny_model

IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


@pytest.fixture
def trl_installed() -> None:
    """Skip without TRL (fail in CI)."""
    if importlib.util.find_spec("trl") is None:
        if IN_CI:
            pytest.fail("TRL is required in CI but is not installed", pytrace=False)
        pytest.skip("TRL is not installed (pip install trl==1.16.0)")


class _HubRequested(AssertionError):
    pass


def _no_fa3_kernel() -> Any:
    raise _HubRequested("TRL asked the kernels hub for its FA3 kernel on a CPU test")


@pytest.fixture
def trl_on_cpu(monkeypatch: pytest.MonkeyPatch, trl_installed: None) -> Iterator[None]:
    """TRL's trainer made runnable on CPU for one test, offline, all undone afterwards.

    Applies :func:`trl_cpu.cpu_patches` with ``monkeypatch`` (the CPU tree attention
    under ``tree_fa3``, no FA3 re-registration, no CUDA peak-FLOPs probe), makes
    huggingface_hub offline, and makes TRL's FA3 kernel loader fail loudly if anything
    reaches it.
    """
    import huggingface_hub.constants as hub_constants
    from trl.experimental.async_grpo import packing

    from rolloutlog.integrations.trl import cpu as trl_cpu

    for target, name, value in trl_cpu.cpu_patches():
        if isinstance(target, dict):
            monkeypatch.setitem(target, name, value)
        else:
            monkeypatch.setattr(target, name, value)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(packing, "_flash_attn", _no_fa3_kernel)
    yield


@pytest.fixture(scope="session")
def trl_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama policy and its tokenizer, built locally once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("trl-models") / "tiny", TinyModelSpec())

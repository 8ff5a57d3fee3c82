"""Every field of every config model appears in docs/configuration.md with its default.

The expected rows are generated from the pydantic models, so a new field or a changed
default fails this test until the page is updated.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel

from rolloutlog.controller.config import RolloutConfig, StoreConfig, TelemetryConfig
from rolloutlog.controller.multiturn import MultiTurnConfig
from rolloutlog.controller.rollout_runtime import GenerationConfig
from rolloutlog.controller.workloads.dataset import DatasetConfig
from rolloutlog.controller.workloads.rewards import RewardConfig
from rolloutlog.grpo.run_config import FleetRunConfig, ModelConfig, MultiTurnRunConfig, RunConfig
from rolloutlog.grpo.toy_task import ToyTaskConfig
from rolloutlog.grpo.trainer import GRPOConfig

CONFIG_MD = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
MODELS: list[type[BaseModel]] = [
    RunConfig,
    RolloutConfig,
    StoreConfig,
    GenerationConfig,
    TelemetryConfig,
    ModelConfig,
    ToyTaskConfig,
    GRPOConfig,
    DatasetConfig,
    RewardConfig,
    FleetRunConfig,
    MultiTurnConfig,
    MultiTurnRunConfig,
]


def render(value: object) -> str:
    """How the page writes a default: YAML-ish scalars, JSON lists, ``null``."""
    if isinstance(value, bool) or value is None or isinstance(value, list | tuple):
        return json.dumps(list(value) if isinstance(value, tuple) else value)
    if isinstance(value, float) and 0 < value < 1e-3:
        return f"{value:g}"
    return str(value)


def section(model: type[BaseModel]) -> str:
    """The text under the heading that names ``model`` (up to the next ## heading)."""
    text = CONFIG_MD.read_text()
    marker = f"`{model.__name__}`"
    starts = [
        i
        for i in range(len(text))
        if text.startswith("## ", i) and marker in text[i : text.find("\n", i)]
    ]
    assert starts, f"docs/configuration.md has no '## ... {marker}' heading"
    start = starts[0]
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def row(model: type[BaseModel], field: str) -> str:
    for line in section(model).splitlines():
        if line.startswith(f"| `{field}` |"):
            return line
    raise AssertionError(f"{model.__name__}.{field} has no table row in docs/configuration.md")


@pytest.mark.parametrize(
    ("model", "field"),
    [(m, f) for m in MODELS for f in m.model_fields],
    ids=lambda x: x.__name__ if isinstance(x, type) else x,
)
def test_field_documented_with_default(model: type[BaseModel], field: str) -> None:
    line = row(model, field)
    if model.model_fields[field].is_required():
        assert "required" in line, f"{model.__name__}.{field} is required; the row must say so"
        return
    default = model.model_fields[field].get_default(call_default_factory=True)
    if isinstance(default, BaseModel):
        return  # a section of RunConfig: documented in its own table
    assert f"`{render(default)}`" in line, (
        f"{model.__name__}.{field}: default `{render(default)}` missing from: {line}"
    )


@pytest.mark.parametrize(
    "name",
    [
        n
        for n, f in RunConfig.model_fields.items()
        if isinstance(f.get_default(call_default_factory=True), BaseModel)
    ],
)
def test_run_config_overrides_documented(name: str) -> None:
    """Where RunConfig's section default differs from the class default, the row says so."""
    effective = getattr(RunConfig(), name)
    cls = type(effective)
    for field in cls.model_fields:
        value = getattr(effective, field)
        if value != cls.model_fields[field].get_default(call_default_factory=True):
            line = row(cls, field)
            assert f"`{render(value)}` in RunConfig" in line, (
                f"{name}.{field}: RunConfig's default {render(value)} not noted in: {line}"
            )


def test_sqlite_url_options_documented() -> None:
    from rolloutlog.eventstore.store import DEFAULT_BUSY_TIMEOUT_MS, DEFAULT_SQLITE_SYNCHRONOUS

    text = CONFIG_MD.read_text()
    assert f"`synchronous` | `{DEFAULT_SQLITE_SYNCHRONOUS}`" in text
    assert f"`busy_timeout_ms` | `{DEFAULT_BUSY_TIMEOUT_MS}`" in text

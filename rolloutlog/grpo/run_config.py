"""The whole configuration of a training run (``rolloutlog run CONFIG``, the demo).

Every section is a validated pydantic model with documented defaults; unknown fields
anywhere are rejected with their dotted name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rolloutlog.controller.config import (
    ConfigError,
    RolloutConfig,
    StoreConfig,
    TelemetryConfig,
)
from rolloutlog.controller.config_loading import load_yaml
from rolloutlog.controller.multiturn import MultiTurnConfig
from rolloutlog.controller.rollout_runtime import GenerationConfig
from rolloutlog.controller.workloads.dataset import DatasetConfig
from rolloutlog.controller.workloads.rewards import RewardConfig

from .toy_task import ToyTaskConfig
from .trainer import GRPOConfig

BackendKind = Literal["torch", "vllm", "deterministic", "fake-fleet", "vllm-fleet"]


class ModelConfig(BaseModel):
    """The policy: any local Hugging Face causal LM directory (safetensors + tokenizer)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    dir: str = Field(
        "runs/tiny-model", description="Local causal LM directory the policy is loaded from."
    )
    build: Literal["tiny", "none"] = Field(
        "tiny",
        description="tiny: build the tiny demo model into dir when dir holds no model (a "
        "model already there is loaded as it is); as the default (not written out) only into "
        "the default dir or one the tiny model was built in: a missing dir the config names "
        "is refused. none: dir must hold a model.",
    )
    seed: int = Field(0, ge=0, description="Seed of the initial weights (build: tiny).")
    max_model_len: int = Field(64, ge=8, description="Prompt + completion tokens per sibling.")


class FleetRunConfig(BaseModel):
    """Engines of the fleet backends (``fake-fleet``, ``vllm-fleet``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    engines: int = Field(2, ge=1, description="fake-fleet: engines started in the process.")
    urls: list[str] = Field(
        default_factory=list,
        description="vllm-fleet: base URLs of running vLLM servers (one engine each).",
    )
    kill_engine_at_step: int | None = Field(
        None,
        ge=0,
        description="fake-fleet: at the start of this train step, kill the last engine "
        "with work in flight and restart it (the demo's engine-loss scenario).",
    )
    latency_s: float = Field(
        0.02, ge=0, description="fake-fleet: seconds each fake engine takes per request."
    )
    probe_tolerance_nats: float | None = Field(
        1e-3,
        gt=0,
        description="Weight probe: an engine serves a weight version only if a fixed "
        "prompt's logprobs match the trainer's model of that version within this many "
        "nats (checked at every join and load); null turns the probe off.",
    )


class MultiTurnRunConfig(MultiTurnConfig):
    """A multi-turn run (``multi_turn:``): the shipped task and how each trajectory runs
    (the fields of :class:`~rolloutlog.controller.multiturn.MultiTurnConfig` plus the task's)."""

    task: Literal["calculator"] = Field(
        "calculator",
        description="The multi-turn task: calculator (add two digits with a calculator tool; "
        "rolloutlog.grpo.multiturn_task).",
    )
    num_prompts: int = Field(256, ge=1, description="Prompts of the task.")
    tool_ledger: str | None = Field(
        None,
        description="File where the calculator records each execution (its side effect); "
        "default: checkpoint_dir/<run_id>/calculator-ledger.tsv.",
    )


class RunConfig(BaseModel):
    """One training run: rollout rules, log, generation, task, trainer, schedule."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    run_id: str | None = Field(None, description="Run id in the log (default: generated).")
    steps: int = Field(30, ge=1, description="Train steps to run.")
    checkpoint_every: int = Field(5, ge=1, description="Checkpoint after every N train steps.")
    checkpoint_dir: str = Field(
        "runs/checkpoints", description="Model checkpoints (each stores its rollout offset)."
    )
    export_hf: bool = Field(
        True,
        description="At each checkpoint, also write the policy as a Hugging Face model "
        "directory (save_pretrained of model and tokenizer): checkpoint_dir/<run_id>/"
        "step-NNNNNN.hf, the newest one kept.",
    )
    backend: BackendKind = Field("torch", description="Generation backend.")
    seed: int = Field(0, ge=0, description="Seed of the trainer and the sampler.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    rollout: RolloutConfig = Field(
        default_factory=lambda: RolloutConfig(
            group_size=4, groups_per_step=8, lookahead=1, staleness_bound=1, spare_pool_size=2
        )
    )
    store: StoreConfig = Field(default_factory=StoreConfig)
    generation: GenerationConfig = Field(
        default_factory=lambda: GenerationConfig(max_in_flight_siblings=64, max_tokens=8)
    )
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    task: ToyTaskConfig = Field(default_factory=ToyTaskConfig)
    trainer: GRPOConfig = Field(default_factory=GRPOConfig)
    dataset: DatasetConfig | None = Field(
        None, description="Prompts from a local dataset file (replaces task when set)."
    )
    reward: RewardConfig | None = Field(
        None, description="Reward of dataset prompts (default when a dataset is set: exact_match)."
    )
    fleet: FleetRunConfig = Field(default_factory=FleetRunConfig)
    multi_turn: MultiTurnRunConfig | None = Field(
        None,
        description="Run the multi-turn task instead of the toy task: each sibling is a "
        "trajectory of model calls and tool calls (see docs/multi-turn.md).",
    )
    passes: int = Field(
        1,
        ge=1,
        description="Passes over the data: the dispatch cursor walks the prompts this many "
        "times; a prompt's identity in the log is (pass, index).",
    )
    shuffle: bool = Field(
        True,
        description="Shuffle each pass of a dataset with seed (recorded in the log); false: "
        "dataset order. The toy task is never shuffled.",
    )

    @model_validator(mode="after")
    def _workload_consistent(self) -> RunConfig:
        if self.reward is not None and self.dataset is None:
            raise ValueError("reward is set but dataset is not (the toy task has its own reward)")
        if self.multi_turn is not None and self.dataset is not None:
            raise ValueError(
                "multi_turn and dataset are both set (the multi-turn task has its own prompts)"
            )
        return self


def load_run_config(path: Path) -> RunConfig:
    """Load a YAML run configuration; errors name the offending field."""
    cfg = load_yaml(path, RunConfig)
    assert isinstance(cfg, RunConfig)
    return cfg


__all__ = [
    "BackendKind",
    "ConfigError",
    "FleetRunConfig",
    "ModelConfig",
    "MultiTurnRunConfig",
    "RunConfig",
    "load_run_config",
]

"""The whole configuration of a training run (``rolloutlog run CONFIG``, the demo).

Every section is a validated pydantic model with documented defaults; unknown fields
anywhere are rejected with their dotted name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rolloutlog.controller.config import (
    ConfigError,
    RolloutConfig,
    StoreConfig,
    TelemetryConfig,
)
from rolloutlog.controller.config_loading import load_yaml
from rolloutlog.controller.engines.config import FleetConfig
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


class FleetRunConfig(FleetConfig):
    """Engines of the fleet backends (``fake-fleet``, ``vllm-fleet``).

    A :class:`~rolloutlog.controller.engines.config.FleetConfig` (engine URLs or a
    ``launch`` section, the weights directory, timeouts, health and probe settings) plus
    the run's own fields. For ``vllm-fleet`` exactly one source of engines: ``launch``
    (the run starts them, local or on Ray, and stops them at its end), ``state_file``
    (the engines ``rolloutlog engines start`` recorded; left running) or ``urls``.
    In a run's ``launch`` section ``model_dir``, ``max_model_len`` and ``seed`` default to
    the run's ``model.dir``, ``model.max_model_len`` and ``seed``.
    """

    # Not strict like the other sections: the inherited fields are tuples and paths.
    model_config = ConfigDict(extra="forbid", frozen=True)

    engines: int = Field(2, ge=1, description="fake-fleet: engines started in the process.")
    state_file: Path | None = Field(
        None,
        description="vllm-fleet: the state file `rolloutlog engines start` wrote; the run "
        "uses the engines it records and leaves them running.",
    )
    python: str | None = Field(
        None,
        description="launch (local placement): interpreter that runs each server (default: "
        "the run's); on Ray: the actor's.",
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

    @model_validator(mode="after")
    def _one_source(self) -> FleetRunConfig:  # replaces FleetConfig's: none is allowed here
        given = [
            name
            for name, value in (
                ("urls", self.urls),
                ("launch", self.launch),
                ("state_file", self.state_file),
            )
            if value
        ]
        if len(given) > 1:
            raise ValueError(
                f"give one of fleet.urls, fleet.launch and fleet.state_file, not {given}"
            )
        if self.python is not None and self.launch is None:
            raise ValueError("fleet.python is the interpreter of fleet.launch's servers")
        return self

    def source(self) -> str | None:
        """Where a ``vllm-fleet`` run takes its engines from (None: not said)."""
        if self.launch is not None:
            return "launch"
        if self.state_file is not None:
            return "state_file"
        return "urls" if self.urls else None


#: What a vllm-fleet run without engines is told (checked before the run starts).
NO_ENGINES = (
    "backend vllm-fleet needs its engines: fleet.launch (the run starts them and stops "
    "them at its end: count, placement local or ray, ...), fleet.state_file (the engines "
    "`rolloutlog engines start` recorded) or fleet.urls (running vLLM servers)"
)


def _launch_defaults(data: Any) -> Any:
    """Fill a run's ``fleet.launch`` with the run's model directory, context length and
    seed where it does not say them; refuse a model directory other than the run's."""
    if not isinstance(data, dict):
        return data
    fleet = data.get("fleet")
    launch = fleet.get("launch") if isinstance(fleet, dict) else None
    if not isinstance(launch, dict):
        return data
    model = data.get("model", {})
    if isinstance(model, ModelConfig):
        model_dir, max_len = model.dir, model.max_model_len
    elif isinstance(model, dict):
        fields = ModelConfig.model_fields
        model_dir = model.get("dir", fields["dir"].default)
        max_len = model.get("max_model_len", fields["max_model_len"].default)
    else:
        return data  # validation names it
    given = launch.get("model_dir")
    if (
        given is not None
        and isinstance(model_dir, str)
        and Path(str(given)).resolve() != Path(model_dir).resolve()
    ):
        raise ValueError(
            f"fleet.launch.model_dir {given} is not the run's model.dir {model_dir}: "
            "the engines serve the run's policy (leave model_dir out)"
        )
    seed = data.get("seed", RunConfig.model_fields["seed"].default)
    launch = {"model_dir": model_dir, "max_model_len": max_len, "seed": seed, **launch}
    return {**data, "fleet": {**fleet, "launch": launch}}


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
    tool_delay_s: float = Field(
        0.0,
        ge=0,
        description="Seconds each calculator run takes after its side effect and before "
        "its result (a slow tool; the demo sets 0.5 so its crash lands in between).",
    )
    answer_delay_s: float = Field(
        0.0,
        ge=0,
        description="Seconds the environment takes to score an answer (a slow environment; "
        "the demo sets 0.02 so its crash lands mid-conversation).",
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

    @model_validator(mode="before")
    @classmethod
    def _launch_serves_the_model(cls, data: Any) -> Any:
        return _launch_defaults(data)

    @model_validator(mode="after")
    def _workload_consistent(self) -> RunConfig:
        if self.reward is not None and self.dataset is None:
            raise ValueError("reward is set but dataset is not (the toy task has its own reward)")
        if self.multi_turn is not None and self.dataset is not None:
            raise ValueError(
                "multi_turn and dataset are both set (the multi-turn task has its own prompts)"
            )
        return self

    @model_validator(mode="after")
    def _fleet_consistent(self) -> RunConfig:
        source = self.fleet.source()
        if source in ("launch", "state_file") and self.backend != "vllm-fleet":
            raise ValueError(f"fleet.{source} is for backend vllm-fleet (backend: {self.backend})")
        launch = self.fleet.launch
        if launch is not None and launch.max_model_len < self.model.max_model_len:
            raise ValueError(
                f"fleet.launch.max_model_len {launch.max_model_len} is below model.max_model_len "
                f"{self.model.max_model_len}: the engines could not serve the run's siblings"
            )
        return self


def load_run_config(path: Path) -> RunConfig:
    """Load a YAML run configuration; errors name the offending field.

    A ``vllm-fleet`` run must say where its engines are (the demo, which starts its own,
    builds its config in code)."""
    cfg = load_yaml(path, RunConfig)
    assert isinstance(cfg, RunConfig)
    if cfg.backend == "vllm-fleet" and cfg.fleet.source() is None:
        raise ConfigError(f"invalid configuration in {path}: {NO_ENGINES}")
    return cfg


__all__ = [
    "NO_ENGINES",
    "BackendKind",
    "ConfigError",
    "FleetRunConfig",
    "ModelConfig",
    "MultiTurnRunConfig",
    "RunConfig",
    "load_run_config",
]

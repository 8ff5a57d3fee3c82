"""Configuration of a generation fleet: engine URLs, or a section that launches them.

Exactly one of ``urls`` (engines someone else runs, anywhere on the network) and
``launch`` (engines this host starts: locally as processes, or as Ray actors) is set.
A run configuration's ``fleet`` section
(:class:`rolloutlog.grpo.run_config.FleetRunConfig`) is a :class:`FleetConfig` with the
run's own fields added (and a third source: an ``engines start`` state file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LaunchConfig(BaseModel):
    """Engines to start: ``count`` vLLM OpenAI servers on the tiny or any local model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    placement: Literal["local", "ray"] = Field(
        "local",
        description="Where engines run: local processes (own process groups) or Ray actors "
        "(num_cpus=0) on a Ray cluster.",
    )
    count: int = Field(2, ge=1, description="Number of engine servers.")
    model_dir: Path = Field(description="Local model directory every engine serves.")
    host: str = Field("127.0.0.1", description="Interface the local servers listen on.")
    port_base: int = Field(
        8100, ge=1, le=65535, description="Engine i listens on port_base + i (local)."
    )
    max_model_len: int = Field(128, ge=1, description="--max-model-len of every engine.")
    dtype: str = Field("float32", description="--dtype of every engine.")
    seed: int = Field(0, description="--seed of every engine.")
    kv_cache_gib: int = Field(
        1, ge=1, description="VLLM_CPU_KVCACHE_SPACE (GiB of KV cache per CPU engine)."
    )
    extra_args: tuple[str, ...] = Field(
        (), description="Further api_server arguments, e.g. ('--block-size', '32')."
    )
    ready_timeout_s: float = Field(
        300.0, gt=0, description="Seconds an engine may take to answer /health 200."
    )
    stop_timeout_s: float = Field(
        20.0, gt=0, description="Seconds after SIGTERM before the group gets SIGKILL."
    )
    log_dir: Path | None = Field(None, description="Engine logs (default: a temp directory).")
    ray_address: str | None = Field(
        None, description="Ray cluster address (placement 'ray'); None starts a local Ray."
    )


class FleetConfig(BaseModel):
    """A fleet of engines behind one backend: their URLs or how to launch them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    urls: tuple[str, ...] = Field((), description="Base URLs of running engine servers.")
    launch: LaunchConfig | None = Field(None, description="Engines to start instead of urls.")
    weights_root: Path | None = Field(
        None,
        description="Directory where weight versions are written for the engines to reload "
        "(a path every engine can read; default: a temp directory, one host only).",
    )
    request_timeout_s: float = Field(120.0, gt=0, description="Deadline of one sibling request.")
    control_timeout_s: float = Field(
        120.0, gt=0, description="Deadline of one weight reload on one engine."
    )
    health_interval_s: float = Field(1.0, gt=0, description="Seconds between /health probes.")
    health_timeout_s: float = Field(2.0, gt=0, description="Deadline of one /health probe.")
    keepalive_expiry_s: float = Field(
        2.0,
        gt=0,
        description="Idle seconds after which a pooled HTTP connection to an engine is "
        "dropped; keep it below the server's keep-alive (vLLM: 5 s), else a request can go "
        "out on a connection the server is closing.",
    )
    dead_after: int = Field(
        3, ge=1, description="Failed probes in a row after which an engine is lost."
    )
    auto_refit: bool = Field(
        True, description="Refit an engine that answers again to the published weights."
    )
    probe_tolerance_nats: float | None = Field(
        1e-3,
        gt=0,
        description="Weight probe: an engine serves a weight version only if a fixed "
        "prompt's logprobs match the reference model's within this many nats (checked at "
        "every join and load; needs model_dir); null turns the probe off.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> FleetConfig:
        if bool(self.urls) == (self.launch is not None):
            raise ValueError("give exactly one of fleet.urls and fleet.launch")
        return self

    @model_validator(mode="after")
    def _urls_valid(self) -> FleetConfig:
        bad = [u for u in self.urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"fleet.urls must be http(s) URLs, got {bad}")
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"fleet.urls has duplicates: {list(self.urls)}")
        return self

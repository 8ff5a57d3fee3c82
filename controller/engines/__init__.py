"""Generation engines past one process: configuration and launchers.

- :mod:`rolloutlog.controller.engines.config`: :class:`FleetConfig` (engine URLs, or a launch
  section :class:`LaunchConfig`).
- :mod:`rolloutlog.controller.engines.local`: :class:`LocalEngineLauncher`, vLLM OpenAI servers as
  local processes in their own process groups.
- :mod:`rolloutlog.controller.engines.ray_launcher`: :class:`RayEngineLauncher`, each server inside
  a Ray actor (``[ray]`` extra).
- :func:`build_fleet`: a :class:`~rolloutlog.controller.backends.fleet.FleetBackend` over URLs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rolloutlog.controller.engines.config import FleetConfig, LaunchConfig

__all__ = ["FleetConfig", "LaunchConfig", "build_fleet"]


def build_fleet(
    config: FleetConfig,
    urls: Sequence[str],
    *,
    model_dir: str | Path | None,
    max_model_len: int | None = None,
    seed: int = 0,
    weight_version: int = 0,
    listener: object | None = None,
) -> object:
    """A (not started) fleet backend over ``urls`` with the timeouts of ``config``."""
    from rolloutlog.controller.backends.fleet import FleetBackend, FleetListener
    from rolloutlog.controller.backends.vllm_server import VLLMServerBackend

    if listener is not None and not isinstance(listener, FleetListener):
        raise TypeError(f"listener must be a FleetListener, got {type(listener).__name__}")
    engines = [
        VLLMServerBackend(
            url,
            model_dir=model_dir,
            max_model_len=max_model_len,
            seed=seed,
            weight_version=weight_version,
            request_timeout=config.request_timeout_s,
            control_timeout=config.control_timeout_s,
            health_timeout=config.health_timeout_s,
            keepalive_expiry=config.keepalive_expiry_s,
            engine_id=f"engine-{i}",
        )
        for i, url in enumerate(urls)
    ]
    probe = None
    if model_dir is not None and config.probe_tolerance_nats is not None:
        from rolloutlog.controller.backends.weight_probe import WeightProbe

        probe = WeightProbe(Path(model_dir), config.probe_tolerance_nats)
    return FleetBackend(
        engines,
        weight_probe=probe,
        weight_version=weight_version,
        model_dir=model_dir,
        weights_root=config.weights_root,
        health_interval=config.health_interval_s,
        health_timeout=config.health_timeout_s,
        dead_after=config.dead_after,
        auto_refit=config.auto_refit,
        listener=listener,
    )

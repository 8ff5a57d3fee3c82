"""The engines of a ``vllm-fleet`` run: started by the run, recorded by ``engines start``, or
given by URL (the run config's ``fleet`` section, :class:`~.run_config.FleetRunConfig`).

``fleet.launch`` engines belong to the run: started (local processes, each in its own
process group and tethered to the run's process, or Ray actors) before anything is written
to the log, stopped when the run ends, however it ends. Engines of a state file or of
``urls`` belong to whoever started them and are left running.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolloutlog.controller.config import ConfigError

from .run_config import NO_ENGINES, RunConfig

log = logging.getLogger(__name__)


@dataclass
class RunEngines:
    """The engines a run generates with, and how it let go of them."""

    source: str
    urls: list[str]
    #: One entry per engine: ``engine_id``, ``url`` and, for local launches, ``pid`` (its
    #: process group) and ``log_path``.
    engines: list[dict[str, Any]] = field(default_factory=list)
    launcher: Any = None

    def describe(self) -> dict[str, Any]:
        """The progress message that names the engines (event ``engines``)."""
        return {"event": "engines", "source": self.source, "engines": self.engines}

    def stop(self) -> list[str]:
        """Stop the engines the run started (none for other sources); returns one line per
        engine that could not be stopped (also logged)."""
        launcher, self.launcher = self.launcher, None
        if launcher is None:
            return []
        not_stopped = launcher.stop()
        return list(not_stopped) if isinstance(not_stopped, list) else []


def open_engines(cfg: RunConfig, model_dir: Path) -> RunEngines:
    """The run's engines: started and ready (``fleet.launch``), read from the state file,
    or the configured URLs. Raises ``EngineLaunchError`` (what it started is stopped) or
    ``ConfigError``."""
    fleet = cfg.fleet
    source = fleet.source()
    if source is None:
        raise ConfigError(NO_ENGINES)
    if source == "urls":
        urls = list(fleet.urls)
        return RunEngines(
            "urls", urls, [{"engine_id": f"engine-{i}", "url": u} for i, u in enumerate(urls)]
        )
    if source == "state_file":
        assert fleet.state_file is not None
        return _from_state_file(fleet.state_file)
    launch = fleet.launch
    assert launch is not None
    launch = launch.model_copy(update={"model_dir": model_dir})
    if launch.placement == "ray":
        from rolloutlog.controller.engines.ray_launcher import RayEngineLauncher

        ray_launcher = RayEngineLauncher(launch, python=fleet.python)
        urls = ray_launcher.start()  # a failed start has stopped what it started
        engines = [{"engine_id": f"engine-{i}", "url": u} for i, u in enumerate(urls)]
        return RunEngines("launch", urls, engines, ray_launcher)
    from rolloutlog.controller.engines.local import LocalEngineLauncher

    local = LocalEngineLauncher(launch, python=fleet.python or sys.executable, tethered=True)
    started = local.start(wait=True)  # a failed start has stopped what it started
    engines = [
        {"engine_id": e.engine_id, "url": e.url, "pid": e.pid, "log_path": e.log_path}
        for e in started
    ]
    return RunEngines("launch", [e.url for e in started], engines, _LocalStop(local))


class _LocalStop:
    """The local launcher's ``stop`` (which returns nothing) in the Ray launcher's shape."""

    def __init__(self, launcher: Any) -> None:
        self.launcher = launcher

    def stop(self) -> list[str]:
        self.launcher.stop()
        return []


def _from_state_file(path: Path) -> RunEngines:
    """The engines ``rolloutlog engines start --state-file PATH`` recorded."""
    hint = f"`rolloutlog engines start --state-file {path}` writes it"
    try:
        state = json.loads(Path(path).read_text())
        engines = [
            {"engine_id": str(e["engine_id"]), "url": str(e["url"])} for e in state["engines"]
        ]
    except FileNotFoundError:
        raise ConfigError(f"fleet.state_file {path} does not exist; {hint}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"fleet.state_file {path} is not an engines state file ({type(exc).__name__}: "
            f"{exc}); {hint}"
        ) from None
    if not engines:
        raise ConfigError(f"fleet.state_file {path} records no engines; {hint}")
    return RunEngines("state_file", [e["url"] for e in engines], engines)


__all__ = ["RunEngines", "open_engines"]

"""``rolloutlog engines``: start and stop vLLM OpenAI server engines.

``engines start`` launches ``--count`` servers (each in its own process group, left
running when the command exits), waits until every one answers ``/health``, prints
their URLs (one a line, or ``--json``) and records them in ``--state-file``;
``engines restart`` stops and starts them again (all, or ``--engine ID``) with the
recorded settings; ``engines stop`` stops them (SIGTERM to each group, SIGKILL after a
deadline). ``--placement ray --ray-address HOST:PORT`` starts each server in a detached,
named Ray actor on an existing cluster instead (``engines stop`` finds them by name).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import click

from ._options import F, json_option, picked, shown

_STATE = Path(".rolloutlog-engines.json")


def _state_file_option(help: str | None = None) -> Callable[[F], F]:
    """``--state-file``: where ``engines start`` records the engines ``engines stop`` stops."""
    return shown(
        "--state-file", type=click.Path(dir_okay=False, path_type=Path), default=_STATE, help=help
    )


@click.group()
def engines() -> None:
    """Generation engines (vLLM OpenAI servers) for a fleet."""


@engines.command("start")
@shown("--count", default=2, type=click.IntRange(min=1))
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Local model directory every engine serves.",
)
@shown("--port-base", default=8100, help="Engine i gets port_base+i.")
@shown("--host", default="127.0.0.1")
@shown("--max-model-len", default=128, type=click.IntRange(min=1))
@shown("--dtype", default="float32")
@shown("--seed", default=0)
@shown("--ready-timeout", default=300.0, help="Seconds to /health 200.")
@click.option(
    "--log-dir", type=click.Path(file_okay=False, path_type=Path), default=None, help="Engine logs."
)
@_state_file_option(help="Where the started engines are recorded (for `engines stop`).")
@click.option("--engine-arg", "extra_args", multiple=True, help="Extra api_server argument.")
@shown(
    "--placement",
    default="local",
    type=click.Choice(["local", "ray"]),
    help="local processes, or detached Ray actors on the cluster at --ray-address.",
)
@click.option(
    "--ray-address",
    default=None,
    help="HOST:PORT of a running Ray cluster's head (--placement ray).",
)
@click.option(
    "--python",
    default=None,
    help="Interpreter that runs each server (default: this one; on Ray: the actor's).",
)
@json_option()
def start(
    count: int,
    model_dir: Path,
    port_base: int,
    host: str,
    max_model_len: int,
    dtype: str,
    seed: int,
    ready_timeout: float,
    log_dir: Path | None,
    state_file: Path,
    extra_args: tuple[str, ...],
    placement: str,
    ray_address: str | None,
    python: str | None,
    as_json: bool,
) -> None:
    """Start COUNT vLLM servers on MODEL and print their URLs."""
    from pydantic import ValidationError

    from rolloutlog.controller.engines.config import LaunchConfig
    from rolloutlog.controller.engines.local import EngineLaunchError, LocalEngineLauncher

    if state_file.exists():
        raise click.ClickException(
            f"{state_file} exists: engines may be running; `rolloutlog engines restart "
            f"--state-file {state_file}` restarts them, `rolloutlog engines stop "
            f"--state-file {state_file}` stops them"
        )
    launch = picked(
        "count", "model_dir", "host", "port_base", "max_model_len", "dtype", "seed", "log_dir",
        "extra_args",
    )  # fmt: skip
    if placement == "ray":
        urls = _start_on_ray(launch, ready_timeout, ray_address, python, state_file)
        _print_urls(urls, state_file, as_json)
        return
    if ray_address is not None:
        raise click.ClickException("--ray-address is for --placement ray")
    try:
        config = LaunchConfig(**launch, ready_timeout_s=ready_timeout)
        launcher = LocalEngineLauncher(config, python=python or sys.executable)
        launcher.start(wait=False)
        state_file.write_text(json.dumps(launcher.state(), indent=2))
        launcher.wait_ready()
    except ValidationError as exc:
        raise click.ClickException(str(exc)) from exc
    except EngineLaunchError as exc:
        if state_file.exists():
            from rolloutlog.controller.engines.local import stop_from_state

            stop_from_state(state_file)
            state_file.unlink()
        raise click.ClickException(str(exc)) from exc
    _print_urls([e.url for e in launcher.engines], state_file, as_json)


def _start_on_ray(
    launch: dict[str, object],
    ready_timeout: float,
    ray_address: str | None,
    python: str | None,
    state_file: Path,
) -> list[str]:
    """Detached engine actors on the cluster at ``ray_address``; records them, returns URLs."""
    from pydantic import ValidationError

    from rolloutlog.controller.engines.config import LaunchConfig
    from rolloutlog.controller.engines.local import EngineLaunchError
    from rolloutlog.controller.engines.ray_launcher import RayEngineLauncher

    if not ray_address:
        # A Ray started by this command would end with it, and its engines with it.
        raise click.ClickException(
            "--placement ray needs --ray-address HOST:PORT of a running cluster "
            "(`ray start --head` prints it)"
        )
    launch = {k: v for k, v in launch.items() if k not in ("host", "port_base")}
    try:
        config = LaunchConfig(
            **launch, placement="ray", ray_address=ray_address, ready_timeout_s=ready_timeout
        )
        launcher = RayEngineLauncher(config, python=python, detached=True)
        urls = launcher.start()  # a failed start has stopped what it started
    except ValidationError as exc:
        raise click.ClickException(str(exc)) from exc
    except EngineLaunchError as exc:
        raise click.ClickException(str(exc)) from exc
    state_file.write_text(json.dumps(launcher.state(), indent=2))
    return urls


def _print_urls(urls: list[str], state_file: Path, as_json: bool) -> None:
    if as_json:
        json.dump({"urls": urls, "state_file": str(state_file)}, sys.stdout)
        sys.stdout.write("\n")
    else:
        for url in urls:
            click.echo(url)


@engines.command("stop")
@_state_file_option()
def stop(state_file: Path) -> None:
    """Stop the engines recorded in the state file (SIGTERM, then SIGKILL)."""
    from rolloutlog.controller.engines.local import stop_from_state

    if not state_file.is_file():
        raise click.ClickException(f"{state_file}: no engines recorded (nothing to stop)")
    state = json.loads(state_file.read_text())
    if state.get("placement") == "ray":
        _stop_on_ray(state, state_file)
        return
    for engine_id in stop_from_state(state_file):
        click.echo(f"stopped {engine_id}")
    state_file.unlink()


def _stop_on_ray(state: dict[str, object], state_file: Path) -> None:
    from rolloutlog.controller.engines.local import EngineLaunchError
    from rolloutlog.controller.engines.ray_launcher import stop_from_state

    try:
        stopped, not_stopped = stop_from_state(state)
    except EngineLaunchError as exc:
        raise click.ClickException(str(exc)) from exc
    for engine_id in stopped:
        click.echo(f"stopped {engine_id}")
    state_file.unlink()
    if not_stopped:
        raise click.ClickException("not stopped: " + "; ".join(not_stopped))


@engines.command("restart")
@_state_file_option(help="The file `engines start` wrote (rewritten with the new processes).")
@click.option(
    "--engine",
    "engine_ids",
    multiple=True,
    help="Restart only this engine (repeatable; default: every recorded engine).",
)
@click.option(
    "--ready-timeout", type=float, default=None, help="Seconds to /health 200 (default: start's)."
)
@json_option()
def restart(
    state_file: Path, engine_ids: tuple[str, ...], ready_timeout: float | None, as_json: bool
) -> None:
    """Restart the engines recorded in the state file on their ports and print their URLs.

    A restarted engine serves its model's start-up weights; a run's fleet finds that out
    when it asks the engine, and refits it before it serves.
    """
    from rolloutlog.controller.engines.local import EngineLaunchError, restart_from_state

    if not state_file.is_file():
        raise click.ClickException(
            f"{state_file}: no engines recorded (nothing to restart; `rolloutlog engines start`)"
        )
    if json.loads(state_file.read_text()).get("placement") == "ray":
        raise click.ClickException(
            f"{state_file} records Ray engines, which `engines restart` does not restart: "
            f"`rolloutlog engines stop --state-file {state_file}`, then `engines start`"
        )
    try:
        restarted = restart_from_state(state_file, engine_ids, ready_timeout_s=ready_timeout)
    except EngineLaunchError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        json.dump(
            {"restarted": [e.engine_id for e in restarted], "urls": [e.url for e in restarted]},
            sys.stdout,
        )
        sys.stdout.write("\n")
    else:
        for engine in restarted:
            click.echo(f"restarted {engine.engine_id} {engine.url}")

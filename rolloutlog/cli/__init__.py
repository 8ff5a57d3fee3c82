"""The ``rolloutlog`` command line: one click group, one module per subcommand family."""

from __future__ import annotations

import importlib
from typing import Any

import click

# (module, attribute) of each subcommand; imported lazily so `--help` stays fast and a
# missing optional dependency only breaks the command that needs it.
_COMMANDS: dict[str, tuple[str, str]] = {
    "db": ("rolloutlog.cli.db", "db"),
    "bench": ("rolloutlog.cli.bench", "bench"),
    "demo": ("rolloutlog.cli.demo", "demo"),
    "run": ("rolloutlog.cli.demo", "run"),
    "metrics": ("rolloutlog.cli.metrics", "metrics"),
    "serve-metrics": ("rolloutlog.cli.metrics", "serve_metrics"),
    "report": ("rolloutlog.cli.report", "report"),
    "audit": ("rolloutlog.cli.audit", "audit"),
    "replay": ("rolloutlog.cli.replay", "replay"),
    "compact": ("rolloutlog.cli.compact", "compact"),
    "engines": ("rolloutlog.cli.engines", "engines"),
}


class _LazyGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        """Run the subcommand; an unexpected error becomes one clear line and exit 1
        (``--debug`` or ``ROLLOUTLOG_DEBUG=1`` keeps the traceback)."""
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as exc:
            if ctx.params.get("debug"):
                raise
            first = str(exc).strip().splitlines()
            detail = f": {first[0]}" if first else ""
            raise click.ClickException(
                f"{type(exc).__name__}{detail} (run with --debug for the traceback)"
            ) from exc

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(_COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in _COMMANDS:
            module, attr = _COMMANDS[cmd_name]
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, cmd_name)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rolloutlog")
@click.option(
    "--debug",
    is_flag=True,
    envvar="ROLLOUTLOG_DEBUG",
    help="Show the traceback of an unexpected error (default: one line, exit 1).",
)
def main(debug: bool) -> None:
    """rolloutlog: an event-sourced rollout log for asynchronous RL post-training."""

"""Click options that several ``rolloutlog`` commands declare alike.

Each helper returns an ordinary ``click.option`` decorator, so a command's ``--help``
reads as if the option were spelled out in place.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def options(*decorators: Callable[[F], F]) -> Callable[[F], F]:
    """Apply ``decorators`` as if stacked in this order above the command."""

    def apply(f: F) -> F:
        for decorator in reversed(decorators):
            f = decorator(f)
        return f

    return apply


def json_option(help: str = "Print one JSON object.") -> Callable[[F], F]:
    """``--json`` (parameter ``as_json``): machine-readable output."""
    return click.option("--json", "as_json", is_flag=True, help=help)


def flag(name: str, help: str) -> Callable[[F], F]:
    """An on/off switch, off by default."""
    return click.option(name, is_flag=True, help=help)


def shown(*decls: str, default: Any, help: str | None = None, **kwargs: Any) -> Callable[[F], F]:
    """An option whose default ``--help`` shows."""
    return click.option(*decls, default=default, show_default=True, help=help, **kwargs)


def optional_int(*decls: str, minimum: int, help: str) -> Callable[[F], F]:
    """An integer of at least ``minimum``, ``None`` when not given (the callee's default)."""
    return click.option(*decls, type=click.IntRange(min=minimum), default=None, help=help)


def seconds_option(*decls: str, default: float, help: str) -> Callable[[F], F]:
    """A positive number of seconds with a shown default."""
    return shown(*decls, type=click.FloatRange(0, min_open=True), default=default, help=help)


def run_option(help: str) -> Callable[[F], F]:
    """``--run`` (parameter ``run_id``): which run of the log, ``None`` for the default."""
    return click.option("--run", "run_id", default=None, help=help)


def db_dir_option(help: str) -> Callable[[F], F]:
    """``--db-dir``: a folder for a benchmark's SQLite files, ``None`` by default."""
    return click.option(
        "--db-dir", type=click.Path(file_okay=False, path_type=Path), default=None, help=help
    )


def picked(*names: str) -> dict[str, Any]:
    """The current command's parameters ``names``, to pass on as keyword arguments."""
    params = click.get_current_context().params
    return {name: params[name] for name in names}

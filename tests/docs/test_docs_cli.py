"""Every rolloutlog command and subcommand, and every option, appears in docs/cli.md."""

from __future__ import annotations

from pathlib import Path

import click

from rolloutlog.cli import main

CLI_MD = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def walk(group: click.Group, prefix: str = "rolloutlog") -> list[tuple[str, click.Command]]:
    ctx = click.Context(group)
    out: list[tuple[str, click.Command]] = []
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        assert cmd is not None, name
        path = f"{prefix} {name}"
        out.append((path, cmd))
        if isinstance(cmd, click.Group):
            out.extend(walk(cmd, path))
    return out


def test_walk_finds_nested_commands() -> None:
    paths = {p for p, _ in walk(main)}
    assert {"rolloutlog db upgrade", "rolloutlog db check", "rolloutlog bench store"} <= paths


def test_every_command_has_a_heading_in_cli_md() -> None:
    text = CLI_MD.read_text()
    missing = [path for path, _ in walk(main) if f"## `{path}`" not in text]
    assert not missing, f"docs/cli.md has no section for: {missing}"


def test_every_option_is_documented_in_its_section() -> None:
    text = CLI_MD.read_text()
    problems = []
    for path, cmd in walk(main):
        start = text.index(f"## `{path}`")
        nxt = text.find("\n## ", start + 1)
        section = text[start : nxt if nxt != -1 else len(text)]
        for param in cmd.params:
            if isinstance(param, click.Option):
                names = [o for o in param.opts if o.startswith("--")]
                if names and not any(f"`{n}" in section for n in names):
                    problems.append(f"{path}: {names[0]}")
            elif isinstance(param, click.Argument) and param.human_readable_name not in section:
                problems.append(f"{path}: argument {param.human_readable_name}")
    assert not problems, f"undocumented in docs/cli.md: {problems}"

"""README's install section names every extra of pyproject.toml, each with an install
line (so a user learns of ``[data]`` before ``rolloutlog run`` asks for it)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_extra_has_an_install_line_in_the_readme() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"pip install 'rolloutlog\[([a-z0-9_-]+)\]'", section))
    assert set(extras) <= named, f"README's install section lacks {sorted(set(extras) - named)}"

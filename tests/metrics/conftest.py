"""Fixtures of the metrics suite.

``scenario`` is the scripted run of :mod:`metrics_helpers` on a SQLite file, run once
per session and shared read-only by the exporter and CLI tests. The live-vs-offline test
runs its own on both backends (``db_url``). This folder is put on ``sys.path`` so the
test modules import ``metrics_helpers`` whatever pytest's import mode.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from metrics_helpers import Scenario, run_scenario  # noqa: E402


@pytest.fixture(scope="session")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    """The scripted run (failures, drops, evictions, checkpoint, crash, restore) on SQLite."""
    path = tmp_path_factory.mktemp("metrics") / "log.db"
    return run_scenario(f"sqlite:///{path}")

"""Helpers shared by the benchmark modules."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def scratch_dir(parent: Path | None, keep: bool, *, prefix: str) -> Iterator[Path]:
    """A new folder ``prefix*`` for a benchmark's SQLite files, in ``parent`` (created if
    missing; default: the system temp folder), removed afterwards unless ``keep``."""
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)

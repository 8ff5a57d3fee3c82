"""Helpers shared by the benchmark modules."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rolloutlog.eventstore.errors import RolloutlogError


class BenchmarkError(RolloutlogError, RuntimeError):
    """A benchmark's state is not what it set up (a system read back other data than it
    wrote, a run in another state than driven): a bug, never a slow result."""


def sqlite_file_bytes(path: Path) -> int:
    """Bytes of the SQLite file at ``path`` with its -wal and -shm companions."""
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*") if p.is_file())


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

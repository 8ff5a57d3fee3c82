"""rolloutlog: an event-sourced rollout log for asynchronous RL post-training.

The public API in a few names (imported on first use, so ``import rolloutlog`` stays
light and never imports torch)::

    from rolloutlog import EventStore, RolloutController, RolloutRuntime, RolloutConfig

Every error the library raises derives from :class:`RolloutlogError`.

The packages (docs/architecture.md has the picture):

- :mod:`rolloutlog.eventstore`: the generic append-only log (SQLite, PostgreSQL, memory).
- :mod:`rolloutlog.controller`: the rollout domain (pure ``decide``/``evolve``), the
  controller that keeps a run in step with its log, the async runtime, the generation
  backends, the prompt ledger, SQL audit, replay and metrics.
- :mod:`rolloutlog.migrations`: the alembic migrations of the store's schema.
- :mod:`rolloutlog.cli`: the ``rolloutlog`` command.
- :mod:`rolloutlog.grpo`: the GRPO demo (toy task, tiny model, trainer; the ``[torch]`` extra).
- :mod:`rolloutlog.bench`: the benchmarks behind ``rolloutlog bench``.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rolloutlog.controller.config import RolloutConfig
    from rolloutlog.controller.rollout_controller import RolloutController
    from rolloutlog.controller.rollout_runtime import RolloutRuntime
    from rolloutlog.eventstore import EventStore
    from rolloutlog.eventstore.errors import RolloutlogError

# Run from a checkout (its root first on sys.path, as `python -m pytest` there puts it), this
# folder shadows the installed package, whose controller/, eventstore/ and migrations/ are
# mapped from sibling folders: a strict editable install (scripts/setup.sh) has them in its
# link tree, so look for the package's modules in every `rolloutlog` folder on sys.path.
__path__ = pkgutil.extend_path(__path__, __name__)

# Public name -> the module that defines it.
_PUBLIC: dict[str, str] = {
    "EventStore": "rolloutlog.eventstore",
    "RolloutConfig": "rolloutlog.controller.config",
    "RolloutController": "rolloutlog.controller.rollout_controller",
    "RolloutRuntime": "rolloutlog.controller.rollout_runtime",
    "RolloutlogError": "rolloutlog.eventstore.errors",
}

__all__ = ["EventStore", "RolloutConfig", "RolloutController", "RolloutRuntime", "RolloutlogError"]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])

"""Contract test suites as importable base classes: a third-party event store or
generation backend runs the suite rolloutlog's own run (see docs/api.md, "Testing your
own store or backend").

- :class:`EventStoreContract` (:mod:`rolloutlog.testing.store`): the event store contract
  over :class:`~rolloutlog.eventstore.EventStoreProtocol`;
- :class:`GenerationBackendContract` (:mod:`rolloutlog.testing.backends`): the
  generation-backend contract on the tiny model (needs the ``torch`` extra).

Both need pytest and hypothesis (the ``testing`` extra). Subclass one as ``Test...`` in
your test suite; pytest collects the inherited tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backends import GenerationBackendContract
    from .store import EventStoreContract

__all__ = ["EventStoreContract", "GenerationBackendContract"]


def __getattr__(name: str) -> Any:
    # Each suite imports its own dependencies (pytest, hypothesis; torch for backends).
    if name == "EventStoreContract":
        from .store import EventStoreContract

        return EventStoreContract
    if name == "GenerationBackendContract":
        from .backends import GenerationBackendContract

        return GenerationBackendContract
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

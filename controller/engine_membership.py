"""Engine membership in the log: a fleet listener that records joins, losses and refits.

The fleet (:class:`~rolloutlog.controller.backends.fleet.FleetBackend`) reports
membership through :class:`FleetListener` callbacks. :class:`EngineMembershipRecorder`
turns them into controller commands (``RecordEngineJoined`` / ``RecordEngineLost`` /
``RecordEngineRefit``). Callbacks may come from the fleet's tasks or from another thread,
so each is handed to the runtime's event loop (``call_soon_threadsafe``) and executed
there, in the order the fleet reported them; the controller is only ever touched on
its loop.

An engine killed outright usually fails its requests (connection reset) before the
health probes declare it dead, so the fleet's in-flight list at the loss is often
empty. The recorder therefore remembers the sibling attempts that failed on an engine
because of the engine (transport error, loss) since it last joined, and records them
with the loss: ``EngineLost.in_flight`` answers "what was in flight on E when it died".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .backends.base import BackendError, GroupRequest
from .backends.fleet import EngineLostError, FleetListener
from .backends.vllm_server import EngineTransportError
from .domain import RecordEngineJoined, RecordEngineLost, RecordEngineRefit
from .domain.errors import DomainError
from .rollout_controller import RolloutController

log = logging.getLogger(__name__)


@dataclass(slots=True)
class MembershipStats:
    """What the recorder wrote (for the demo and tests)."""

    joined: int = 0
    lost: int = 0
    refit: int = 0
    rejected: int = 0  # callbacks the domain refused (logged; e.g. a loss of an unknown engine)


class EngineMembershipRecorder(FleetListener):
    """Records a fleet's engine membership in the run's log (see the module doc).

    ``loop``: the event loop the controller runs on (default: the loop of the first
    callback, which comes from the fleet's start).
    """

    def __init__(
        self,
        controller: RolloutController,
        loop: asyncio.AbstractEventLoop | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.controller = controller
        self.loop = loop
        self.on_error = on_error
        self.stats = MembershipStats()
        #: Request ids that failed on each engine because of the engine, since it joined.
        self._failed_on: dict[str, list[str]] = {}

    # --- callbacks (any thread) -------------------------------------------------------

    def on_engine_joined(self, engine_id: str, address: str, weight_version: int | None) -> None:
        """Record an EngineJoined."""
        self._submit(self._joined, engine_id, address, weight_version)

    def on_engine_lost(self, engine_id: str, reason: str, in_flight: Sequence[str]) -> None:
        """Record an EngineLost with the attempts in flight on the engine."""
        self._submit(self._lost, engine_id, reason, tuple(in_flight))

    def on_engine_refit(self, engine_id: str, weight_version: int) -> None:
        """Record an EngineRefit."""
        self._submit(self._refit, engine_id, weight_version)

    def on_request_failed(self, engine_id: str, request: GroupRequest, error: BackendError) -> None:
        """Remember the attempts that failed because of the engine (for its loss)."""
        if isinstance(error, EngineTransportError | EngineLostError):
            ids = [request.request_id(spec) for spec in request.siblings]
            self._submit(self._failed, engine_id, ids)

    # --- on the loop ---------------------------------------------------------------------

    def _submit(self, fn: Callable[..., None], *args: object) -> None:
        if self.loop is None:
            # The first callback comes from the fleet's start, on the runtime's loop: bind
            # to it (later callbacks may come from any thread).
            try:
                self.loop = asyncio.get_running_loop()
            except RuntimeError:
                log.warning("engine membership callback with no event loop: %s%s", fn, args)
                return
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the run is over, nothing to record
            log.warning("engine membership callback after the loop closed: %s%s", fn, args)

    def _failed(self, engine_id: str, ids: list[str]) -> None:
        self._failed_on.setdefault(engine_id, []).extend(ids)

    def _joined(self, engine_id: str, address: str, weight_version: int | None) -> None:
        self._failed_on.pop(engine_id, None)
        if self._execute(RecordEngineJoined(engine_id, address, weight_version)):
            self.stats.joined += 1

    def _lost(self, engine_id: str, reason: str, in_flight: tuple[str, ...]) -> None:
        failed = self._failed_on.pop(engine_id, [])
        attempts = tuple(dict.fromkeys((*failed, *in_flight)))  # ordered, without repeats
        if self._execute(RecordEngineLost(engine_id, reason, attempts)):
            self.stats.lost += 1

    def _refit(self, engine_id: str, weight_version: int) -> None:
        if self._execute(RecordEngineRefit(engine_id, weight_version)):
            self.stats.refit += 1

    def _execute(self, command: RecordEngineJoined | RecordEngineLost | RecordEngineRefit) -> bool:
        try:
            self.controller.execute(command)
        except DomainError as exc:
            # Membership is a record of what the fleet saw; a refused one (a loss of an
            # engine that never joined) must not stop generation.
            self.stats.rejected += 1
            log.warning("engine membership not recorded: %s", exc)
            return False
        except Exception as exc:  # the log itself failed: the run cannot go on
            if self.on_error is None:
                raise
            self.on_error(exc)
            return False
        return True

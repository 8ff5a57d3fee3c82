"""A fleet of generation engines behind the one :class:`GenerationBackend` protocol.

Each engine is a :class:`~rolloutlog.controller.backends.vllm_server.VLLMServerBackend` (an
OpenAI-compatible vLLM server, anywhere on the network). The fleet

- routes each group request to the **healthy engine with the fewest outstanding
  sibling requests** that holds the weight version the request is dispatched with
  (ties rotate, so equal engines share the load);
- tracks each engine's **health**: ``healthy`` (serves), ``suspect`` (a request or a
  ``/health`` probe failed), ``dead`` (``dead_after`` probes in a row failed),
  ``stale`` (answers, but its weights are not known to be the published version);
- turns a transport failure or an engine's death into a **retryable** failure of the
  sibling attempt (the runtime re-dispatches it; the retry goes to a healthy engine);
- treats an engine that **comes back** (after being suspect or dead: it may have been
  restarted with other weights) as ``stale`` until it is **refit** to the published
  weight version, and never sends a request to an engine whose weights differ from the
  version the request is dispatched with;
- fans weight updates out to every serving engine: the weights are written **once** to
  a versioned directory (``weights_root``, shared with the engines) and each engine
  reloads it (``/collective_rpc reload_weights``). An engine whose load fails becomes
  stale and is refit later; the fleet's version moves when at least one engine loaded it.

Membership is reported through a :class:`FleetListener` (``on_engine_joined``,
``on_engine_lost``, ``on_engine_refit``, ``on_engine_stale``, ``on_request_routed``,
``on_request_failed``):
synchronous, cheap callbacks from which the controller appends log events. Results
carry the ``engine_id`` of the engine that produced them.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rolloutlog.controller.backends._gate import DrainGate
from rolloutlog.controller.backends.base import (
    BackendAbortedError,
    BackendError,
    BackendUnavailableError,
    FixedRetryError,
    GroupRequest,
    SiblingResult,
    validate_request,
    validate_weight_update,
)
from rolloutlog.controller.backends.vllm_server import (
    EngineStaleError,
    EngineTransportError,
    VLLMServerBackend,
    write_weights_dir,
)


class EngineHealth(enum.StrEnum):
    """What the fleet believes about one engine."""

    HEALTHY = "healthy"
    SUSPECT = "suspect"
    DEAD = "dead"
    STALE = "stale"


class EngineLostError(FixedRetryError, retryable=True):
    """The engine a sibling attempt ran on was lost (retryable on another engine)."""


class NoEngineError(FixedRetryError, retryable=True):
    """No engine can serve the request's weight version right now (retryable)."""


class FleetListener:
    """Membership callbacks (no-ops here; subclass or pass callables to override).

    Called synchronously on the event loop, so they must be quick and must not block:
    append an event to an in-memory buffer, update a metric.
    """

    def on_engine_joined(self, engine_id: str, address: str, weight_version: int | None) -> None:
        """An engine answers (at start, or again after being lost); ``None``: weights unknown."""

    def on_engine_lost(self, engine_id: str, reason: str, in_flight: Sequence[str]) -> None:
        """An engine was declared dead; ``in_flight`` are the sibling request ids it held."""

    def on_engine_stale(self, engine_id: str, reason: str) -> None:
        """An engine no longer holds the published weights; it serves again after a refit."""

    def on_engine_refit(self, engine_id: str, weight_version: int) -> None:
        """An engine now holds ``weight_version`` (a refit or a fleet-wide update)."""

    def on_request_routed(self, engine_id: str, request: GroupRequest, weight_version: int) -> None:
        """A group request was sent to ``engine_id`` to be served with ``weight_version``."""

    def on_request_failed(self, engine_id: str, request: GroupRequest, error: BackendError) -> None:
        """A request failed because of its engine (transport, stale, lost): retryable.

        With ``on_engine_lost`` this answers "what was in flight on engine E when it
        died": a killed engine's requests fail at once (connections reset), usually
        before the probes declare it dead.
        """


@dataclass(eq=False)
class FleetEngine:
    """One engine of the fleet and what the fleet knows about it."""

    backend: VLLMServerBackend
    health: EngineHealth = EngineHealth.DEAD
    failed_probes: int = 0
    joined: bool = False
    #: Group ids with a request in flight here (abort routes through this).
    groups: dict[int, int] = field(default_factory=dict)

    @property
    def engine_id(self) -> str:
        """The engine's name (its URL unless configured)."""
        return self.backend.engine_id


class FleetBackend:
    """A :class:`GenerationBackend` over N engine servers (see the module docstring).

    Args:
        engines: the engine clients (not started; :meth:`start` starts them).
        weight_version: the version of the weights the engines were started with.
        model_dir: the served model (a restarted engine that must go back to the
            start-up weights is refit from here).
        weights_root: where weight versions are written (must be readable by every
            engine at the same path); default: a temporary directory.
        health_interval: seconds between ``/health`` probes of each engine.
        health_timeout: deadline of one probe.
        dead_after: failed probes in a row after which an engine is declared dead.
        auto_refit: refit stale engines that answer to the published version.
        listener: membership callbacks (:class:`FleetListener`).
    """

    name = "vllm-fleet"

    def __init__(
        self,
        engines: Sequence[VLLMServerBackend],
        *,
        weight_version: int = 0,
        model_dir: str | Path | None = None,
        weights_root: str | Path | None = None,
        health_interval: float = 1.0,
        health_timeout: float = 2.0,
        dead_after: int = 3,
        auto_refit: bool = True,
        dtype: str = "float32",
        listener: FleetListener | None = None,
    ) -> None:
        if not engines:
            raise ValueError("a fleet needs at least one engine")
        ids = [e.engine_id for e in engines]
        if len(set(ids)) != len(ids):
            raise ValueError(f"engine ids must be unique, got {ids}")
        if dead_after < 1:
            raise ValueError(f"dead_after {dead_after} must be >= 1")
        self.engines = [FleetEngine(e) for e in engines]
        self._by_id = {e.engine_id: e for e in self.engines}
        self.model_dir = None if model_dir is None else Path(model_dir)
        self._weights_root = None if weights_root is None else Path(weights_root)
        self._own_root = weights_root is None
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.dead_after = dead_after
        self.auto_refit = auto_refit
        self._torch_dtype: torch.dtype = getattr(torch, dtype)
        self.listener = listener or FleetListener()
        self._version = weight_version
        #: Where the published version's weights are (None: the start-up model_dir).
        self._published: Path | None = None
        self._gate = DrainGate()
        self._control: asyncio.Lock | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._rr = itertools.count()
        self._background: set[asyncio.Task[None]] = set()
        self._started = False
        self._closed = False

    def adopt_membership_recorder(self, recorder: FleetListener) -> bool:
        """Install the runtime's membership ``recorder`` as the listener unless the caller
        gave one of its own (see ``RecordsEngineMembership``); True when installed."""
        if type(self.listener) is not FleetListener:
            return False
        self.listener = recorder
        return True

    # --- protocol properties --------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """The engines' vocabulary size (they serve one model)."""
        return self.engines[0].backend.vocab_size

    @property
    def max_model_len(self) -> int:
        """The smallest context length of the engines."""
        lens = [e.backend.max_model_len for e in self.engines if e.backend.max_model_len]
        return min(lens) if lens else 0

    @property
    def weight_version(self) -> int:
        """The published weight version: every request is served with it."""
        return self._version

    def health(self) -> dict[str, EngineHealth]:
        """Each engine's health, by engine id."""
        return {e.engine_id: e.health for e in self.engines}

    def in_flight_groups(self) -> set[int]:
        """Group ids with a request in flight on some engine."""
        return {g for e in self.engines for g, n in e.groups.items() if n}

    # --- life cycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Start every engine client; at least one must answer. Starts the health monitor."""
        if self._closed:
            raise BackendUnavailableError("fleet is closed")
        if self._started:
            return
        self._control = asyncio.Lock()
        self._wake = asyncio.Event()
        outcomes = await asyncio.gather(
            *(e.backend.start() for e in self.engines), return_exceptions=True
        )
        errors: list[str] = []
        for engine, outcome in zip(self.engines, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                engine.health = EngineHealth.DEAD
                errors.append(f"{engine.engine_id}: {outcome}")
                continue
            self._join(engine, engine.backend.weight_version)
        if not any(e.joined for e in self.engines):
            raise BackendUnavailableError(f"no engine of the fleet started: {'; '.join(errors)}")
        vocab = {e.backend.vocab_size for e in self.engines if e.joined}
        if len(vocab) != 1:
            raise BackendUnavailableError(f"engines disagree on the vocabulary size: {vocab}")
        self._started = True
        self._monitor = asyncio.ensure_future(self._monitor_loop())

    def _join(self, engine: FleetEngine, version: int | None) -> None:
        engine.joined = True
        engine.failed_probes = 0
        self.listener.on_engine_joined(engine.engine_id, engine.backend.base_url, version)
        if version == self._version and engine.backend.weights_known:
            engine.health = EngineHealth.HEALTHY
        else:
            self._mark_stale(engine, f"holds weight version {version}, published {self._version}")

    async def close(self) -> None:
        """Stop the monitor and close every engine client (engines keep running)."""
        self._closed = True
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await monitor
        await asyncio.gather(*(e.backend.close() for e in self.engines), return_exceptions=True)
        if self._own_root and self._weights_root is not None:
            shutil.rmtree(self._weights_root, ignore_errors=True)

    def _check_open(self) -> None:
        if self._closed:
            raise BackendUnavailableError("fleet is closed")
        if not self._started:
            raise BackendUnavailableError("fleet is not started")

    # --- routing --------------------------------------------------------------------

    def pick(self, version: int) -> FleetEngine | None:
        """The healthy engine holding ``version`` with the fewest outstanding requests."""
        best: FleetEngine | None = None
        best_load = 0
        n = len(self.engines)
        start = next(self._rr) % n
        for i in range(n):
            engine = self.engines[(start + i) % n]
            b = engine.backend
            if (
                engine.health is not EngineHealth.HEALTHY
                or not b.weights_known
                or b.weight_version != version
            ):
                continue
            load = b.outstanding
            if best is None or load < best_load:
                best, best_load = engine, load
        return best

    async def generate(self, request: GroupRequest) -> list[SiblingResult]:
        """Serve the request on one healthy engine holding the published version."""
        return await self.generate_at(request, None)

    async def generate_at(self, request: GroupRequest, version: int | None) -> list[SiblingResult]:
        """Serve the request with weight ``version`` (``None``: the published one).

        A version other than the published one raises :class:`NoEngineError`
        (retryable): no engine is ever asked to serve weights it does not hold.
        """
        self._check_open()
        validate_request(request, self.vocab_size, self.max_model_len)
        async with self._gate.generating():
            self._check_open()
            if version is not None and version != self._version:
                raise NoEngineError(
                    f"group {request.group_id}: dispatched with weight version {version}, "
                    f"the fleet serves {self._version}"
                )
            version = self._version
            engine = self.pick(version)
            if engine is None:
                raise NoEngineError(
                    f"group {request.group_id}: no healthy engine holds weight version "
                    f"{version} ({', '.join(f'{k}={v}' for k, v in self.health().items())})"
                )
            self.listener.on_request_routed(engine.engine_id, request, version)
            engine.groups[request.group_id] = engine.groups.get(request.group_id, 0) + 1
            try:
                return await engine.backend.generate_at(request, version)
            except EngineTransportError as exc:
                self._suspect(engine, str(exc))
                self.listener.on_request_failed(engine.engine_id, request, exc)
                raise
            except EngineStaleError as exc:
                self._mark_stale(engine, str(exc))
                self.listener.on_request_failed(engine.engine_id, request, exc)
                raise
            except BackendAbortedError as exc:
                if engine.health is EngineHealth.DEAD:  # cancelled because it was lost
                    lost = EngineLostError(
                        f"group {request.group_id}: engine {engine.engine_id} was lost"
                    )
                    self.listener.on_request_failed(engine.engine_id, request, lost)
                    raise lost from exc
                raise
            finally:
                left = engine.groups.get(request.group_id, 0) - 1
                if left > 0:
                    engine.groups[request.group_id] = left
                else:
                    engine.groups.pop(request.group_id, None)

    async def abort(self, group_id: int) -> None:
        """Abort the group's requests on whichever engines hold them."""
        await asyncio.gather(
            *(e.backend.abort(group_id) for e in self.engines if group_id in e.groups)
        )

    # --- health ---------------------------------------------------------------------

    def _suspect(self, engine: FleetEngine, reason: str) -> None:
        if engine.health is EngineHealth.HEALTHY:
            engine.health = EngineHealth.SUSPECT
        if self._wake is not None:
            self._wake.set()  # probe now rather than at the next interval

    def _mark_stale(self, engine: FleetEngine, reason: str) -> None:
        if engine.health is not EngineHealth.STALE:
            engine.health = EngineHealth.STALE
            self.listener.on_engine_stale(engine.engine_id, reason)

    def _lose(self, engine: FleetEngine, reason: str) -> None:
        in_flight = engine.backend.in_flight_request_ids()
        engine.health = EngineHealth.DEAD
        engine.joined = False
        self.listener.on_engine_lost(engine.engine_id, reason, in_flight)
        for group_id in list(engine.groups):  # their generate raises EngineLostError
            task = asyncio.ensure_future(engine.backend.abort(group_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def probe(self, engine: FleetEngine) -> None:
        """One health probe of ``engine`` and the state transition it implies."""
        ok = await engine.backend.check_health(self.health_timeout)
        if not ok:
            engine.failed_probes += 1
            if engine.health is EngineHealth.HEALTHY:
                engine.health = EngineHealth.SUSPECT
            if engine.health is not EngineHealth.DEAD and engine.failed_probes >= self.dead_after:
                self._lose(engine, f"{engine.failed_probes} health probes failed")
            return
        engine.failed_probes = 0
        if engine.health in (EngineHealth.DEAD, EngineHealth.SUSPECT):
            # It answers again. Restarted? A restarted engine lost our weight tag
            # (/weight_info): then it is stale until refit. A blip keeps the tag.
            verified = await engine.backend.verify_weights()
            if engine.health is EngineHealth.DEAD:
                self._join(engine, engine.backend.weight_version if verified else None)
            elif verified and engine.backend.weight_version == self._version:
                engine.health = EngineHealth.HEALTHY
            else:
                self._mark_stale(engine, "answered again without the published weights")
        if engine.health is EngineHealth.STALE and self.auto_refit:
            with contextlib.suppress(BackendError):
                await self.refit(engine.engine_id)

    async def probe_all(self) -> dict[str, EngineHealth]:
        """Probe every engine once (concurrently); returns the resulting health."""
        await asyncio.gather(*(self.probe(e) for e in self.engines))
        return self.health()

    async def _monitor_loop(self) -> None:
        assert self._wake is not None
        while not self._closed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.health_interval)
            self._wake.clear()
            try:
                await self.probe_all()
            except Exception:  # the monitor must outlive one bad probe
                await asyncio.sleep(self.health_interval)

    async def refit(self, engine_id: str) -> None:
        """Load the published weights into a stale engine; it then serves again."""
        engine = self._by_id[engine_id]
        assert self._control is not None
        async with self._control:
            version = self._version
            if engine.health is EngineHealth.HEALTHY and engine.backend.weight_version == version:
                return
            if self._published is not None:
                await engine.backend.load_weights_dir(self._published, version)
            elif self.model_dir is not None:
                await engine.backend.load_weights_dir(self.model_dir, version, check_manifest=False)
            else:
                raise BackendError(
                    f"{engine_id}: nothing to refit from (no published weights, no model_dir)",
                    retryable=False,
                )
            engine.health = EngineHealth.HEALTHY
            engine.failed_probes = 0
            self.listener.on_engine_refit(engine_id, version)

    # --- weights --------------------------------------------------------------------

    def weights_root(self) -> Path:
        """Where weight versions are written (created on first use)."""
        if self._weights_root is None:
            import tempfile

            self._weights_root = Path(tempfile.mkdtemp(prefix="rolloutlog-fleet-weights-"))
        return self._weights_root

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Write the weights once and load them into every serving engine.

        Drains the fleet's in-flight requests first; requests arriving meanwhile wait
        and are served with the new version.
        """
        self._check_open()
        shapes = next((e.backend.weight_shapes for e in self.engines if e.joined), None)
        tensors = validate_weight_update(named_tensors, version, shapes)
        assert self._control is not None
        # The gate closes before the first await: a request arriving from now on waits
        # for the new version (the contract), even while the weights are being written.
        async with self._gate.swapping(), self._control:
            path = await asyncio.to_thread(
                write_weights_dir, tensors, version, self.weights_root(), self._torch_dtype
            )
            targets = [e for e in self.engines if e.health is EngineHealth.HEALTHY]
            outcomes = await asyncio.gather(
                *(e.backend.load_weights_dir(path, version) for e in targets),
                return_exceptions=True,
            )
            loaded = [e for e, o in zip(targets, outcomes, strict=True) if o is None]
            if not loaded:
                errors = [str(o) for o in outcomes if isinstance(o, BaseException)]
                shutil.rmtree(path, ignore_errors=True)
                raise BackendError(
                    f"weight version {version} loaded on no engine: "
                    f"{'; '.join(errors) or 'none serving'}",
                    retryable=False,
                )
            old, self._published, self._version = self._published, path, version
            for engine, outcome in zip(targets, outcomes, strict=True):
                if outcome is None:
                    self.listener.on_engine_refit(engine.engine_id, version)
                else:
                    self._mark_stale(engine, f"weight load failed: {outcome}")
            for engine in self.engines:  # suspect ones answer later: stale, then refit
                if engine.health is EngineHealth.SUSPECT:
                    engine.backend.forget_weights()
            if old is not None and self._own_root:
                shutil.rmtree(old, ignore_errors=True)

    # --- control fan-out ---------------------------------------------------------------

    async def broadcast(self, method: str, path: str, json: Any = None) -> dict[str, Any]:
        """Send one control call to every joined engine; returns status (or error) by id."""
        self._check_open()

        async def one(e: FleetEngine) -> Any:
            try:
                resp = await e.backend.control(method, path, json)
            except BackendError as exc:
                return exc
            return resp

        joined = [e for e in self.engines if e.joined]
        outcomes = await asyncio.gather(*(one(e) for e in joined))
        return {e.engine_id: o for e, o in zip(joined, outcomes, strict=True)}

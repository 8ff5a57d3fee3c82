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
- **asks** each engine which weights it serves when it joins (at start, or when it
  answers again after being lost): its weight tag (``/weight_info``) names the version
  and a content fingerprint of the weights a rolloutlog client last loaded into it, or
  vLLM's start-up tag with the model it was started with (``/v1/models`` ``root``). An
  engine joins with the run's current version only if those are the current version's
  weights; otherwise (an earlier run's weights, a load cut short, another model) it
  joins with ``None``, is ``stale``, and is **refit** before it serves;
- with a :class:`~rolloutlog.controller.backends.weight_probe.WeightProbe`, checks that
  claim after every join and load: a fixed prompt's logprobs must match the reference
  model's for that version within the probe's tolerance, or the engine is stale;
- never sends a request to an engine whose weights differ from the version the request
  is dispatched with, and keeps a result only if its engine still carries the fleet's
  weight tag after serving it (another client, e.g. a second run on the same engines,
  that loads other weights into an engine tags it first: those results are discarded,
  retryable, and the engine is stale until refit);
- fans weight updates out to every engine that answers: the weights are written
  **once** to a versioned directory (``weights_root``, shared with the engines) and
  each engine drains its own requests and reloads it (``/collective_rpc
  reload_weights``). New requests wait for the publish; an engine that stops answering
  its health probe meanwhile has its load cancelled (the publish completes on the
  others, within one health probe) and is refit when it answers again. An engine whose
  load fails becomes stale and is refit later; the fleet's version moves when at least
  one engine loaded it.

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
import logging
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

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
    STARTUP_TAG,
    EngineStaleError,
    EngineTransportError,
    VLLMServerBackend,
    model_dir_fingerprint,
    parse_weight_tag,
    read_manifest,
    write_weights_dir,
)
from rolloutlog.controller.backends.weight_probe import WeightProbe

log = logging.getLogger(__name__)


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
    #: The weight load of the publish under way (cancelled if the engine stops answering).
    load: asyncio.Task[str | None] | None = None
    #: The refit scheduled by the health monitor, if one is pending.
    refitting: asyncio.Task[None] | None = None

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
        auto_refit: refit stale engines that answer to the published version (at start,
            before anything is served, and whenever one answers again).
        weight_probe: verify every join and load with this probe (needs ``model_dir``).
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
        weight_probe: WeightProbe | None = None,
        listener: FleetListener | None = None,
    ) -> None:
        if not engines:
            raise ValueError("a fleet needs at least one engine")
        ids = [e.engine_id for e in engines]
        if len(set(ids)) != len(ids):
            raise ValueError(f"engine ids must be unique, got {ids}")
        if dead_after < 1:
            raise ValueError(f"dead_after {dead_after} must be >= 1")
        if weight_probe is not None and model_dir is None:
            raise ValueError("a weight probe needs model_dir (the reference model)")
        self.engines = [FleetEngine(e) for e in engines]
        for engine in self.engines:  # a result is kept only if its engine's tag is ours
            engine.backend.check_tag_after_serving = True
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
        self.weight_probe = weight_probe
        self._version = weight_version
        #: Where the published version's weights are (None: the start-up model_dir).
        self._published: Path | None = None
        #: Content fingerprint of the published version's weights (None: not known, i.e.
        #: no model_dir: engines on vLLM's start-up tag are taken at their word).
        self._fingerprint: str | None = None
        #: The probe's prompt and the logprobs the published version answers to it.
        self._probe_prompt: tuple[int, ...] = ()
        self._expected: list[float] | None = None
        #: Set while no publish is under way: new requests wait for the new version.
        self._door: asyncio.Event | None = None
        #: Set by a failed health probe while a publish waits for its loads.
        self._load_watch: asyncio.Event | None = None
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
        """Start every engine client; at least one must answer. Each engine is asked which
        weights it serves; an engine without the published ones is refit (``auto_refit``)
        before anything is served. Starts the health monitor."""
        if self._closed:
            raise BackendUnavailableError("fleet is closed")
        if self._started:
            return
        self._control = asyncio.Lock()
        self._wake = asyncio.Event()
        self._door = asyncio.Event()
        self._door.set()
        outcomes = await asyncio.gather(
            *(e.backend.start() for e in self.engines), return_exceptions=True
        )
        errors: list[str] = []
        up: list[FleetEngine] = []
        for engine, outcome in zip(self.engines, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                engine.health = EngineHealth.DEAD
                errors.append(f"{engine.engine_id}: {outcome}")
            else:
                up.append(engine)
        if not up:
            raise BackendUnavailableError(f"no engine of the fleet started: {'; '.join(errors)}")
        vocab = {e.backend.vocab_size for e in up}
        if len(vocab) != 1:
            raise BackendUnavailableError(f"engines disagree on the vocabulary size: {vocab}")
        if self.model_dir is not None:
            try:
                self._fingerprint = await asyncio.to_thread(
                    model_dir_fingerprint, self.model_dir, self._torch_dtype
                )
                if self.weight_probe is not None:
                    self._probe_prompt = self.weight_probe.prompt(
                        self.vocab_size, self.max_model_len
                    )
                    self._expected = await asyncio.to_thread(
                        self.weight_probe.expected_for_dir, self.model_dir, self._probe_prompt
                    )
            except (OSError, ValueError) as exc:
                raise BackendUnavailableError(
                    f"cannot identify the weights of {self.model_dir}: {exc}"
                ) from exc
        await asyncio.gather(*(self._join(e) for e in up))
        if self.auto_refit:
            stale = [e for e in up if e.health is EngineHealth.STALE]
            await asyncio.gather(*(self.refit(e.engine_id) for e in stale), return_exceptions=True)
        self._started = True
        self._monitor = asyncio.ensure_future(self._monitor_loop())

    async def _identify(self, engine: FleetEngine) -> tuple[int | None, str]:
        """Ask the engine which weights it serves: the published version, or ``None``
        with the reason (not the published weights, or not identifiable)."""
        backend = engine.backend
        try:
            tag = await backend.served_weight_tag()
        except Exception as exc:  # transport error, malformed answer: not identified
            return None, f"its weight tag could not be read ({type(exc).__name__}: {exc})"
        parsed = parse_weight_tag(tag)
        if parsed is not None:
            version, fingerprint = parsed
            if version == self._version and fingerprint == self._fingerprint:
                backend.assume_weights(version, fingerprint)
                return version, ""
            return None, (
                f"it holds weights tagged {tag!r}, not the published weight version "
                f"{self._version} (fingerprint {self._fingerprint})"
            )
        if tag == STARTUP_TAG and self._published is None:
            root = backend.served_root
            if self.model_dir is None or (
                root is not None and Path(root).resolve() == self.model_dir.resolve()
            ):
                backend.assume_weights(self._version, None)
                return self._version, ""
            return None, f"it serves its start-up model {root!r}, not {self.model_dir}"
        return None, f"its weight tag {tag!r} identifies no weights of this run"

    async def _verify(self, engine: FleetEngine, version: int, expected: list[float] | None) -> str:
        """The weight probe on ``engine`` against ``expected``; '' if it passes (or no probe)."""
        if self.weight_probe is None or expected is None:
            return ""
        try:
            got = await engine.backend.prompt_logprobs(self._probe_prompt)
        except BackendError as exc:
            return f"weight probe failed: {exc}"
        distance = self.weight_probe.distance(got, expected)
        if distance > self.weight_probe.tolerance:
            return (
                f"weight probe: its logprobs differ from weight version {version}'s by "
                f"{distance:.3g} nats (tolerance {self.weight_probe.tolerance})"
            )
        return ""

    async def _join(self, engine: FleetEngine) -> None:
        """The engine answers (at start or again): ask its weights, verify, record."""
        version, reason = await self._identify(engine)
        if version is not None:
            reason = await self._verify(engine, version, self._expected)
            if reason:
                version = None
        engine.joined = True
        engine.failed_probes = 0
        self.listener.on_engine_joined(engine.engine_id, engine.backend.base_url, version)
        if version is not None:
            engine.health = EngineHealth.HEALTHY
        else:
            engine.backend.forget_weights()
            self._mark_stale(engine, reason)

    async def close(self) -> None:
        """Stop the monitor and close every engine client (engines keep running)."""
        self._closed = True
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await monitor
        refits = [e.refitting for e in self.engines if e.refitting is not None]
        for task in refits:
            task.cancel()
        await asyncio.gather(*refits, return_exceptions=True)
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
        assert self._door is not None
        while not self._door.is_set():  # a publish is under way: serve the new version
            await self._door.wait()
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
            log.warning("engine %s is stale (refit before it serves): %s", engine.engine_id, reason)
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
            if engine.load is not None and self._load_watch is not None:
                self._load_watch.set()  # the publish may stop waiting for this engine
            if engine.health is not EngineHealth.DEAD and engine.failed_probes >= self.dead_after:
                self._lose(engine, f"{engine.failed_probes} health probes failed")
            return
        engine.failed_probes = 0
        if engine.health is EngineHealth.DEAD:
            # It answers again, maybe restarted with other weights: ask which.
            await self._join(engine)
        elif engine.health is EngineHealth.SUSPECT:
            # A blip keeps our weight tag; a restarted engine lost it: stale until refit.
            verified = await engine.backend.verify_weights()
            if verified and engine.backend.weight_version == self._version:
                engine.health = EngineHealth.HEALTHY
            else:
                self._mark_stale(engine, "answered again without the published weights")
        if engine.health is EngineHealth.STALE and self.auto_refit:
            self._schedule_refit(engine)

    def _schedule_refit(self, engine: FleetEngine) -> None:
        """Refit in the background (the monitor must keep probing during a publish)."""
        if engine.refitting is not None and not engine.refitting.done():
            return

        async def refit_quietly() -> None:
            with contextlib.suppress(BackendError):
                await self.refit(engine.engine_id)

        engine.refitting = asyncio.ensure_future(refit_quietly())
        self._background.add(engine.refitting)
        engine.refitting.add_done_callback(self._background.discard)

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

    def _holds_published(self, engine: FleetEngine) -> bool:
        b = engine.backend
        return b.weights_known and b.weight_version == self._version

    async def refit(self, engine_id: str) -> None:
        """Load the published weights into a stale engine, verify them (weight probe); it
        then serves again. Raises :class:`BackendError` if it could not be refit."""
        engine = self._by_id[engine_id]
        assert self._control is not None
        async with self._control:
            version = self._version
            if engine.health is EngineHealth.HEALTHY and self._holds_published(engine):
                return  # refit by the publish it waited for: nothing to record twice
            if engine.health is EngineHealth.DEAD:
                raise BackendError(f"{engine_id}: lost, not refit", retryable=False)
            if self._published is not None:
                await engine.backend.load_weights_dir(self._published, version)
            elif self.model_dir is not None:
                await engine.backend.load_weights_dir(
                    self.model_dir, version, check_manifest=False, fingerprint=self._fingerprint
                )
            else:
                raise BackendError(
                    f"{engine_id}: nothing to refit from (no published weights, no model_dir)",
                    retryable=False,
                )
            failed = await self._verify(engine, version, self._expected)
            if failed:
                engine.backend.forget_weights()
                self._mark_stale(engine, failed)
                raise BackendError(
                    f"{engine_id}: refit to weight version {version}: {failed}", retryable=False
                )
            # Lost while loading (the health probe runs across the awaits above; mypy keeps
            # the narrowing from before them): it rejoins later.
            if engine.health is EngineHealth.DEAD:  # type: ignore[comparison-overlap]
                raise BackendError(f"{engine_id}: lost during its refit", retryable=False)
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
        """Write the weights once and load them into every engine that answers.

        New requests wait from the first line on and are served with the new version.
        Each engine drains its own in-flight requests before its load, so a hung engine
        holds up only itself: when it fails a health probe its load is cancelled, it is
        marked stale (weights unknown) and refit once it answers; the publish completes
        on the others.
        """
        self._check_open()
        shapes = next((e.backend.weight_shapes for e in self.engines if e.joined), None)
        tensors = validate_weight_update(named_tensors, version, shapes)
        assert self._control is not None and self._door is not None and self._wake is not None
        # The door closes before the first await: a request arriving from now on waits
        # for the new version (the contract), even while the weights are being written.
        self._door.clear()
        try:
            async with self._control:
                await self._publish(tensors, version)
        finally:
            self._door.set()

    async def _publish(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        assert self._wake is not None
        path = await asyncio.to_thread(
            write_weights_dir, tensors, version, self.weights_root(), self._torch_dtype
        )
        fingerprint = read_manifest(path)[1]
        expected: list[float] | None = None
        if self.weight_probe is not None:
            expected = await asyncio.to_thread(
                self.weight_probe.expected_for_tensors, tensors, self._probe_prompt
            )
        # Stale engines that answer get the new version too (a refit); suspect and dead
        # ones are refit when they answer again.
        targets = [
            e
            for e in self.engines
            if e.joined and e.health in (EngineHealth.HEALTHY, EngineHealth.STALE)
        ]
        for engine in targets:
            engine.load = asyncio.ensure_future(self._load(engine, path, version, expected))
        self._wake.set()  # probe now: an engine that does not answer is found within one probe
        try:
            await self._await_loads(targets)
        except BaseException:  # the publish itself was cancelled: so are its loads
            for engine in targets:
                task, engine.load = engine.load, None
                if task is not None and not task.done():
                    task.cancel()
                if engine.health is not EngineHealth.DEAD:
                    engine.backend.forget_weights()
                    self._mark_stale(engine, "the publish was cancelled during its load")
            raise
        outcomes: dict[FleetEngine, str] = {}
        for engine in targets:
            task, engine.load = engine.load, None
            assert task is not None
            if task.cancelled():
                outcomes[engine] = "its load was cancelled: it stopped answering health probes"
            elif task.exception() is not None:
                outcomes[engine] = f"weight load failed: {task.exception()}"
            else:
                outcomes[engine] = task.result() or ""
        loaded = [e for e, failure in outcomes.items() if not failure]
        if not loaded:
            shutil.rmtree(path, ignore_errors=True)
            why = "; ".join(f"{e.engine_id}: {f}" for e, f in outcomes.items())
            raise BackendError(
                f"weight version {version} loaded on no engine: {why or 'none serving'}",
                retryable=False,
            )
        old, self._published, self._version = self._published, path, version
        self._fingerprint, self._expected = fingerprint, expected
        for engine, failure in outcomes.items():
            if engine.health is EngineHealth.DEAD:
                continue  # lost meanwhile: asked again when it answers
            if not failure:
                engine.health = EngineHealth.HEALTHY
                engine.failed_probes = 0
                self.listener.on_engine_refit(engine.engine_id, version)
            else:
                engine.backend.forget_weights()
                self._mark_stale(engine, failure)
        for engine in self.engines:
            if engine in outcomes:
                continue
            if engine.health is EngineHealth.HEALTHY:  # joined during the publish
                held = engine.backend.weight_version
                self._mark_stale(engine, f"joined with weight version {held}, published {version}")
            if engine.health is not EngineHealth.DEAD:
                engine.backend.forget_weights()  # suspect ones answer later: stale, then refit
            if engine.health is EngineHealth.STALE and self.auto_refit:
                self._schedule_refit(engine)
        if old is not None and self._own_root:
            shutil.rmtree(old, ignore_errors=True)

    async def _await_loads(self, targets: list[FleetEngine]) -> None:
        """Wait for the loads, but not for an engine that stops answering its health
        probes once another engine holds the new version: its load is cancelled (its
        weights are then unknown) and it is refit when it answers again. While no load
        has succeeded, a failed probe cancels nothing (all probes failing at once is more
        likely this process being slow than every engine hung)."""
        loads = {e: e.load for e in targets if e.load is not None}
        while True:
            pending = [t for t in loads.values() if not t.done()]
            if not pending:
                return
            self._load_watch = watch = asyncio.Event()
            waiter = asyncio.ensure_future(watch.wait())
            try:
                await asyncio.wait([*pending, waiter], return_when=asyncio.FIRST_COMPLETED)
            finally:
                self._load_watch = None
                waiter.cancel()
            if any(
                t.done() and not t.cancelled() and t.exception() is None and not t.result()
                for t in loads.values()
            ):
                for engine, task in loads.items():
                    if not task.done() and engine.failed_probes > 0:
                        task.cancel()

    async def _load(
        self, engine: FleetEngine, path: Path, version: int, expected: list[float] | None
    ) -> str:
        """Load ``path`` into one engine and verify it; '' on success, else why not."""
        await engine.backend.load_weights_dir(path, version)
        return await self._verify(engine, version, expected)

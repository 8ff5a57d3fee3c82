"""The one protocol every generation backend honours (vLLM, torch, deterministic test).

A backend turns a group request (one prompt, some siblings, each with its attempt
number) into one result per requested sibling: sampled token ids, their logprobs and
the weight version that produced them. The contract is checked by
:func:`validate_results` for every backend, and the contract test suite runs against
all of them, so the test backend is exactly as strict as the real ones.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, runtime_checkable

from rolloutlog.eventstore.errors import RolloutlogError

from ..domain.completion import Completion

if TYPE_CHECKING:  # torch is the [torch] extra: the core imports it only where weights move
    import torch


class BackendError(RolloutlogError):
    """A generation request failed. ``retryable`` says whether a new attempt may succeed."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class FixedRetryError(BackendError):
    """A :class:`BackendError` whose ``retryable`` is fixed by its class, declared as
    ``class E(FixedRetryError, retryable=False)``; it is raised with the message only."""

    _retryable: ClassVar[bool] = True

    def __init_subclass__(cls, *, retryable: bool | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if retryable is not None:
            cls._retryable = retryable

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=self._retryable)


class BackendUnavailableError(FixedRetryError, retryable=False):
    """The backend cannot be reached or started (not retryable by the rollout pump)."""


class BackendAbortedError(FixedRetryError, retryable=True):
    """The request was aborted (by :meth:`GenerationBackend.abort`) before it finished.

    ``sibling_reasons``: why the backend itself gave up particular siblings (by sibling
    index); the runtime records each one's reason with its abort."""

    def __init__(self, message: str, *, sibling_reasons: Mapping[int, str] | None = None) -> None:
        super().__init__(message)
        self.sibling_reasons: dict[int, str] = dict(sibling_reasons or {})


class MalformedResultError(FixedRetryError, retryable=False):
    """A backend returned results that break the contract (count, ids, logprobs)."""


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """Sampling parameters shared by every sibling of a request."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass(frozen=True, slots=True)
class SiblingSpec:
    """One sibling to generate: its index within the group and its attempt number."""

    sibling: int
    attempt: int


@dataclass(frozen=True, slots=True)
class GroupRequest:
    """Generate ``siblings`` for one prompt (a group, or the unfinished part of one)."""

    group_id: int
    prompt_token_ids: tuple[int, ...]
    siblings: tuple[SiblingSpec, ...]
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def request_id(self, spec: SiblingSpec) -> str:
        """Stable id of one sibling attempt (used for abort and fencing)."""
        return f"g{self.group_id}-s{spec.sibling}-a{spec.attempt}"


@dataclass(frozen=True, slots=True)
class SiblingResult:
    """One generated sibling."""

    group_id: int
    sibling: int
    attempt: int
    weight_version: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" | "length"
    #: Which engine generated it (set by the HTTP/fleet backends; None in-process).
    engine_id: str | None = None

    @classmethod
    def generated(
        cls,
        request: GroupRequest,
        spec: SiblingSpec,
        weight_version: int,
        token_ids: tuple[int, ...],
        logprobs: tuple[float, ...],
        finish_reason: str,
    ) -> SiblingResult:
        """The result of the attempt ``spec`` of ``request``, labelled with their ids."""
        return cls(
            group_id=request.group_id,
            sibling=spec.sibling,
            attempt=spec.attempt,
            weight_version=weight_version,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=finish_reason,
        )

    def completion(self, *, prompt_tokens: int, reward: float, payload_id: str) -> Completion:
        """The domain's record of this result, once the pump has scored it and named the
        payload its token ids and logprobs are stored as (neither is the backend's to
        know)."""
        return Completion(
            group_id=self.group_id,
            sibling=self.sibling,
            attempt=self.attempt,
            weight_version=self.weight_version,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(self.token_ids),
            reward=reward,
            payload_id=payload_id,
            finish_reason=self.finish_reason,
            engine_id=self.engine_id,
        )


@runtime_checkable
class RecordsEngineMembership(Protocol):
    """A backend whose engines join and leave while a run goes on (the fleet): the runtime
    offers it a recorder that writes their membership to the log."""

    def adopt_membership_recorder(self, recorder: Any) -> bool:
        """Install ``recorder`` (a ``FleetListener``) unless the caller installed a
        listener of its own; True when installed."""
        ...


@runtime_checkable
class GenerationBackend(Protocol):
    """What the rollout pump needs from a generation engine."""

    @property
    def name(self) -> str:
        """The backend's kind (``make_backend``'s ``kind``); a class attribute satisfies it."""
        ...

    @property
    def vocab_size(self) -> int:
        """Size of the token vocabulary; every token id is in ``[0, vocab_size)``."""
        ...

    @property
    def weight_version(self) -> int:
        """Version of the weights new requests are served with."""
        ...

    async def start(self) -> None:
        """Start the engine; raise :class:`BackendUnavailableError` if it cannot start."""
        ...

    async def generate(self, request: GroupRequest) -> list[SiblingResult]:
        """Generate every requested sibling; results in the order of ``request.siblings``.

        Raises :class:`BackendError` (retryable or not) or :class:`BackendAbortedError`.
        """
        ...

    async def abort(self, group_id: int) -> None:
        """Abort the in-flight requests of a group; their ``generate`` raises aborted."""
        ...

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Load new policy weights; requests started afterwards report ``version``."""
        ...

    async def close(self) -> None:
        """Stop the engine and release its resources."""
        ...


_Handle = TypeVar("_Handle")


class BackendBase:
    """What the backends share: the vocabulary size and weight version they report,
    their closed flag, the registry of in-flight ``generate`` calls per group that
    :meth:`abort` and ``close`` act on, and the contract checks applied with the
    backend's own limits. Subclasses set ``name``, ``label`` and ``max_model_len`` and
    implement the rest of :class:`GenerationBackend`."""

    #: The kind :func:`make_backend` knows the backend by.
    name: ClassVar[str] = ""
    #: How errors name the backend ("torch backend is closed").
    label: str = "backend"
    #: Longest prompt + ``max_tokens`` a request may ask for.
    max_model_len: int
    #: The checkpoint's weight names and shapes (None: names are not checked), and the
    #: names an update must give (None: all of them); see :func:`validate_weight_update`.
    _shapes: Mapping[str, tuple[int, ...]] | None = None
    _required: Collection[str] | None = None

    def __init__(self, *, vocab_size: int, weight_version: int) -> None:
        self._vocab_size = vocab_size
        self._weight_version = weight_version
        # group id -> the handles (abort flags, stop events) of its running requests.
        self._inflight: dict[int, list[Any]] = {}
        self._closed = False

    @property
    def vocab_size(self) -> int:
        """Size of the token vocabulary; every token id is in ``[0, vocab_size)``."""
        return self._vocab_size

    @property
    def weight_version(self) -> int:
        """Version of the weights new requests are served with."""
        return self._weight_version

    def in_flight_groups(self) -> set[int]:
        """Group ids with a ``generate`` call in progress."""
        return {g for g, runs in self._inflight.items() if runs}

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise BackendUnavailableError(f"{self.label} is closed")

    def _not_started(self) -> BackendUnavailableError:
        return BackendUnavailableError(f"{self.label} is not started")

    @staticmethod
    def _aborted(request: GroupRequest) -> BackendAbortedError:
        return BackendAbortedError(f"group {request.group_id}: request aborted")

    def _check_request(self, request: GroupRequest) -> None:
        """:func:`validate_request` against this backend's vocabulary and context length."""
        validate_request(request, self._vocab_size, self.max_model_len)

    def _check_results(
        self, request: GroupRequest, results: Sequence[SiblingResult]
    ) -> list[SiblingResult]:
        """:func:`validate_results` against this backend's vocabulary."""
        return validate_results(request, results, self._vocab_size)

    def _check_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> dict[str, torch.Tensor]:
        """:func:`validate_weight_update` against this backend's checkpoint names."""
        return validate_weight_update(named_tensors, version, self._shapes, self._required)

    @contextmanager
    def _tracked(self, group_id: int, handle: _Handle) -> Iterator[_Handle]:
        """Register ``handle`` as a running request of ``group_id`` for its duration."""
        self._inflight.setdefault(group_id, []).append(handle)
        try:
            yield handle
        finally:
            runs = self._inflight.get(group_id, [])
            if handle in runs:
                runs.remove(handle)
            if not runs:
                self._inflight.pop(group_id, None)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _plain_logprobs(lps: Sequence[float]) -> bool:
    """Whether every item is a plain finite float <= 1e-6 (False: check one by one)."""
    if set(map(type, lps)) != {float}:
        return False
    try:
        return max(lps) <= 1e-6 and math.isfinite(math.fsum(lps))
    except (OverflowError, ValueError):  # an intermediate overflow; inf and -inf
        return False


def validate_request(request: GroupRequest, vocab_size: int, max_model_len: int) -> None:
    """The request half of the contract, enforced identically by every backend.

    Every violation raises :class:`BackendError` with ``retryable=False``: the same
    request can never succeed on a new attempt.
    """
    if not request.siblings:
        raise BackendError(f"group {request.group_id}: request names no siblings", retryable=False)
    bad_specs = [
        (s.sibling, s.attempt)
        for s in request.siblings
        if not (_is_int(s.sibling) and _is_int(s.attempt) and s.sibling >= 0 and s.attempt >= 0)
    ]
    if bad_specs:
        raise BackendError(
            f"group {request.group_id}: (sibling, attempt) {bad_specs[:5]} must be ints >= 0",
            retryable=False,
        )
    sampling = request.sampling
    if not _is_int(sampling.max_tokens) or sampling.max_tokens < 1:
        raise BackendError(
            f"group {request.group_id}: max_tokens {sampling.max_tokens!r} must be an int >= 1",
            retryable=False,
        )
    if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0):
        raise BackendError(
            f"group {request.group_id}: temperature {sampling.temperature!r} must be finite "
            "and >= 0",
            retryable=False,
        )
    if not 0 < sampling.top_p <= 1:
        raise BackendError(
            f"group {request.group_id}: top_p {sampling.top_p!r} must be in (0, 1]",
            retryable=False,
        )
    if not request.prompt_token_ids:
        raise BackendError(f"group {request.group_id}: empty prompt", retryable=False)
    ids = request.prompt_token_ids
    # The common case in C (a multi-turn context is checked whole at every model call):
    # plain ints within the vocabulary; anything else takes the exact check below.
    fast = set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size
    bad = [] if fast else [t for t in ids if not (_is_int(t) and 0 <= t < vocab_size)]
    if bad:
        raise BackendError(
            f"group {request.group_id}: prompt token ids {bad[:5]} outside [0, {vocab_size})",
            retryable=False,
        )
    if len(request.prompt_token_ids) + request.sampling.max_tokens > max_model_len:
        raise BackendError(
            f"group {request.group_id}: prompt of {len(request.prompt_token_ids)} tokens plus "
            f"max_tokens {request.sampling.max_tokens} exceeds max_model_len {max_model_len}",
            retryable=False,
        )
    seen = [s.sibling for s in request.siblings]
    if len(set(seen)) != len(seen):
        raise BackendError(f"group {request.group_id}: duplicate siblings {seen}", retryable=False)


def validate_results(
    request: GroupRequest, results: Sequence[SiblingResult], vocab_size: int
) -> list[SiblingResult]:
    """The result half of the contract. Raises :class:`MalformedResultError` naming the defect."""
    if len(results) != len(request.siblings):
        raise MalformedResultError(
            f"group {request.group_id}: asked for {len(request.siblings)} siblings, "
            f"backend returned {len(results)}"
        )
    for spec, res in zip(request.siblings, results, strict=True):
        who = f"group {request.group_id} sibling {spec.sibling} attempt {spec.attempt}"
        if (res.group_id, res.sibling, res.attempt) != (
            request.group_id,
            spec.sibling,
            spec.attempt,
        ):
            raise MalformedResultError(
                f"{who}: result is labelled group {res.group_id} sibling {res.sibling} "
                f"attempt {res.attempt}"
            )
        if not res.token_ids:
            raise MalformedResultError(f"{who}: no tokens generated")
        if len(res.token_ids) > request.sampling.max_tokens:
            raise MalformedResultError(
                f"{who}: {len(res.token_ids)} tokens exceed max_tokens "
                f"{request.sampling.max_tokens}"
            )
        ids, lps = res.token_ids, res.logprobs
        # Fast paths in C for the common case (plain ints in range; plain finite floats
        # <= 1e-6: fsum is nan or infinite when any is, or raises on overflow); anything
        # else takes the exact per-item check, which names the defect.
        if not (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size):
            for t in ids:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                    raise MalformedResultError(f"{who}: token id {t!r} outside [0, {vocab_size})")
        if len(lps) != len(ids):
            raise MalformedResultError(f"{who}: {len(lps)} logprobs for {len(ids)} tokens")
        if not _plain_logprobs(lps):
            for lp in lps:
                if not isinstance(lp, float) or not math.isfinite(lp) or lp > 1e-6:
                    raise MalformedResultError(f"{who}: logprob {lp!r} is not a finite value <= 0")
        if res.finish_reason not in ("stop", "length"):
            raise MalformedResultError(f"{who}: unknown finish_reason {res.finish_reason!r}")
        if res.weight_version < 0:
            raise MalformedResultError(f"{who}: negative weight version {res.weight_version}")
    return list(results)


def validate_weight_update(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    version: int,
    expected_shapes: Mapping[str, tuple[int, ...]] | None,
    required: Collection[str] | None = None,
) -> dict[str, torch.Tensor]:
    """The ``update_weights`` half of the contract, enforced identically by every backend.

    ``version`` must be an int >= 0. With ``expected_shapes`` (the backend's checkpoint
    names and shapes), names are strict: an unknown name, a missing one (every name in
    ``required``, default all of ``expected_shapes``) or a wrong shape is an error.
    Every name must be given once, and every value must be a finite floating-point
    tensor. Raises :class:`BackendError` (``retryable=False``) before any weight is
    touched; returns the tensors by name.
    """
    if not _is_int(version) or version < 0:
        raise BackendError(f"weight version {version!r} must be an int >= 0", retryable=False)
    try:
        import torch
    except ImportError as exc:
        raise BackendError(
            "weight updates need torch: pip install 'rolloutlog[torch]'", retryable=False
        ) from exc
    tensors: dict[str, torch.Tensor] = {}
    for item in named_tensors:
        name, tensor = item
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise BackendError(
                f"weights must be (str, torch.Tensor) pairs, got ({type(name).__name__}, "
                f"{type(tensor).__name__})",
                retryable=False,
            )
        if name in tensors:
            raise BackendError(f"weight {name!r} given twice", retryable=False)
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
            raise BackendError(
                f"weight {name!r} must be a finite floating-point tensor", retryable=False
            )
        tensors[name] = tensor
    if not tensors:
        raise BackendError("update_weights was given no tensors", retryable=False)
    if expected_shapes is not None:
        unknown = sorted(set(tensors) - set(expected_shapes))
        if unknown:
            raise BackendError(f"unknown weight names {unknown[:5]}", retryable=False)
        needed = set(expected_shapes) if required is None else set(required)
        missing = sorted(needed - set(tensors))
        if missing:
            raise BackendError(f"missing weight names {missing[:5]}", retryable=False)
        for name, tensor in tensors.items():
            want = tuple(expected_shapes[name])
            if tuple(tensor.shape) != want:
                raise BackendError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {want}",
                    retryable=False,
                )
    return tensors

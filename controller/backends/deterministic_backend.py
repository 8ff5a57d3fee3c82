"""A deterministic generation backend for tests: no model, exactly the real contract.

:class:`DeterministicBackend` derives every token id and logprob from a seeded hash
of ``(seed, group_id, sibling, attempt, weight_version)``, so a test can predict its
output, and it honours the same contract as the vLLM and torch backends: the same
request validation (:func:`~rolloutlog.controller.backends.base.validate_request`), results that
pass :func:`~rolloutlog.controller.backends.base.validate_results`, abort, weight updates that
drain in-flight requests first, and strict weight names when given the checkpoint's
shapes. On top it can inject latency, failures and malformed results (the last for
tests of the runtime's own validation — the only way it ever breaks the contract).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is the [torch] extra; only annotations need it here
    import torch


from rolloutlog.controller.backends._gate import DrainGate
from rolloutlog.controller.backends.base import (
    BackendBase,
    BackendError,
    GroupRequest,
    SiblingResult,
    SiblingSpec,
)

#: Ways :class:`DeterministicBackend` can break the result contract on purpose.
MALFORMED_MODES: tuple[str, ...] = (
    "missing_sibling",  # one result fewer than requested
    "extra_sibling",  # one result more than requested
    "wrong_label",  # a result labelled with another sibling index
    "stale_attempt",  # a result labelled with an older attempt number
    "token_out_of_vocab",  # a token id equal to vocab_size
    "logprob_count",  # one logprob fewer than tokens
    "positive_logprob",  # a logprob > 0
    "nan_logprob",  # a NaN logprob
    "too_many_tokens",  # max_tokens + 1 tokens
    "empty_tokens",  # no tokens at all
    "bad_finish_reason",  # finish_reason "abort"
)

#: A failure rule: the ``(group_id, sibling, attempt)`` triples that fail, or a callable
#: ``(request, spec) -> bool | BackendError | None`` (``True``: fail with the backend's
#: ``fail_retryable``; an exception instance: raise exactly that).
FailureRule = Collection[tuple[int, int, int]] | Callable[[GroupRequest, SiblingSpec], object]


def _seed(*parts: object) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


class DeterministicBackend(BackendBase):
    """A model-free backend whose output is a pure function of the request and version.

    Token ids are drawn in ``[0, vocab_size)`` (never ``eos_token_id`` except as the
    last token of a ``"stop"`` result); the length is in ``[1, max_tokens]``; logprobs
    are negative floats. A sibling's output depends only on ``(seed, group_id, sibling,
    attempt, weight_version)``, so a new attempt or new weights give new output (at
    temperature 0 it ignores sibling and attempt: greedy decoding is the same for all).

    Args:
        vocab_size: token ids are in ``[0, vocab_size)``.
        max_model_len: prompt plus ``max_tokens`` may not exceed it.
        eos_token_id: if set, a result shorter than ``max_tokens`` ends with it.
        seed: mixed into every hash.
        latency: seconds each ``generate`` sleeps (or a callable of the request); abort
            interrupts the sleep.
        fail: a :data:`FailureRule`; a matching sibling fails the whole request after
            the latency, as a real engine error would.
        fail_retryable: ``retryable`` of injected failures given as ``True``/triples.
        malformed: one of :data:`MALFORMED_MODES`, or a callable of the request
            returning a mode or ``None``; the results then skip validation.
        weight_shapes: checkpoint names and shapes; when given, ``update_weights`` is as
            strict about names and shapes as the real backends.
        weight_version: the initial weight version.
        script: ``script(request, spec)`` returns the token ids a sibling generates (cut
            to ``max_tokens``), or None for the seeded draw: multi-turn tests script
            what the model answers to each context (``request.prompt_token_ids``).
            Logprobs stay seeded; the results are checked like any other.
    """

    name = "deterministic"
    label = "deterministic backend"

    def __init__(
        self,
        *,
        vocab_size: int = 64,
        max_model_len: int = 128,
        eos_token_id: int | None = None,
        seed: int = 0,
        latency: float | Callable[[GroupRequest], float] = 0.0,
        fail: FailureRule | None = None,
        fail_retryable: bool = True,
        malformed: str | Callable[[GroupRequest], str | None] | None = None,
        weight_shapes: Mapping[str, Sequence[int]] | None = None,
        weight_version: int = 0,
        script: Callable[[GroupRequest, SiblingSpec], Sequence[int] | None] | None = None,
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size {vocab_size} must be >= 2")
        if eos_token_id is not None and not 0 <= eos_token_id < vocab_size:
            raise ValueError(f"eos_token_id {eos_token_id} outside [0, {vocab_size})")
        if isinstance(malformed, str) and malformed not in MALFORMED_MODES:
            raise ValueError(f"unknown malformed mode {malformed!r}; one of {MALFORMED_MODES}")
        super().__init__(vocab_size=vocab_size, weight_version=weight_version)
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.seed = seed
        self.latency = latency
        self.fail = fail
        self.fail_retryable = fail_retryable
        self.malformed = malformed
        self.script = script
        self._shapes = (
            None
            if weight_shapes is None
            else {name: tuple(int(d) for d in shape) for name, shape in weight_shapes.items()}
        )
        self._gate = DrainGate()
        self._started = False
        #: Every request accepted by ``generate`` (after validation), in arrival order.
        self.requests: list[GroupRequest] = []
        #: Every ``(version, names)`` loaded by ``update_weights``.
        self.weight_updates: list[tuple[int, tuple[str, ...]]] = []

    async def start(self) -> None:
        """Mark the backend started (``generate`` before ``start`` is an error)."""
        self._refuse_if_closed()
        self._started = True

    async def close(self) -> None:
        """Abort what is in flight and refuse further requests."""
        for group_id in list(self._inflight):
            await self.abort(group_id)
        self._closed = True

    def _check_open(self) -> None:
        self._refuse_if_closed()
        if not self._started:
            raise self._not_started()

    async def generate(self, request: GroupRequest) -> list[SiblingResult]:
        """Generate every requested sibling (see the class docstring for the rules)."""
        self._check_open()
        self._check_request(request)
        with self._tracked(request.group_id, _Running()) as run:
            async with self._gate.generating():
                self._check_open()
                if run.aborted:
                    raise self._aborted(request)
                version = self._weight_version
                self.requests.append(request)
                latency = self.latency(request) if callable(self.latency) else self.latency
                run.task = asyncio.ensure_future(asyncio.sleep(max(0.0, latency)))
                try:
                    await asyncio.wait({run.task})
                finally:
                    if not run.task.done():  # our own caller was cancelled
                        run.task.cancel()
                if run.aborted:
                    raise self._aborted(request)
                self._maybe_fail(request)
                results = [self._one(request, spec, version) for spec in request.siblings]
        mode = self.malformed(request) if callable(self.malformed) else self.malformed
        if mode is not None:
            return self._break(request, results, mode)
        return self._check_results(request, results)

    def _maybe_fail(self, request: GroupRequest) -> None:
        if self.fail is None:
            return
        for spec in request.siblings:
            if callable(self.fail):
                verdict = self.fail(request, spec)
            else:
                verdict = (request.group_id, spec.sibling, spec.attempt) in self.fail
            if isinstance(verdict, BaseException):
                raise verdict
            if verdict:
                raise BackendError(
                    f"injected failure: group {request.group_id} sibling {spec.sibling} "
                    f"attempt {spec.attempt}",
                    retryable=self.fail_retryable,
                )

    def _one(self, request: GroupRequest, spec: SiblingSpec, version: int) -> SiblingResult:
        if request.sampling.temperature == 0:  # greedy: siblings and attempts agree
            rng = random.Random(_seed(self.seed, request.group_id, "greedy", version))
        else:
            rng = random.Random(
                _seed(self.seed, request.group_id, spec.sibling, spec.attempt, version)
            )
        max_tokens = request.sampling.max_tokens
        scripted = None if self.script is None else self.script(request, spec)
        if scripted is not None:
            tokens = [int(t) for t in scripted][:max_tokens]
            logprobs = tuple(-rng.uniform(0.01, 5.0) for _ in tokens)
            finish = "length" if len(tokens) == max_tokens else "stop"
            return SiblingResult.generated(request, spec, version, tuple(tokens), logprobs, finish)
        length = rng.randint(1, max_tokens)
        choices = [t for t in range(self._vocab_size) if t != self.eos_token_id]
        tokens = [rng.choice(choices) for _ in range(length)]
        finish = "length" if length == max_tokens else "stop"
        if finish == "stop" and self.eos_token_id is not None:
            tokens[-1] = self.eos_token_id
        logprobs = tuple(-rng.uniform(0.01, 5.0) for _ in tokens)
        return SiblingResult.generated(request, spec, version, tuple(tokens), logprobs, finish)

    def _break(
        self, request: GroupRequest, results: list[SiblingResult], mode: str
    ) -> list[SiblingResult]:
        if mode not in MALFORMED_MODES:
            raise ValueError(f"unknown malformed mode {mode!r}; one of {MALFORMED_MODES}")
        first = results[0]
        if mode == "missing_sibling":
            return results[:-1]
        if mode == "extra_sibling":
            return [*results, replace(first, sibling=max(r.sibling for r in results) + 1)]
        if mode == "wrong_label":
            bad = replace(first, sibling=first.sibling + len(results))
        elif mode == "stale_attempt":
            bad = replace(first, attempt=first.attempt - 1)
        elif mode == "token_out_of_vocab":
            bad = replace(first, token_ids=(self._vocab_size, *first.token_ids[1:]))
        elif mode == "logprob_count":
            bad = replace(first, logprobs=first.logprobs[:-1])
        elif mode == "positive_logprob":
            bad = replace(first, logprobs=(0.5, *first.logprobs[1:]))
        elif mode == "nan_logprob":
            bad = replace(first, logprobs=(float("nan"), *first.logprobs[1:]))
        elif mode == "too_many_tokens":
            n = request.sampling.max_tokens + 1
            bad = replace(first, token_ids=(0,) * n, logprobs=(-1.0,) * n)
        elif mode == "empty_tokens":
            bad = replace(first, token_ids=(), logprobs=())
        else:  # bad_finish_reason
            bad = replace(first, finish_reason="abort")
        return [bad, *results[1:]]

    async def abort(self, group_id: int) -> None:
        """Abort the in-flight requests of ``group_id``; their ``generate`` raises aborted."""
        for run in self._inflight.get(group_id, []):
            run.aborted = True
            if run.task is not None:
                run.task.cancel()

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Record new weights (validated like the real backends); waits for in-flight work."""
        self._check_open()
        tensors = self._check_weights(named_tensors, version)
        async with self._gate.swapping():
            self._weight_version = version
            self.weight_updates.append((version, tuple(tensors)))


class _Running:
    """One in-flight ``generate`` call: its cancellable wait and whether it was aborted."""

    __slots__ = ("aborted", "task")

    def __init__(self) -> None:
        self.task: asyncio.Future[None] | None = None
        self.aborted = False

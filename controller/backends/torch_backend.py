"""In-process sampling from a Hugging Face causal LM with torch (no vLLM needed).

The backend owns a private copy of the policy: its weights change only through
:meth:`TorchBackend.update_weights`, so the weight version it reports is always the
version that produced the tokens. The forward passes run on one dedicated worker
thread (the event loop stays free, and model access is serialised: a weight swap
queues behind the requests submitted before it, exactly like the drain of the vLLM
backend).

**Logprobs**: each returned logprob is ``log softmax(logits)[token]`` of the raw model
output, i.e. temperature 1 and no top-p filtering, whatever ``temperature``/``top_p``
the tokens were *sampled* with. This is the same quantity vLLM returns with its
default ``logprobs_mode="raw_logprobs"``, and the one an RL trainer compares its own
logprobs against.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import hashlib
import threading
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rolloutlog.controller.backends.base import (
    BackendBase,
    BackendError,
    GroupRequest,
    SiblingResult,
    SiblingSpec,
)
from rolloutlog.controller.backends.model_loader import load_causal_lm


class _Aborted(Exception):
    pass


def sibling_seed(seed: int, request: GroupRequest, spec: SiblingSpec) -> int:
    """The sampling seed of one sibling attempt (same derivation in torch and vLLM)."""
    text = f"{seed}:{request.group_id}:{spec.sibling}:{spec.attempt}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """The token ids that end a sibling: the tokenizer's eos and the generation config's."""
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = model.generation_config  # None for a model that cannot generate
    for source in (gen, model.config):
        eos = None if source is None else source.eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        elif eos is not None:
            ids.update(int(e) for e in eos)
    return frozenset(ids)


class TorchBackend(BackendBase):
    """Samples siblings from a causal LM in-process (batched over a request's siblings).

    Args:
        policy: a local model directory (``AutoModelForCausalLM`` + ``AutoTokenizer``),
            or a ``(model, tokenizer)`` pair; a given model is deep-copied, never shared.
        device: torch device for the forward passes.
        max_model_len: longest prompt + ``max_tokens``; default and upper bound: the
            model's ``max_position_embeddings``.
        seed: mixed into each sibling's sampling seed (see :func:`sibling_seed`), so a
            request's output is reproducible and independent of batching.
        weight_version: the version of the initial weights.
        dtype: dtype of a model loaded from a directory (float32 by default: logprobs
            comparable with a float32 trainer).
    """

    name = "torch"
    label = "torch backend"

    def __init__(
        self,
        policy: str | Path | tuple[PreTrainedModel, PreTrainedTokenizerBase],
        *,
        device: str | torch.device = "cpu",
        max_model_len: int | None = None,
        seed: int = 0,
        weight_version: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.device = torch.device(device)
        if isinstance(policy, tuple):
            model, tokenizer = policy
            model = copy.deepcopy(model)
        else:
            # The generic loader: any local causal LM directory (weights + tokenizer).
            model, tokenizer = load_causal_lm(policy, dtype=dtype)
        # transformers' stubs type `to` through a decorator that loses its arguments.
        self._model: PreTrainedModel = model.to(self.device).eval().requires_grad_(False)  # type: ignore[arg-type]
        self.tokenizer = tokenizer
        limit = int(self._model.config.max_position_embeddings)
        self.max_model_len = limit if max_model_len is None else int(max_model_len)
        if not 1 < self.max_model_len <= limit:
            raise ValueError(
                f"max_model_len {self.max_model_len} must be in (1, {limit}] "
                "(the model's max_position_embeddings)"
            )
        super().__init__(
            vocab_size=int(self._model.config.vocab_size), weight_version=weight_version
        )
        self._eos = _eos_ids(self._model, tokenizer)
        self.seed = seed
        state = self._model.state_dict()
        self._shapes = {name: tuple(t.shape) for name, t in state.items()}
        # Tied weights appear under several state_dict names but are one parameter.
        self._required = {name for name, _ in self._model.named_parameters()}
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    async def start(self) -> None:
        """Start the worker thread."""
        self._refuse_if_closed()
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="rolloutlog-torch-backend"
            )

    async def close(self) -> None:
        """Abort what is in flight and stop the worker thread."""
        for events in self._inflight.values():
            for event in events:
                event.set()
        self._closed = True
        if self._executor is not None:
            executor, self._executor = self._executor, None
            await asyncio.to_thread(executor.shutdown, wait=True)

    def _check_open(self) -> concurrent.futures.ThreadPoolExecutor:
        self._refuse_if_closed()
        if self._executor is None:
            raise self._not_started()
        return self._executor

    async def generate(self, request: GroupRequest) -> list[SiblingResult]:
        """Sample every requested sibling; results in the order of ``request.siblings``."""
        executor = self._check_open()
        self._check_request(request)
        with self._tracked(request.group_id, threading.Event()) as stop:
            try:
                loop = asyncio.get_running_loop()
                results = await loop.run_in_executor(executor, self._sample, request, stop)
            except _Aborted:
                raise self._aborted(request) from None
            except asyncio.CancelledError:
                stop.set()  # the worker stops at its next token
                raise
            except BackendError:
                raise
            except Exception as exc:
                raise BackendError(
                    f"group {request.group_id}: torch sampling failed: {type(exc).__name__}: {exc}",
                    retryable=True,
                ) from exc
        return self._check_results(request, results)

    def _sample(self, request: GroupRequest, stop: threading.Event) -> list[SiblingResult]:
        """Runs on the worker thread: batched sampling with a KV cache."""
        with self._lock, torch.inference_mode():
            if stop.is_set():
                raise _Aborted
            version = self._weight_version
            sampling = request.sampling
            n = len(request.siblings)
            generators = [
                torch.Generator(device=self.device).manual_seed(
                    sibling_seed(self.seed, request, spec)
                )
                for spec in request.siblings
            ]
            input_ids = torch.tensor(
                [list(request.prompt_token_ids)] * n, dtype=torch.long, device=self.device
            )
            tokens: list[list[int]] = [[] for _ in range(n)]
            logprobs: list[list[float]] = [[] for _ in range(n)]
            finish: list[str | None] = [None] * n
            past = None
            for _ in range(sampling.max_tokens):
                if stop.is_set():
                    raise _Aborted
                out = self._model(input_ids=input_ids, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[:, -1, :].float()
                raw = torch.log_softmax(logits, dim=-1)
                nxt: list[int] = []
                for i in range(n):
                    if finish[i] is not None:  # finished rows are fed along and ignored
                        nxt.append(tokens[i][-1])
                        continue
                    tok = self._pick(logits[i], sampling.temperature, sampling.top_p, generators[i])
                    tokens[i].append(tok)
                    logprobs[i].append(float(raw[i, tok]))
                    if tok in self._eos:
                        finish[i] = "stop"
                    elif len(tokens[i]) == sampling.max_tokens:
                        finish[i] = "length"
                    nxt.append(tok)
                if all(f is not None for f in finish):
                    break
                input_ids = torch.tensor(nxt, dtype=torch.long, device=self.device).unsqueeze(1)
        return [
            SiblingResult.generated(
                request, spec, version, tuple(tokens[i]), tuple(logprobs[i]), finish[i] or "length"
            )
            for i, spec in enumerate(request.siblings)
        ]

    @staticmethod
    def _pick(
        logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
    ) -> int:
        """Sample one token: greedy at temperature 0, else softmax(logits / T) with top-p."""
        if temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            sorted_probs = torch.where(before < top_p, sorted_probs, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=generator))

    async def abort(self, group_id: int) -> None:
        """Abort the in-flight requests of ``group_id`` (they stop at their next token)."""
        for event in self._inflight.get(group_id, []):
            event.set()

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Copy named tensors into the model (strict names and shapes), then set ``version``.

        Runs on the worker thread after the requests submitted before it; requests
        submitted afterwards are served with the new weights and report ``version``.
        """
        executor = self._check_open()
        tensors = self._check_weights(named_tensors, version)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(executor, self._load, tensors, version)

    def _load(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        with self._lock, torch.no_grad():
            state = self._model.state_dict(keep_vars=True)
            for name, tensor in tensors.items():
                target = state[name]
                target.data.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))
            self._weight_version = version

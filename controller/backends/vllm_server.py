"""Generation on ONE OpenAI-compatible vLLM server over HTTP (``[fleet]`` extra: httpx).

The server is ``python -m vllm.entrypoints.openai.api_server`` started with
``VLLM_SERVER_DEV_MODE=1`` (for ``/abort_requests``, ``/collective_rpc`` and
``/reset_prefix_cache``). What this client uses of it (vLLM 0.32):

- ``POST /v1/completions`` with ``prompt`` as a list of token ids, ``logprobs: 0``
  (the sampled token's raw logprob, vLLM's default ``raw_logprobs`` mode, the same
  quantity as the in-process backends), ``return_token_ids: true`` (the response's
  ``choices[0].token_ids``), ``seed`` (per sibling, :func:`sibling_seed`) and the
  header ``X-Request-Id``. The server names the request ``cmpl-{X-Request-Id}-0``
  inside its engine; that is the id ``/abort_requests`` takes.
- ``POST /abort_requests`` (dev mode; ``/inference/v1/abort_requests`` otherwise) to
  abort a sibling, in addition to closing its HTTP request (the server aborts a
  request whose client disconnects).
- ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``
  to load new weights from a directory of safetensors written by the trainer (the
  weight update that works on the CPU), then ``POST /reset_prefix_cache``, then
  ``POST /update_weight_version`` (the engine's weight tag, ``rolloutlog-v{version}``)
  read back with ``GET /weight_info``. With :attr:`check_tag_after_serving` (a fleet's
  engines) the tag is read again after each group is served: results from an engine
  another client has loaded other weights into are discarded.
- ``GET /health`` (liveness), ``GET /v1/models`` (``max_model_len``).

Errors: a transport error or timeout is :class:`EngineTransportError` (retryable: a new
attempt, on this or another engine, may succeed); an HTTP 4xx is a non-retryable
:class:`BackendError` and is never retried; a 5xx is retryable.

Weight updates are not idempotent from the client's point of view: a call whose
outcome is unknown (timeout, dropped connection, 5xx) leaves the engine's weights
*unknown* (:attr:`VLLMServerBackend.weights_known` is False), and the backend refuses to
generate until :meth:`VLLMServerBackend.load_weights_dir` succeeds. Nothing is retried
blindly. Each load is tagged with its version: the directory's name and manifest
``rolloutlog_weights.json`` (checked before the call) and the engine's own weight tag
(set and read back after it). A restarted engine reports vLLM's start-up tag again,
so :meth:`VLLMServerBackend.verify_weights` tells a restart from a network blip.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import math
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from rolloutlog.controller.backends._gate import DrainGate
from rolloutlog.controller.backends.base import (
    BackendAbortedError,
    BackendBase,
    BackendError,
    BackendUnavailableError,
    FixedRetryError,
    GroupRequest,
    SiblingResult,
    SiblingSpec,
)
from rolloutlog.controller.backends.torch_backend import sibling_seed

#: The manifest written next to the weights of one version.
MANIFEST = "rolloutlog_weights.json"
#: The weight version tag a vLLM engine reports before anyone set one.
STARTUP_TAG = "default"
#: The tag an engine carries while a load is under way (followed by the loading client's
#: nonce and a counter: unique per load): a load cut short (the trainer killed between
#: the reload and the tag) leaves it, never a tag naming other weights.
LOADING_TAG = "rolloutlog-loading"
_TAG = re.compile(r"^rolloutlog-v(\d+)-([0-9a-f]{16})$")


def weight_tag(version: int, fingerprint: str) -> str:
    """The tag an engine carries (``/update_weight_version``) once it holds ``version``,
    whose tensors hash to ``fingerprint`` (:func:`weights_fingerprint`)."""
    return f"rolloutlog-v{version}-{fingerprint}"


def parse_weight_tag(tag: str | None) -> tuple[int, str] | None:
    """``(version, fingerprint)`` of a tag set by :func:`weight_tag`, else None."""
    match = _TAG.match(tag or "")
    return None if match is None else (int(match.group(1)), match.group(2))


def weights_fingerprint(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> str:
    """A content hash of named tensors as an engine loads them (cast to ``dtype``).

    Names, dtypes, shapes and bytes in name order: two runs' weight version 3 differ,
    the same weights written twice do not. 16 hex digits (blake2b, 8 bytes).
    """
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(tensors):
        t = tensors[name].detach().to(device="cpu", dtype=dtype).contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def model_dir_fingerprint(model_dir: Path, dtype: torch.dtype) -> str:
    """:func:`weights_fingerprint` of a model directory's safetensors checkpoint."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise BackendUnavailableError(f"{model_dir}: no *.safetensors to fingerprint")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return weights_fingerprint(tensors, dtype)


class EngineTransportError(FixedRetryError, retryable=True):
    """The engine could not be reached, or did not answer in time (retryable)."""


def _httpx() -> Any:
    try:
        import httpx
    except ImportError as exc:  # the [fleet] extra is not installed
        raise BackendUnavailableError(
            "httpx is not importable; install the fleet extra: pip install 'rolloutlog[fleet]'"
        ) from exc
    return httpx


def write_weights_dir(
    tensors: Mapping[str, torch.Tensor], version: int, root: Path, dtype: torch.dtype
) -> Path:
    """Write one version's tensors as ``root/v{version}-{nonce}/model.safetensors``.

    The directory is written under a temporary name and renamed into place, so an
    engine never reads a half-written checkpoint. A manifest records the version and
    the tensors' :func:`weights_fingerprint`.
    """
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    final = root / f"v{version}-{uuid.uuid4().hex[:8]}"
    tmp = root / f".tmp-{final.name}"
    tmp.mkdir()
    cast = {
        name: t.detach().to(device="cpu", dtype=dtype).contiguous().clone()
        for name, t in tensors.items()
    }
    save_file(cast, str(tmp / "model.safetensors"))
    manifest = {
        "version": version,
        "tensors": len(cast),
        "fingerprint": weights_fingerprint(cast, dtype),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest))
    os.replace(tmp, final)
    return final


def read_manifest(weights_dir: Path) -> tuple[int, str | None]:
    """``(version, fingerprint)`` a weights directory was written for (clear error if none)."""
    manifest = Path(weights_dir) / MANIFEST
    try:
        doc = json.loads(manifest.read_text())
        fingerprint = doc.get("fingerprint")
        return int(doc["version"]), None if fingerprint is None else str(fingerprint)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BackendError(
            f"{weights_dir}: not a rolloutlog weights directory ({MANIFEST} unreadable: {exc})",
            retryable=False,
        ) from exc


class VLLMServerBackend(BackendBase):
    """The :class:`~rolloutlog.controller.backends.base.GenerationBackend` of one vLLM HTTP server.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8100``.
        model_dir: a local copy of the served model (vocabulary size and the
            checkpoint's weight names and shapes, for the strict weight checks). Without
            it give ``vocab_size`` (and optionally ``weight_shapes``).
        max_model_len: longest prompt + ``max_tokens``; default: the server's.
        seed: mixed into each sibling's sampling seed (as in the other backends).
        weight_version: the version of the weights the server was started with.
        weights_root: where :meth:`update_weights` writes each version's weights; the
            server must read the same path (a shared filesystem for remote engines).
            Default: a temporary directory removed by :meth:`close`.
        request_timeout: seconds one sibling's completion may take.
        control_timeout: seconds a weight reload or an abort may take.
        health_timeout: seconds one ``/health`` probe may take.
        engine_id: the name results carry in ``engine_id`` (default: the URL).
        transport: an httpx transport (tests, in-process fake engines).
    """

    name = "vllm-server"

    def __init__(
        self,
        base_url: str,
        *,
        model_dir: str | Path | None = None,
        max_model_len: int | None = None,
        vocab_size: int | None = None,
        weight_shapes: Mapping[str, tuple[int, ...]] | None = None,
        seed: int = 0,
        weight_version: int = 0,
        weights_root: str | Path | None = None,
        request_timeout: float = 120.0,
        control_timeout: float = 120.0,
        health_timeout: float = 5.0,
        keepalive_expiry: float = 2.0,
        dtype: str = "float32",
        engine_id: str | None = None,
        transport: Any = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.engine_id = engine_id or self.base_url
        self.model_dir = None if model_dir is None else Path(model_dir)
        self.max_model_len = 0 if max_model_len is None else int(max_model_len)
        self._requested_max_model_len = max_model_len
        super().__init__(
            vocab_size=0 if vocab_size is None else int(vocab_size), weight_version=weight_version
        )
        self._shapes: dict[str, tuple[int, ...]] | None = (
            None if weight_shapes is None else dict(weight_shapes)
        )
        self.seed = seed
        self.request_timeout = request_timeout
        self.control_timeout = control_timeout
        self.health_timeout = health_timeout
        if not keepalive_expiry > 0:
            raise ValueError(f"keepalive_expiry must be > 0 seconds, got {keepalive_expiry}")
        # Idle pooled connections are dropped before the server drops them: vLLM's server
        # closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s), httpx's default
        # expiry is also 5 s, and a request sent on a connection the server is closing
        # just then fails with ReadError (seen once in CI, on a fleet engine).
        self.keepalive_expiry = keepalive_expiry
        self._torch_dtype: torch.dtype = getattr(torch, dtype)
        self._startup_version = weight_version
        self._weights_known = True
        #: Fingerprint of the weights this client loaded (None: the start-up weights).
        self._fingerprint: str | None = None
        #: The model path the server was started with (``/v1/models`` ``root``).
        self.served_root: str | None = None
        self._weights_root = None if weights_root is None else Path(weights_root)
        self._own_root = weights_root is None
        self._transport = transport
        self._client: Any = None
        self._model_name: str | None = None
        self._gate = DrainGate()
        #: Whether the server keeps a weight tag (``/weight_info`` 200); None: not asked yet.
        self._tags_supported: bool | None = None
        #: Read the engine's weight tag after each ``generate`` and discard the results if
        #: it no longer names the weights this client loaded (the fleet turns it on).
        self.check_tag_after_serving = False
        self._nonce = uuid.uuid4().hex[:8]
        self._ids = itertools.count()
        self._written: list[Path] = []

    # --- properties ----------------------------------------------------------------

    @property
    def label(self) -> str:  # type: ignore[override]
        """How errors name this backend: by its engine."""
        return f"{self.engine_id}: backend"

    @property
    def weights_known(self) -> bool:
        """False after a weight load whose outcome is unknown (the engine must be refit)."""
        return self._weights_known

    @property
    def outstanding(self) -> int:
        """Sibling requests in flight on this server (the fleet's routing load)."""
        return sum(len(run.tasks) for runs in self._inflight.values() for run in runs)

    @property
    def weight_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """The checkpoint's weight names and shapes (strict weight checks), if known."""
        return self._shapes

    def _weights_lost(self, message: str) -> BackendError:
        """Mark the weights unknown after a load whose outcome is unknown; the error to
        raise (not retryable: the engine must be refit first)."""
        self._weights_known = False
        return BackendError(f"{self.engine_id}: {message}", retryable=False)

    def forget_weights(self) -> None:
        """Mark the server's weights unknown (it may have restarted): refit before serving."""
        self._weights_known = False

    def in_flight_request_ids(self) -> list[str]:
        """The sibling request ids (``g{group}-s{sibling}-a{attempt}``) in flight."""
        return [rid for runs in self._inflight.values() for run in runs for rid in run.ids]

    # --- life cycle ----------------------------------------------------------------

    async def start(self) -> None:
        """Connect: the server must answer ``/health`` and ``/v1/models`` in time."""
        self._refuse_if_closed()
        if self._client is not None:
            return
        httpx = _httpx()
        if self.model_dir is not None:
            from rolloutlog.controller.backends.vllm_backend import checkpoint_shapes

            config_file = self.model_dir / "config.json"
            if not config_file.is_file():
                raise BackendUnavailableError(f"no model at {self.model_dir} (config.json missing)")
            config = json.loads(config_file.read_text())
            self._vocab_size = self._vocab_size or int(config["vocab_size"])
            if self._shapes is None:
                self._shapes = checkpoint_shapes(self.model_dir)
        if self._vocab_size <= 0:
            raise BackendUnavailableError(f"{self.engine_id}: give model_dir or vocab_size")
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            transport=self._transport,
            timeout=httpx.Timeout(self.request_timeout, connect=self.health_timeout),
            limits=httpx.Limits(
                max_connections=None,
                max_keepalive_connections=256,
                keepalive_expiry=self.keepalive_expiry,
            ),
        )
        try:
            if not await self.check_health():
                raise BackendUnavailableError(f"{self.engine_id}: /health did not answer 200")
            models = await self._client.get("/v1/models", timeout=self.health_timeout)
        except (httpx.TransportError, httpx.TimeoutException) as exc:
            await self._drop_client()
            raise BackendUnavailableError(
                f"{self.engine_id}: cannot reach the server: {type(exc).__name__}: {exc}"
            ) from exc
        except BackendUnavailableError:
            await self._drop_client()
            raise
        if models.status_code != 200:
            await self._drop_client()
            raise BackendUnavailableError(
                f"{self.engine_id}: /v1/models answered {models.status_code}"
            )
        data = models.json().get("data") or [{}]
        self._model_name = data[0].get("id")
        root = data[0].get("root")
        self.served_root = None if root is None else str(root)
        served = data[0].get("max_model_len")
        if self._requested_max_model_len is None:
            if not isinstance(served, int):
                await self._drop_client()
                raise BackendUnavailableError(
                    f"{self.engine_id}: server reports no max_model_len; give max_model_len"
                )
            self.max_model_len = served
        elif isinstance(served, int) and served < self.max_model_len:
            await self._drop_client()
            raise BackendUnavailableError(
                f"{self.engine_id}: server max_model_len {served} < configured {self.max_model_len}"
            )

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def check_health(self, timeout: float | None = None) -> bool:
        """One ``/health`` probe with a deadline: True on 200, False otherwise."""
        httpx = _httpx()
        client = self._client_or_raise()
        try:
            resp = await client.get("/health", timeout=timeout or self.health_timeout)
        except (httpx.TransportError, httpx.TimeoutException):
            return False
        return bool(resp.status_code == 200)

    async def close(self) -> None:
        """Abort what is in flight, close the HTTP client, remove our weight copies."""
        for group_id in list(self._inflight):
            await self.abort(group_id)
        self._closed = True
        await self._drop_client()
        if self._own_root and self._weights_root is not None:
            shutil.rmtree(self._weights_root, ignore_errors=True)

    def _client_or_raise(self) -> Any:
        self._refuse_if_closed()
        if self._client is None:
            raise self._not_started()
        return self._client

    # --- generation ----------------------------------------------------------------

    async def generate(self, request: GroupRequest) -> list[SiblingResult]:
        """One completion per sibling; results in the order of ``request.siblings``."""
        return await self.generate_at(request, None)

    async def generate_at(self, request: GroupRequest, version: int | None) -> list[SiblingResult]:
        """Generate only if the server holds weight ``version`` (``None``: whatever it holds).

        The fleet calls this with the version a sibling is dispatched with; a server
        holding other (or unknown) weights raises :class:`EngineStaleError` before
        anything is sent.
        """
        client = self._client_or_raise()
        self._check_request(request)
        with self._tracked(request.group_id, _Running()) as run:
            async with self._gate.generating():
                self._client_or_raise()
                if run.aborted:
                    raise self._aborted(request)
                if not self._weights_known:
                    raise EngineStaleError(
                        f"{self.engine_id}: weights unknown after a failed load; refit first"
                    )
                if version is not None and version != self._weight_version:
                    raise EngineStaleError(
                        f"{self.engine_id}: holds weight version {self._weight_version}, "
                        f"request needs {version}"
                    )
                served = self._weight_version
                for spec in request.siblings:
                    run.ids.append(f"{request.request_id(spec)}-{self._nonce}-{next(self._ids)}")
                run.tasks = [
                    asyncio.ensure_future(self._one(client, request, spec, rid, served))
                    for spec, rid in zip(request.siblings, run.ids, strict=True)
                ]
                try:
                    await asyncio.wait(run.tasks, return_when=asyncio.FIRST_EXCEPTION)
                finally:
                    pending = [t for t in run.tasks if not t.done()]
                    for task in pending:
                        task.cancel()  # closes the HTTP request; the server aborts it
                    if pending:
                        await asyncio.gather(*pending, return_exceptions=True)
                        await self._abort_on_server(
                            [rid for t, rid in zip(run.tasks, run.ids, strict=True) if t in pending]
                        )
                # Retrieve every failure (several siblings may fail at once, e.g. when the
                # engine dies), so none is reported as "never retrieved".
                failures = [t.exception() for t in run.tasks if not t.cancelled()]
                if run.aborted:
                    raise self._aborted(request)
                for failure in failures:  # a real failure first, then cancellations
                    if failure is not None:
                        raise failure
                if any(task.cancelled() for task in run.tasks):
                    raise self._aborted(request)
                results = [task.result() for task in run.tasks]
                if self.check_tag_after_serving:
                    await self._check_tag_after_serving(request)
        results = self._check_results(request, results)
        return [replace(r, engine_id=self.engine_id) for r in results]

    def _completion_body(self, prompt: Sequence[int], **fields: Any) -> dict[str, Any]:
        """A ``/v1/completions`` body for one sequence of token ids, answered with token
        ids, addressed to the served model once it is known."""
        body: dict[str, Any] = {
            "prompt": list(prompt),
            "return_token_ids": True,
            "n": 1,
            "stream": False,
            **fields,
        }
        if self._model_name is not None:
            body["model"] = self._model_name
        return body

    async def _one(
        self, client: Any, request: GroupRequest, spec: SiblingSpec, rid: str, version: int
    ) -> SiblingResult:
        httpx = _httpx()
        sampling = request.sampling
        body = self._completion_body(
            request.prompt_token_ids,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sibling_seed(self.seed, request, spec),
            logprobs=0,
        )
        who = f"{self.engine_id} {rid}"
        try:
            resp = await client.post(
                "/v1/completions",
                json=body,
                headers={"X-Request-Id": rid},
                timeout=self.request_timeout,
            )
        except httpx.TimeoutException as exc:
            await self._abort_on_server([rid])
            raise EngineTransportError(
                f"{who}: no answer within {self.request_timeout} s ({type(exc).__name__})"
            ) from exc
        except httpx.TransportError as exc:
            raise EngineTransportError(
                f"{who}: transport error: {type(exc).__name__}: {exc}"
            ) from exc
        if 400 <= resp.status_code < 500:
            raise BackendError(
                f"{who}: server rejected the request ({resp.status_code}): {resp.text[:300]}",
                retryable=False,
            )
        if resp.status_code != 200:
            raise BackendError(
                f"{who}: server error {resp.status_code}: {resp.text[:300]}", retryable=True
            )
        return _parse_completion(resp.json(), request, spec, version, who)

    async def abort(self, group_id: int) -> None:
        """Abort the in-flight requests of ``group_id``; their ``generate`` raises aborted."""
        ids: list[str] = []
        for run in self._inflight.get(group_id, []):
            run.aborted = True
            ids.extend(run.ids)
            for task in run.tasks:
                task.cancel()
        if ids:
            await self._abort_on_server(ids)

    async def _abort_on_server(self, rids: list[str]) -> None:
        """Best effort: the server also aborts a request whose connection closed."""
        if not rids or self._client is None:
            return
        httpx = _httpx()
        body = {"request_ids": [f"cmpl-{rid}-0" for rid in rids]}
        for path in ("/abort_requests", "/inference/v1/abort_requests"):
            try:
                resp = await self._client.post(path, json=body, timeout=self.health_timeout)
            except (httpx.TransportError, httpx.TimeoutException):
                return  # unreachable: nothing runs there any more that we wait for
            if resp.status_code != 404:
                return

    # --- weights -------------------------------------------------------------------

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Write the tensors to a versioned directory and load it (strict names).

        Waits for in-flight requests; requests arriving meanwhile wait and are served
        with the new weights.
        """
        self._client_or_raise()
        tensors = self._check_weights(named_tensors, version)
        path = write_weights_dir(tensors, version, self.weights_root(), self._torch_dtype)
        self._written.append(path)
        try:
            await self.load_weights_dir(path, version)
        finally:
            self._prune_written(keep=path)

    def weights_root(self) -> Path:
        """The directory weight versions are written under (created on first use)."""
        if self._weights_root is None:
            self._weights_root = Path(tempfile.mkdtemp(prefix="rolloutlog-weights-"))
        return self._weights_root

    def _prune_written(self, keep: Path) -> None:
        for old in [p for p in self._written if p != keep]:
            shutil.rmtree(old, ignore_errors=True)
            self._written.remove(old)

    async def load_weights_dir(
        self,
        weights_dir: str | Path,
        version: int,
        *,
        check_manifest: bool = True,
        fingerprint: str | None = None,
    ) -> None:
        """Make the server load ``weights_dir`` (written for ``version``), then tag it.

        Checked: the directory's manifest must name ``version`` (``check_manifest=False``
        for a model directory, e.g. back to the start-up weights; then ``fingerprint``
        names its weights). Drains in-flight requests first. The engine is tagged
        ``{LOADING_TAG}-{nonce}-{n}`` (unique per load) before the reload and
        :func:`weight_tag` after it, so its tag never names weights it does not hold.
        Before the final tag the engine must still carry this load's loading tag (another
        client's load meanwhile changed it). Not retried: if the outcome is unknown
        (transport error, timeout, 5xx, cancelled, another client's load) the weights
        become unknown and :class:`BackendError` is raised; call this again (a deliberate
        refit) to make the engine usable.
        """
        httpx = _httpx()
        client = self._client_or_raise()
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise BackendError(f"weight version {version!r} must be an int >= 0", retryable=False)
        if check_manifest:
            written_for, fingerprint = read_manifest(Path(weights_dir))
        else:
            written_for = version
        if written_for != version:
            raise BackendError(
                f"{weights_dir} holds weight version {written_for}, not {version}",
                retryable=False,
            )
        body = {
            "method": "reload_weights",
            "kwargs": {"weights_path": str(weights_dir)},
            "timeout": self.control_timeout,
        }
        async with self._gate.swapping():
            try:
                loading = f"{LOADING_TAG}-{self._nonce}-{next(self._ids)}"
                tagged = await self._set_tag(client, loading)
                resp = await client.post(
                    "/collective_rpc", json=body, timeout=self.control_timeout + 5
                )
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                raise self._weights_lost(
                    f"weight load of version {version} has an unknown "
                    f"outcome ({type(exc).__name__}: {exc}); refit before serving",
                ) from exc
            except BaseException:  # cancelled (the engine was given up): outcome unknown
                self._weights_known = False
                raise
            if 400 <= resp.status_code < 500:  # refused before anything was loaded
                if tagged:  # the weights did not change: neither does the tag
                    await self._restore_tag(client)
                raise BackendError(
                    f"{self.engine_id}: weight load of version {version} refused "
                    f"({resp.status_code}): {resp.text[:300]} (is VLLM_SERVER_DEV_MODE=1 set?)",
                    retryable=False,
                )
            if resp.status_code != 200:
                raise self._weights_lost(
                    f"weight load of version {version} failed "
                    f"({resp.status_code}): {resp.text[:300]}; refit before serving",
                )
            try:
                await self._reset_prefix_cache(client, version)
                await self._tag(client, version, fingerprint, loading if tagged else None)
            except BaseException:
                self._weights_known = False
                raise
            self._weight_version = version
            self._fingerprint = fingerprint
            self._weights_known = True

    async def _set_tag(self, client: Any, tag: str) -> bool:
        """Set the engine's weight tag; False if the server has no tag endpoint (404).

        Part of a weight load: it may take as long as one (``control_timeout``); a
        timeout would leave the weights unknown.
        """
        resp = await client.post(
            "/update_weight_version", json={"new_version": tag}, timeout=self.control_timeout
        )
        if resp.status_code == 404:
            return False
        if resp.status_code != 200:
            raise BackendError(
                f"{self.engine_id}: could not set the weight tag ({resp.status_code}): "
                f"{resp.text[:300]}",
                retryable=False,
            )
        return True

    async def _restore_tag(self, client: Any) -> None:
        """Best effort: the tag of the weights still held, after a refused load."""
        if not self._weights_known:
            return
        tag = (
            STARTUP_TAG
            if self._fingerprint is None
            else weight_tag(self._weight_version, self._fingerprint)
        )
        httpx = _httpx()
        try:
            await self._set_tag(client, tag)
        except (httpx.TransportError, httpx.TimeoutException, BackendError):
            self._weights_known = False

    async def _tag(
        self, client: Any, version: int, fingerprint: str | None, loading: str | None
    ) -> None:
        """Tag the engine with ``version`` and ``fingerprint`` and read the tag back.

        First the engine must still carry this load's own ``loading`` tag (unique per
        load): another client that loaded other weights meanwhile set its own tag, and
        the weights are then unknown (refit), never tagged as ours.

        The tag lives in the engine process: a restarted engine reports vLLM's start-up
        tag (``"default"``) again, which is how :meth:`verify_weights` tells a restart
        from a blip, and a new run tells an engine with an earlier run's weights (another
        fingerprint) from one with its own. A server without the endpoints (404) is used
        untagged; weights without a fingerprint leave the loading tag (not identifiable).
        """
        httpx = _httpx()
        if fingerprint is None:
            return
        tag = weight_tag(version, fingerprint)
        try:
            if loading is not None:
                held = await self.served_weight_tag(self.control_timeout)
                if held != loading:
                    raise self._weights_lost(
                        f"its weight tag changed to {held!r} during the load of weight "
                        f"version {version}: another client loaded weights into it (is "
                        "another run using this engine?); refit before serving",
                    )
            if not await self._set_tag(client, tag):
                return
            held = await self.served_weight_tag(self.control_timeout)
        except (httpx.TransportError, httpx.TimeoutException) as exc:
            raise self._weights_lost(
                f"could not tag weight version {version} "
                f"({type(exc).__name__}: {exc}); refit before serving",
            ) from exc
        if held != tag:  # someone else tagged it, or it restarted
            raise self._weights_lost(
                f"weight version tag check failed after loading version "
                f"{version} (engine reports {held!r})",
            )

    async def served_weight_tag(self, timeout: float | None = None) -> str | None:
        """The weight version tag the engine reports (``GET /weight_info``), or None.

        ``timeout``: default ``health_timeout`` (the fleet's health monitor asks it).
        """
        client = self._client_or_raise()
        resp = await client.get("/weight_info", timeout=timeout or self.health_timeout)
        if resp.status_code == 404:
            self._tags_supported = False
        if resp.status_code != 200:
            return None
        self._tags_supported = True
        value = resp.json().get("weight_version")
        return None if value is None else str(value)

    @property
    def tags_supported(self) -> bool:
        """False once the server answered ``/weight_info`` with 404 (it keeps no tag)."""
        return self._tags_supported is not False

    def expected_tag(self) -> str:
        """The tag the engine carries while it holds the weights this client believes."""
        if self._fingerprint is None:
            return STARTUP_TAG
        return weight_tag(self._weight_version, self._fingerprint)

    def holds_our_weights(self, tag: str | None) -> bool:
        """Whether an engine tagged ``tag`` holds the weights this client believes it holds:
        our tag, or another client's tag for the same tensors (same fingerprint)."""
        if not self._weights_known or tag is None:
            return False
        if tag == self.expected_tag():
            return True
        parsed = parse_weight_tag(tag)
        ours = self._fingerprint
        return ours is not None and parsed is not None and parsed[1] == ours

    async def _check_tag_after_serving(self, request: GroupRequest) -> None:
        """The engine must still carry the tag of the weights the results are labelled
        with, read after it answered: a client that loads other weights into this engine
        tags it first (:data:`LOADING_TAG`), so a foreign load during or before the request
        shows here and the results are discarded (:class:`EngineStaleError`, retryable on
        another engine) instead of being recorded under a version they do not come from."""
        httpx = _httpx()
        if self._tags_supported is False:
            return
        try:  # a slow answer is no reason to discard results: the control deadline
            held = await self.served_weight_tag(self.control_timeout)
        except (httpx.TransportError, httpx.TimeoutException, ValueError) as exc:
            raise EngineTransportError(
                f"{self.engine_id}: group {request.group_id}: its weight tag could not be read "
                f"after serving ({type(exc).__name__}: {exc}); results discarded"
            ) from exc
        if held is None and not self.tags_supported:  # the server keeps no tag (404)
            return
        if self.holds_our_weights(held):
            return
        expected = self.expected_tag()
        self._weights_known = False
        raise EngineStaleError(
            f"{self.engine_id}: group {request.group_id}: its weight tag is {held!r} after "
            f"serving, not {expected!r}: another client loaded weights into it (is another run "
            "using this engine?); results discarded, refit before serving"
        )

    def assume_weights(self, version: int, fingerprint: str | None) -> None:
        """Believe the server holds ``version`` (``fingerprint``; None: the start-up
        weights): what the fleet found out by asking it (:meth:`served_weight_tag`)."""
        self._weight_version = version
        self._fingerprint = fingerprint
        self._weights_known = True

    async def verify_weights(self) -> bool:
        """Whether the engine still holds the weights this client believes it holds.

        True if its tag names our version and fingerprint (or, before any load of ours,
        is vLLM's start-up tag). On False the weights become unknown: refit before
        serving. Without tagging support, always False.
        """
        httpx = _httpx()
        try:
            held = await self.served_weight_tag()
        except (httpx.TransportError, httpx.TimeoutException, ValueError):
            held = None
        ok = self._weights_known and held is not None and held == self.expected_tag()
        if not ok:
            self._weights_known = False
        return bool(ok)

    async def prompt_logprobs(self, prompt: tuple[int, ...]) -> list[float]:
        """The engine's logprob of each prompt token after the first (teacher forcing).

        ``POST /v1/completions`` with ``prompt_logprobs: 0`` and one greedy token: the
        weight probe (:class:`~rolloutlog.controller.backends.fleet.WeightProbe`). Any
        failure is a :class:`BackendError`.
        """
        httpx = _httpx()
        client = self._client_or_raise()
        body = self._completion_body(prompt, max_tokens=1, temperature=0.0, prompt_logprobs=0)
        rid = f"probe-{self._nonce}-{next(self._ids)}"
        try:
            resp = await client.post(
                "/v1/completions",
                json=body,
                headers={"X-Request-Id": rid},
                timeout=self.control_timeout,
            )
        except (httpx.TransportError, httpx.TimeoutException) as exc:
            raise EngineTransportError(
                f"{self.engine_id}: weight probe: {type(exc).__name__}: {exc}"
            ) from exc
        if resp.status_code != 200:
            raise BackendError(
                f"{self.engine_id}: weight probe answered {resp.status_code}: {resp.text[:300]}",
                retryable=False,
            )
        try:
            rows = resp.json()["choices"][0]["prompt_logprobs"]
            return [float(rows[i][str(tok)]["logprob"]) for i, tok in enumerate(prompt) if i]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise BackendError(
                f"{self.engine_id}: weight probe: malformed prompt_logprobs "
                f"({type(exc).__name__}: {exc})",
                retryable=False,
            ) from exc

    async def _reset_prefix_cache(self, client: Any, version: int) -> None:
        """Cached KV blocks were computed with the old weights: drop them (idempotent)."""
        httpx = _httpx()
        deadline = time.monotonic() + self.control_timeout
        while True:
            try:
                resp = await client.post("/reset_prefix_cache", timeout=self.health_timeout)
                ok = resp.status_code == 200 and bool(resp.json().get("success", True))
            except (httpx.TransportError, httpx.TimeoutException, ValueError):
                ok = False
            if ok:
                return
            if time.monotonic() > deadline:
                raise self._weights_lost(
                    f"prefix cache not reset after loading version {version}; refit before serving",
                )
            await asyncio.sleep(0.05)  # blocks still held: the reset may be retried


class EngineStaleError(FixedRetryError, retryable=True):
    """The engine does not hold the weight version the request needs (retryable elsewhere)."""


def _parse_completion(
    payload: Any, request: GroupRequest, spec: SiblingSpec, version: int, who: str
) -> SiblingResult:
    """A ``/v1/completions`` response as a :class:`SiblingResult` (shape checked)."""
    try:
        choice = payload["choices"][0]
        token_ids = tuple(int(t) for t in choice["token_ids"])
        finish = choice["finish_reason"]
        raw = (choice.get("logprobs") or {}).get("token_logprobs") or []
        logprobs = tuple(-math.inf if lp is None else float(lp) for lp in raw)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise BackendError(
            f"{who}: malformed completion response ({type(exc).__name__}: {exc})",
            retryable=True,
        ) from exc
    if finish == "abort":
        raise BackendAbortedError(f"{who}: aborted by the engine")
    return SiblingResult.generated(request, spec, version, token_ids, logprobs, str(finish))


class _Running:
    """One in-flight ``generate`` call: its sibling tasks, their ids, whether aborted."""

    __slots__ = ("aborted", "ids", "tasks")

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[SiblingResult]] = []
        self.ids: list[str] = []
        self.aborted = False

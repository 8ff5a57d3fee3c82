"""A fake vLLM HTTP engine for the fleet benchmark (and its contract test): no model.

:class:`FakeEngineServer` speaks the subset of the vLLM server API that
:class:`~rolloutlog.controller.backends.vllm_server.VLLMServerBackend` uses, over real
loopback TCP on a minimal standard-library HTTP/1.1 server. Generation is delegated to a
:class:`~rolloutlog.controller.backends.deterministic_backend.DeterministicBackend`
(output a pure function of group, sibling, attempt and weight version, parsed from the
request id). Each engine serves at most ``capacity`` requests at once, each taking
``latency`` seconds.

Weights are as strict as vLLM's: ``reload_weights`` loads whatever directory it is given,
the weight tag is whatever was set last, and with ``model_dir`` it answers
``prompt_logprobs`` with real tensors. :attr:`FakeEngineServer.served_with` records the
weights' fingerprint per completion; :meth:`FakeEngineServer.pause` makes it hang (as
under SIGSTOP) until :meth:`FakeEngineServer.resume`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutlog.controller.backends.base import (
    BackendAbortedError,
    BackendError,
    GroupRequest,
    SamplingConfig,
    SiblingSpec,
)
from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend

if TYPE_CHECKING:
    from rolloutlog.controller.backends.weight_probe import ReferenceModel

_RID = re.compile(r"^g(\d+)-s(\d+)-a(\d+)(?:-|$)")


class FakeEngineServer:
    """One fake engine on ``127.0.0.1:port`` (port 0: any free port).

    Args:
        backend: the deterministic backend that generates (started by :meth:`start`).
        latency: seconds per request, or a callable of the group id.
        capacity: requests served at once (the rest queue).
        max_model_len: reported by ``/v1/models``.
        model_dir: the served model: reported as ``root`` by ``/v1/models``; its
            weights are held at start and ``prompt_logprobs`` are answered with them.
    """

    def __init__(
        self,
        backend: DeterministicBackend,
        *,
        latency: float | Callable[[int], float] = 0.0,
        capacity: int = 1_000_000,
        max_model_len: int = 128,
        port: int = 0,
        model_dir: str | Path | None = None,
    ) -> None:
        self.backend = backend
        self._startup_version = backend.weight_version
        self.model_dir = None if model_dir is None else Path(model_dir).resolve()
        self._reference: ReferenceModel | None = None
        #: Fingerprint of the weights held (None: no model, or not known).
        self.fingerprint: str | None = None
        #: ``(request id, weight version from the manifest, fingerprint)`` per completion.
        self.served_with: list[tuple[str, int, str | None]] = []
        #: Fault injection: answer reloads with 200 and keep the weights held (an engine
        #: that claims weights it does not serve; only the weight probe can tell).
        self.ignore_reloads = False
        #: Fault injection: hang (:meth:`pause`) on receiving the next reload, which then
        #: goes through once resumed (as a SIGSTOP during a load, then SIGCONT).
        self.pause_on_reload = False
        self._running = asyncio.Event()
        self._running.set()
        self.latency = latency
        self.capacity = capacity
        self.max_model_len = max_model_len
        self.port = port
        self.served = 0
        #: The weight version tag (``/update_weight_version``), vLLM's start-up value.
        self.weight_tag = "default"
        self._server: asyncio.base_events.Server | None = None
        self._slots: asyncio.Semaphore | None = None
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._conns: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        """The engine's base URL."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def listening(self) -> bool:
        """Whether the engine was started and not stopped since."""
        return self._server is not None

    @property
    def requests_in_flight(self) -> int:
        """Generation requests the engine is serving now (accepted, not yet answered)."""
        return len(self._tasks)

    async def start(self) -> None:
        """Listen on loopback."""
        await self.backend.start()
        if self.model_dir is not None and self._reference is None:
            import torch

            from rolloutlog.controller.backends.vllm_server import model_dir_fingerprint
            from rolloutlog.controller.backends.weight_probe import ReferenceModel

            self._reference = ReferenceModel(self.model_dir)
            self.fingerprint = model_dir_fingerprint(self.model_dir, torch.float32)
        self._slots = asyncio.Semaphore(self.capacity)
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    def pause(self) -> None:
        """Hang (as under SIGSTOP): connections are accepted, nothing is answered."""
        self._running.clear()

    def resume(self) -> None:
        """Answer again (as after SIGCONT): what was asked meanwhile is served now."""
        self._running.set()

    async def stop(self) -> None:
        """Stop listening and drop every connection (like a killed engine)."""
        if self._server is not None:
            self._server.close()
            for writer in list(self._conns):
                writer.transport.abort()
            await self._server.wait_closed()
            self._server = None
        for task in list(self._tasks.values()):
            task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, path, _ = line.decode("latin-1").split(" ", 2)
                headers: dict[str, str] = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    key, _, value = h.decode("latin-1").partition(":")
                    headers[key.strip().lower()] = value.strip()
                length = int(headers.get("content-length", "0"))
                body = await reader.readexactly(length) if length else b""
                await self._running.wait()
                status, payload = await self._route(method, path.split("?")[0], headers, body)
                await self._running.wait()
                data = json.dumps(payload).encode()
                writer.write(
                    f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(data)}\r\n\r\n".encode()
                    + data
                )
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return
        finally:
            self._conns.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    async def _route(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, Any]:
        if path == "/health":
            return 200, {}
        if path == "/weight_info":
            return 200, {"weight_version": self.weight_tag}
        if path == "/v1/models":
            root = "fake" if self.model_dir is None else str(self.model_dir)
            return 200, {
                "data": [{"id": "fake", "root": root, "max_model_len": self.max_model_len}]
            }
        try:
            doc = json.loads(body or b"{}")
        except ValueError:
            return 400, {"error": "invalid JSON"}
        if path == "/v1/completions":
            if doc.get("prompt_logprobs") is not None:
                return await self._prompt_logprobs(doc)
            return await self._complete(doc, headers.get("x-request-id", ""))
        if path in ("/abort_requests", "/inference/v1/abort_requests"):
            for rid in doc.get("request_ids") or []:
                task = self._tasks.get(rid.removeprefix("cmpl-").removesuffix("-0"))
                if task is not None:
                    task.cancel()
            return 200, {}
        if path == "/collective_rpc":
            return await self._rpc(doc)
        if path == "/reset_prefix_cache":
            return 200, {"success": True}
        if path == "/update_weight_version":
            self.weight_tag = str(doc.get("new_version"))
            return 200, {"success": True, "new_version": self.weight_tag}
        return 404, {"error": f"no route {path}"}

    async def _complete(self, doc: dict[str, Any], rid: str) -> tuple[int, Any]:
        match = _RID.match(rid)
        if match is None:
            return 400, {"error": f"request id {rid!r} is not g<group>-s<sibling>-a<attempt>"}
        group, sibling, attempt = (int(x) for x in match.groups())
        request = GroupRequest(
            group_id=group,
            prompt_token_ids=tuple(doc.get("prompt") or ()),
            siblings=(SiblingSpec(sibling, attempt),),
            sampling=SamplingConfig(
                max_tokens=doc.get("max_tokens", 16),
                temperature=doc.get("temperature", 1.0),
                top_p=doc.get("top_p", 1.0),
            ),
        )
        assert self._slots is not None
        async with self._slots:
            latency = self.latency(group) if callable(self.latency) else self.latency
            task = asyncio.ensure_future(self._generate(request, latency))
            self._tasks[rid] = task
            try:
                result = (await task)[0]
            except asyncio.CancelledError:
                return 200, _choice([], [], "abort")
            except BackendAbortedError:
                return 200, _choice([], [], "abort")
            except BackendError as exc:
                return (400 if not exc.retryable else 500), {"error": str(exc)}
            finally:
                self._tasks.pop(rid, None)
        self.served += 1
        self.served_with.append((rid, self.backend.weight_version, self.fingerprint))
        return 200, _choice(list(result.token_ids), list(result.logprobs), result.finish_reason)

    async def _generate(self, request: GroupRequest, latency: float) -> Any:
        if latency > 0:
            await asyncio.sleep(latency)
        await self._running.wait()  # a hung engine generates nothing
        return await self.backend.generate(request)

    async def _prompt_logprobs(self, doc: dict[str, Any]) -> tuple[int, Any]:
        if self._reference is None:
            return 400, {"error": "prompt_logprobs: this fake engine has no model_dir"}
        prompt = tuple(int(t) for t in doc.get("prompt") or ())
        if len(prompt) < 2 or max(prompt) >= self.backend.vocab_size:
            return 400, {"error": f"bad prompt for prompt_logprobs: {prompt}"}
        values = await asyncio.to_thread(self._reference.prompt_logprobs, prompt)
        rows: list[Any] = [None]
        for tok, lp in zip(prompt[1:], values, strict=True):
            rows.append({str(tok): {"logprob": lp, "rank": 1, "decoded_token": ""}})
        choice = _choice([], [], "length")
        choice["choices"][0]["prompt_logprobs"] = rows
        return 200, choice

    async def _rpc(self, doc: dict[str, Any]) -> tuple[int, Any]:
        if doc.get("method") != "reload_weights":
            return 400, {"error": f"unsupported method {doc.get('method')!r}"}
        if self.pause_on_reload:
            self.pause_on_reload = False
            self.pause()
            await self._running.wait()
        if self.ignore_reloads:
            return 200, {"results": [None]}
        path = Path((doc.get("kwargs") or {}).get("weights_path", ""))
        from safetensors.torch import load_file

        files = sorted(path.glob("*.safetensors"))
        if not files:
            return 500, {"error": f"no safetensors in {path}"}
        tensors: dict[str, Any] = {}
        for f in files:
            tensors.update(load_file(str(f)))
        manifest = path / "rolloutlog_weights.json"
        # The deterministic generator is keyed by a version: a weights directory's, or
        # the start-up one for a model directory (no manifest: the start-up weights).
        version = (
            int(json.loads(manifest.read_text())["version"])
            if manifest.is_file()
            else self._startup_version
        )
        try:
            await self.backend.update_weights(tensors.items(), version)
            if self._reference is not None:
                import torch

                from rolloutlog.controller.backends.vllm_server import weights_fingerprint

                await asyncio.to_thread(self._reference.load, tensors)
                self.fingerprint = weights_fingerprint(tensors, torch.float32)
        except (BackendError, ValueError) as exc:
            return 500, {"error": str(exc)}
        return 200, {"results": [None]}


def _choice(token_ids: list[int], logprobs: list[float], finish: str) -> dict[str, Any]:
    return {
        "choices": [
            {
                "index": 0,
                "text": "",
                "token_ids": token_ids,
                "finish_reason": finish,
                "logprobs": {"token_logprobs": logprobs},
            }
        ]
    }


async def serve_fakes(
    count: int, latency: float, capacity: int, vocab_size: int, max_model_len: int
) -> None:
    """Run ``count`` fake engines until stdin closes; print their URLs as one JSON line."""
    import sys

    servers = [
        FakeEngineServer(
            DeterministicBackend(
                vocab_size=vocab_size, max_model_len=max_model_len, eos_token_id=2
            ),
            latency=latency,
            capacity=capacity,
            max_model_len=max_model_len,
        )
        for _ in range(count)
    ]
    for server in servers:
        await server.start()
    sys.stdout.write(json.dumps([s.url for s in servers]) + "\n")
    sys.stdout.flush()
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # returns when the parent closes it
    for server in servers:
        await server.stop()


if (
    __name__ == "__main__"
):  # python -m rolloutlog.controller.backends.fake_engine COUNT LATENCY CAPACITY
    import sys

    count, latency, capacity = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    vocab, max_len = int(sys.argv[4]), int(sys.argv[5])
    asyncio.run(serve_fakes(count, latency, capacity, vocab, max_len))

"""The vLLM server client's error mapping, on a scripted HTTP transport (no server).

A 4xx is never retried and not retryable; a 5xx and transport errors are retryable;
a weight load with an unknown outcome makes the engine's weights unknown (stale) until
a deliberate refit, and is never retried by the client.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rolloutlog.controller.backends import BackendError, GroupRequest, SiblingSpec
from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.backends.fake_engine import FakeEngineServer
from rolloutlog.controller.backends.vllm_server import (
    EngineStaleError,
    EngineTransportError,
    VLLMServerBackend,
)

from .conftest import MAX_MODEL_LEN, Runner

REQUEST = GroupRequest(3, (1, 4, 5), (SiblingSpec(0, 0),))
GOOD = {
    "choices": [
        {"token_ids": [5, 2], "finish_reason": "stop", "logprobs": {"token_logprobs": [-1.0, -2.0]}}
    ]
}


def scripted(
    completions: Callable[[httpx.Request], httpx.Response],
    rpc: Callable[[httpx.Request], httpx.Response] | None = None,
) -> tuple[httpx.MockTransport, list[str]]:
    calls: list[str] = []
    tag = ["default"]

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req.url.path)
        if req.url.path == "/update_weight_version":
            tag[0] = json.loads(req.content)["new_version"]
            return httpx.Response(200, json={"success": True})
        if req.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": tag[0]})
        if req.url.path == "/health":
            return httpx.Response(200)
        if req.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 128}]})
        if req.url.path == "/v1/completions":
            return completions(req)
        if req.url.path == "/collective_rpc" and rpc is not None:
            return rpc(req)
        if req.url.path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": True})
        return httpx.Response(200, json={})

    return httpx.MockTransport(handler), calls


def client(transport: httpx.MockTransport, tiny_model_dir: Path) -> VLLMServerBackend:
    return VLLMServerBackend("http://engine", model_dir=tiny_model_dir, transport=transport)


def test_request_fields_and_result(tiny_model_dir: Path, run: Runner) -> None:
    seen: list[dict[str, Any]] = []

    def completions(req: httpx.Request) -> httpx.Response:
        seen.append({"body": json.loads(req.content), "rid": req.headers["x-request-id"]})
        return httpx.Response(200, json=GOOD)

    transport, _ = scripted(completions)
    backend = client(transport, tiny_model_dir)
    run(backend.start())
    (result,) = run(backend.generate(REQUEST))
    assert result.token_ids == (5, 2) and result.logprobs == (-1.0, -2.0)
    assert result.finish_reason == "stop" and result.engine_id == "http://engine"
    body = seen[0]["body"]
    assert body["prompt"] == [1, 4, 5] and body["logprobs"] == 0
    assert body["return_token_ids"] is True and isinstance(body["seed"], int)
    assert seen[0]["rid"].startswith("g3-s0-a0-")
    assert backend.max_model_len == 128  # read from /v1/models


@pytest.mark.parametrize(("status", "retryable"), [(400, False), (422, False), (500, True)])
def test_http_errors_map_to_retryable_or_not_and_are_never_retried(
    tiny_model_dir: Path, run: Runner, status: int, retryable: bool
) -> None:
    transport, calls = scripted(lambda req: httpx.Response(status, text="no"))
    backend = client(transport, tiny_model_dir)
    run(backend.start())
    with pytest.raises(BackendError) as raised:
        run(backend.generate(REQUEST))
    assert raised.value.retryable is retryable
    assert calls.count("/v1/completions") == 1


def test_transport_error_is_retryable(tiny_model_dir: Path, run: Runner) -> None:
    def completions(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=req)

    transport, _ = scripted(completions)
    backend = client(transport, tiny_model_dir)
    run(backend.start())
    with pytest.raises(EngineTransportError) as raised:
        run(backend.generate(REQUEST))
    assert raised.value.retryable is True


def test_request_timeout_aborts_on_the_server(tiny_model_dir: Path, run: Runner) -> None:
    async def scenario() -> None:
        server = FakeEngineServer(
            DeterministicBackend(vocab_size=55, max_model_len=MAX_MODEL_LEN),
            latency=30.0,
            max_model_len=MAX_MODEL_LEN,
        )
        assert not server.listening
        await server.start()
        assert server.listening and server.requests_in_flight == 0
        backend = VLLMServerBackend(server.url, model_dir=tiny_model_dir, request_timeout=0.3)
        try:
            await backend.start()
            pending = asyncio.ensure_future(backend.generate(REQUEST))
            deadline = asyncio.get_running_loop().time() + 10
            while server.requests_in_flight == 0 and not pending.done():
                assert asyncio.get_running_loop().time() < deadline, "the request never arrived"
                await asyncio.sleep(0.005)
            with pytest.raises(EngineTransportError, match="no answer within"):
                await pending
            assert server.requests_in_flight == 0  # the abort reached the engine
        finally:
            await backend.close()
            await server.stop()
        assert not server.listening

    run(scenario(), timeout=30)


@pytest.mark.parametrize(
    ("answer", "known_after"),
    [("4xx", True), ("5xx", False), ("drop", False)],
)
def test_weight_load_with_unknown_outcome_makes_the_engine_stale(
    tiny_model_dir: Path,
    run: Runner,
    base_weights: dict[str, torch.Tensor],
    answer: str,
    known_after: bool,
) -> None:
    rpcs: list[dict[str, Any]] = []

    def rpc(req: httpx.Request) -> httpx.Response:
        rpcs.append(json.loads(req.content))
        if answer == "drop":
            raise httpx.ReadError("connection reset", request=req)
        return httpx.Response(404 if answer == "4xx" else 500, text="no")

    transport, _ = scripted(lambda req: httpx.Response(200, json=GOOD), rpc)
    backend = client(transport, tiny_model_dir)
    run(backend.start())
    with pytest.raises(BackendError) as raised:
        run(backend.update_weights(base_weights.items(), 1))
    assert raised.value.retryable is False
    assert len(rpcs) == 1  # never retried
    assert rpcs[0]["method"] == "reload_weights"
    weights_dir = Path(rpcs[0]["kwargs"]["weights_path"])
    assert weights_dir.name.startswith("v1-")
    assert backend.weight_version == 0 and backend.weights_known is known_after
    if known_after:
        assert run(backend.generate(REQUEST))[0].weight_version == 0
    else:
        with pytest.raises(EngineStaleError):
            run(backend.generate(REQUEST))
    run(backend.close())


def test_load_weights_dir_checks_the_manifest_version(
    tiny_model_dir: Path, run: Runner, base_weights: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    from rolloutlog.controller.backends.vllm_server import read_manifest, write_weights_dir

    transport, calls = scripted(lambda req: httpx.Response(200, json=GOOD))
    backend = client(transport, tiny_model_dir)
    run(backend.start())
    path = write_weights_dir(base_weights, 4, tmp_path, torch.float32)
    with pytest.raises(BackendError, match="holds weight version 4, not 5"):
        run(backend.load_weights_dir(path, 5))
    assert "/collective_rpc" not in calls
    run(backend.load_weights_dir(path, 4))
    assert backend.weight_version == 4
    assert calls[-2:] == ["/update_weight_version", "/weight_info"]  # tagged, read back
    assert run(backend.served_weight_tag()) == f"rolloutlog-v4-{read_manifest(path)[1]}"
    assert run(backend.verify_weights()) is True


def test_idle_connections_expire_before_the_servers_keep_alive(tiny_model_dir: Path) -> None:
    """vLLM's server closes a connection idle for 5 s; the client must drop it first (a
    request sent on a connection being closed fails with ReadError), and a fleet's
    config reaches every engine's client."""
    from rolloutlog.controller.engines import FleetConfig, build_fleet

    assert VLLMServerBackend("http://engine", vocab_size=8).keepalive_expiry < 5
    with pytest.raises(ValueError, match="keepalive_expiry"):
        VLLMServerBackend("http://engine", vocab_size=8, keepalive_expiry=0)
    config = FleetConfig(urls=("http://a", "http://b"), keepalive_expiry_s=1.5)
    fleet = build_fleet(config, config.urls, model_dir=tiny_model_dir)
    assert [e.backend.keepalive_expiry for e in fleet.engines] == [1.5, 1.5]  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="keepalive_expiry_s"):
        FleetConfig(urls=("http://a",), keepalive_expiry_s=0)


def test_results_are_kept_only_while_the_engine_carries_our_tag(
    tiny_model_dir: Path, run: Runner
) -> None:
    """With ``check_tag_after_serving`` (a fleet's engines) the tag is read after each
    group: another client's tag means other weights, the results are discarded
    (retryable) and the weights are unknown; a server that keeps no tag (404) is used
    as before."""
    tags = ["default"]

    def completions(req: httpx.Request) -> httpx.Response:
        tags[0] = "rolloutlog-loading-intruder-0"  # another client loads meanwhile
        return httpx.Response(200, json=GOOD)

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": tags[0]})
        return inner.handle_request(req)

    inner, _ = scripted(completions)
    backend = client(httpx.MockTransport(handler), tiny_model_dir)
    backend.check_tag_after_serving = True
    run(backend.start())
    with pytest.raises(EngineStaleError, match="another client loaded weights into it") as raised:
        run(backend.generate(REQUEST))
    assert raised.value.retryable is True
    assert backend.weights_known is False

    untagged, _ = scripted(lambda req: httpx.Response(200, json=GOOD))

    def no_tags(req: httpx.Request) -> httpx.Response:
        if req.url.path in ("/weight_info", "/update_weight_version"):
            return httpx.Response(404)
        return untagged.handle_request(req)

    plain = client(httpx.MockTransport(no_tags), tiny_model_dir)
    plain.check_tag_after_serving = True
    run(plain.start())
    (result,) = run(plain.generate(REQUEST))
    assert result.token_ids == (5, 2) and plain.tags_supported is False

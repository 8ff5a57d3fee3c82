"""The engine fleet: routing, health, engine loss and refit.

Fast tests run on fake HTTP engines (real loopback TCP, deterministic generation); the
kill test runs on the session's two real vLLM servers: one is SIGKILLed while requests
are in flight on it, restarted, and must be refit before it serves again.
"""

from __future__ import annotations

import asyncio
import signal
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from rolloutlog.controller.backends import BackendError, GroupRequest, SamplingConfig, SiblingSpec
from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.backends.fake_engine import FakeEngineServer
from rolloutlog.controller.backends.fleet import (
    EngineHealth,
    FleetBackend,
    FleetListener,
    NoEngineError,
)
from rolloutlog.controller.backends.vllm_server import EngineStaleError, VLLMServerBackend
from rolloutlog.grpo.tiny_model import load_policy

from .conftest import MAX_MODEL_LEN, Runner, score

PROMPT = (1, *range(4, 44))


class Recorder(FleetListener):
    """Every membership callback, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.routed: list[tuple[str, int, int]] = []
        self.failed: list[tuple[str, int]] = []

    def on_engine_joined(self, engine_id: str, address: str, weight_version: int | None) -> None:
        self.events.append(("joined", engine_id, weight_version))

    def on_engine_lost(self, engine_id: str, reason: str, in_flight: Sequence[str]) -> None:
        self.events.append(("lost", engine_id, tuple(in_flight)))

    def on_engine_stale(self, engine_id: str, reason: str) -> None:
        self.events.append(("stale", engine_id))

    def on_engine_refit(self, engine_id: str, weight_version: int) -> None:
        self.events.append(("refit", engine_id, weight_version))

    def on_request_routed(self, engine_id: str, request: GroupRequest, weight_version: int) -> None:
        self.routed.append((engine_id, request.group_id, weight_version))

    def on_request_failed(self, engine_id: str, request: GroupRequest, error: BackendError) -> None:
        assert error.retryable
        self.failed.append((engine_id, request.group_id))

    def kinds(self, engine_id: str) -> list[str]:
        return [e[0] for e in self.events if e[1] == engine_id]


def request(group: int, siblings: int = 2, max_tokens: int = 8) -> GroupRequest:
    return GroupRequest(
        group_id=group,
        prompt_token_ids=PROMPT,
        siblings=tuple(SiblingSpec(s, 0) for s in range(siblings)),
        sampling=SamplingConfig(max_tokens=max_tokens),
    )


async def until(predicate: Any, timeout: float, what: str) -> None:
    """Poll ``predicate`` (sync) until true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


# --- fake engines --------------------------------------------------------------------


async def start_fakes(model_dir: Path, n: int, latency: float = 0.0) -> list[FakeEngineServer]:
    """``n`` started fake engines serving ``model_dir`` (deterministic generation)."""
    servers = []
    for _ in range(n):
        server = FakeEngineServer(
            DeterministicBackend(vocab_size=55, max_model_len=MAX_MODEL_LEN, eos_token_id=2),
            latency=latency,
            max_model_len=MAX_MODEL_LEN,
            model_dir=model_dir,
        )
        await server.start()
        servers.append(server)
    return servers


def fleet_on(
    servers: list[FakeEngineServer], model_dir: Path, recorder: Recorder, **kwargs: Any
) -> FleetBackend:
    """A fleet (not started) on ``servers``, engines ``e0``, ``e1``, ... in their order."""
    return FleetBackend(
        [
            VLLMServerBackend(s.url, model_dir=model_dir, engine_id=f"e{i}")
            for i, s in enumerate(servers)
        ],
        model_dir=model_dir,
        listener=recorder,
        **kwargs,
    )


async def _fake_fleet(
    model_dir: Path, n: int, latency: float, recorder: Recorder, **kwargs: Any
) -> tuple[list[FakeEngineServer], FleetBackend]:
    servers = await start_fakes(model_dir, n, latency)
    fleet = fleet_on(servers, model_dir, recorder, **kwargs)
    await fleet.start()
    return servers, fleet


def test_least_outstanding_routing_spreads_the_load(tiny_model_dir: Path, run: Runner) -> None:
    async def scenario() -> list[int]:
        servers, fleet = await _fake_fleet(tiny_model_dir, 3, 0.05, Recorder())
        try:
            results = await asyncio.gather(*(fleet.generate(request(g)) for g in range(30)))
            assert {r.engine_id for rs in results for r in rs} == {"e0", "e1", "e2"}
            return [s.served for s in servers]
        finally:
            await fleet.close()
            for s in servers:
                await s.stop()

    served = run(scenario())
    assert sum(served) == 60
    assert max(served) - min(served) <= 4  # 2 siblings per group: near-even


def test_lost_engine_fails_retryable_and_returns_stale_until_refit(
    tiny_model_dir: Path, run: Runner, base_weights: dict[str, torch.Tensor]
) -> None:
    recorder = Recorder()

    async def scenario() -> None:
        servers, fleet = await _fake_fleet(
            tiny_model_dir, 2, 0.5, recorder, health_interval=0.05, dead_after=2, auto_refit=False
        )
        try:
            await fleet.update_weights(base_weights.items(), 1)
            in_flight = [asyncio.ensure_future(fleet.generate(request(g))) for g in range(4)]
            await until(lambda: servers[1]._tasks, 5, "requests on e1")
            await servers[1].stop()  # the engine dies with requests in flight
            outcomes = await asyncio.gather(*in_flight, return_exceptions=True)
            failed = [o for o in outcomes if isinstance(o, BaseException)]
            assert failed and all(isinstance(o, BackendError) and o.retryable for o in failed)
            assert len(recorder.failed) == len(failed)
            assert {e for e, _ in recorder.failed} == {"e1"}
            assert {(e, g) for e, g, _ in recorder.routed} >= set(recorder.failed)
            assert all(r.engine_id == "e0" for o in outcomes if isinstance(o, list) for r in o)
            await until(lambda: fleet.health()["e1"] is EngineHealth.DEAD, 5, "e1 dead")
            after = await asyncio.gather(*(fleet.generate(request(g)) for g in range(10, 14)))
            assert {r.engine_id for rs in after for r in rs} == {"e0"}
            servers[1] = FakeEngineServer(  # a new engine on the same port: start-up weights
                DeterministicBackend(vocab_size=55, max_model_len=MAX_MODEL_LEN, eos_token_id=2),
                latency=0.5,
                max_model_len=MAX_MODEL_LEN,
                port=servers[1].port,
                model_dir=tiny_model_dir,
            )
            await servers[1].start()
            await until(lambda: fleet.health()["e1"] is EngineHealth.STALE, 5, "e1 stale")
            served = servers[1].served
            more = await asyncio.gather(*(fleet.generate(request(g)) for g in range(20, 26)))
            assert {r.engine_id for rs in more for r in rs} == {"e0"}
            assert servers[1].served == served  # nothing sent to the stale engine
            with pytest.raises(EngineStaleError):  # and it would refuse a request itself
                await fleet.engines[1].backend.generate_at(request(30), 1)
            await fleet.refit("e1")
            assert fleet.health()["e1"] is EngineHealth.HEALTHY
            assert servers[1].backend.weight_version == 1
            last = await asyncio.gather(*(fleet.generate(request(g)) for g in range(40, 50)))
            assert "e1" in {r.engine_id for rs in last for r in rs}
            assert {r.weight_version for rs in last for r in rs} == {1}
        finally:
            await fleet.close()
            for s in servers:
                await s.stop()

    run(scenario(), timeout=60)
    assert recorder.kinds("e1") == ["joined", "refit", "lost", "joined", "stale", "refit"]
    lost = next(e for e in recorder.events if e[0] == "lost")
    # Its requests fail at once (connections reset), usually before the probes declare it
    # dead; whatever it still held at its loss is among them (the order is the scheduler's).
    failed_groups = {g for e, g in recorder.failed if e == "e1"}
    assert {int(rid.split("-")[0][1:]) for rid in lost[2]} <= failed_groups


def test_a_blip_keeps_the_weights_a_restart_does_not(
    tiny_model_dir: Path, run: Runner, base_weights: dict[str, torch.Tensor]
) -> None:
    """A suspect engine that answers with our weight tag serves again without a refit."""
    recorder = Recorder()

    async def scenario() -> None:
        servers, fleet = await _fake_fleet(
            tiny_model_dir, 2, 0.0, recorder, health_interval=0.05, auto_refit=False
        )
        try:
            await fleet.update_weights(base_weights.items(), 1)
            assert servers[0].weight_tag.startswith("rolloutlog-v1-")
            fleet._suspect(fleet.engines[0], "a request timed out")  # a blip
            assert fleet.health()["e0"] is EngineHealth.SUSPECT
            await until(lambda: fleet.health()["e0"] is EngineHealth.HEALTHY, 5, "e0 healthy")
            servers[1].weight_tag = "default"  # as after a restart
            fleet._suspect(fleet.engines[1], "a request failed")
            await until(lambda: fleet.health()["e1"] is EngineHealth.STALE, 5, "e1 stale")
        finally:
            await fleet.close()
            for s in servers:
                await s.stop()

    run(scenario(), timeout=30)
    assert recorder.kinds("e0") == ["joined", "refit"]  # no stale, no second refit
    assert recorder.kinds("e1") == ["joined", "refit", "stale"]


def test_no_healthy_engine_is_a_retryable_error(tiny_model_dir: Path, run: Runner) -> None:
    async def scenario() -> None:
        servers, fleet = await _fake_fleet(
            tiny_model_dir, 1, 0.0, Recorder(), health_interval=0.05, dead_after=1
        )
        try:
            await servers[0].stop()
            await until(lambda: fleet.health()["e0"] is EngineHealth.DEAD, 5, "e0 dead")
            with pytest.raises(NoEngineError) as raised:
                await fleet.generate(request(1))
            assert raised.value.retryable is True
        finally:
            await fleet.close()

    run(scenario(), timeout=30)


def test_fleet_rejects_duplicate_engine_ids(tiny_model_dir: Path) -> None:
    engines = [VLLMServerBackend("http://127.0.0.1:1", vocab_size=55, engine_id="x")] * 2
    with pytest.raises(ValueError, match="unique"):
        FleetBackend(engines)


def test_unreachable_server_is_unavailable(run: Runner) -> None:
    backend = VLLMServerBackend("http://127.0.0.1:9", vocab_size=55, health_timeout=1.0)
    with pytest.raises(BackendError) as raised:
        run(backend.start())
    assert raised.value.retryable is False
    assert "/health" in str(raised.value) or "reach" in str(raised.value)


# --- real vLLM servers -----------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
def test_sigkill_one_vllm_engine_then_restart_and_refit(
    vllm_server_engines: Any,
    tiny_model_dir: Path,
    other_model_dir: Path,
    base_weights: dict[str, torch.Tensor],
    run: Runner,
) -> None:
    """In-flight requests on the killed engine fail retryable; the rest go to the other
    engine; the restarted engine is stale and gets nothing until refit; then it serves
    the published weights (checked by the weight probe at the refit, and by scoring).

    Once seen 1.7 nats off after the refit (issue 31): the session's other fleet
    (``vllm_fleet_session_backend``, auto-refit on then) refit the restarted engine to
    its own published weights right after this test's refit; the last load won and this
    fleet never asked again. Now that fleet does not refit, and a fleet keeps a result
    only if its engine still carries the fleet's weight tag after serving
    (test_fleet_weights.py's fake-engine tests of a foreign load)."""
    from rolloutlog.controller.backends.weight_probe import WeightProbe

    launcher = vllm_server_engines
    recorder = Recorder()
    fleet = FleetBackend(
        [
            VLLMServerBackend(
                e.url, model_dir=tiny_model_dir, max_model_len=MAX_MODEL_LEN, engine_id=e.engine_id
            )
            for e in launcher.engines
        ],
        model_dir=tiny_model_dir,
        listener=recorder,
        health_interval=0.2,
        dead_after=2,
        auto_refit=False,
        weight_probe=WeightProbe(tiny_model_dir, 1e-3),
    )
    other, _ = load_policy(other_model_dir)
    start_up, _ = load_policy(tiny_model_dir)
    run(fleet.start())
    try:
        # Publish other weights (version 1): a restarted engine (start-up weights) differs.
        run(fleet.update_weights(other.state_dict().items(), 1), timeout=120)
        victim = fleet.engines[1]

        finished_before_kill: set[int] = set()
        killed = False

        async def timed(g: int) -> Any:
            result = await fleet.generate(request(g, 4, MAX_MODEL_LEN - len(PROMPT)))
            if not killed:
                finished_before_kill.add(g)
            return result

        async def kill_with_requests_in_flight() -> list[Any]:
            nonlocal killed
            # Twelve groups of four long siblings: engine-1 holds several at once. Killed
            # as soon as it holds one (no grace period: a sleep here once let engine-1
            # finish everything it held first, and nothing was in flight to fail).
            tasks = [asyncio.ensure_future(timed(g)) for g in range(12)]
            await until(lambda: victim.backend.outstanding > 0, 30, "requests on engine-1")
            launcher.kill("engine-1", signal.SIGKILL)
            killed = True
            return list(await asyncio.gather(*tasks, return_exceptions=True))

        outcomes = run(kill_with_requests_in_flight(), timeout=180)
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        assert failed, "some requests were in flight on the killed engine"
        assert all(isinstance(o, BackendError) and o.retryable for o in failed), failed
        assert len(recorder.failed) == len(failed)  # each attributed to the killed engine
        assert {e for e, _ in recorder.failed} == {"engine-1"}
        # Only engine-0 delivers after the kill; engine-1 may have finished a group before.
        for g, o in enumerate(outcomes):
            if isinstance(o, list) and g not in finished_before_kill:
                assert {r.engine_id for r in o} == {"engine-0"}, (g, o)

        async def after_the_kill() -> set[str | None]:
            await until(lambda: victim.health is EngineHealth.DEAD, 30, "engine-1 dead")
            rs = await asyncio.gather(*(fleet.generate(request(100 + g)) for g in range(4)))
            return {r.engine_id for group in rs for r in group}

        assert run(after_the_kill(), timeout=120) == {"engine-0"}

        launcher.restart("engine-1")  # blocks until /health answers (start-up weights)

        async def stale_until_refit() -> None:
            await until(lambda: victim.health is EngineHealth.STALE, 30, "engine-1 stale")
            rs = await asyncio.gather(*(fleet.generate(request(200 + g)) for g in range(4)))
            assert {r.engine_id for group in rs for r in group} == {"engine-0"}
            with pytest.raises(EngineStaleError):
                await victim.backend.generate_at(request(299), 1)
            await fleet.refit("engine-1")

        run(stale_until_refit(), timeout=120)
        assert victim.health is EngineHealth.HEALTHY

        async def served_by_the_refit_engine() -> list[Any]:
            rs = await asyncio.gather(*(fleet.generate(request(300 + g, 2, 12)) for g in range(8)))
            return [r for group in rs for r in group if r.engine_id == "engine-1"]

        on_victim = run(served_by_the_refit_engine(), timeout=120)
        assert on_victim, "the refit engine serves again"
        decode_glitches = []
        for r in on_victim:  # the published (version 1) weights, not the start-up ones
            assert r.weight_version == 1
            # The first logprob comes from the prompt's prefill, through the prefix cache
            # reset by the refit: stale weights or stale cached KV both show here.
            want = score(other, PROMPT, r.token_ids)
            assert r.logprobs[0] == pytest.approx(want[0], abs=1e-3), (r, want)
            assert r.logprobs[0] != pytest.approx(score(start_up, PROMPT, r.token_ids[:1])[0])
            if r.logprobs != pytest.approx(want, abs=1e-3):
                decode_glitches.append((r.token_ids, r.logprobs, want))
        if decode_glitches:
            # Seen once in CI (1 of 12 sequences) and never reproduced: vLLM-CPU's decode
            # in a concurrent batch on a just-restarted engine; not this client's doing
            # (it relays the server's answer). Reported, and the engine is checked alone.
            warnings.warn(
                f"vLLM-CPU decode logprobs differ from teacher forcing in "
                f"{len(decode_glitches)}/{len(on_victim)} concurrent sequences: "
                f"{decode_glitches[:2]}",
                stacklevel=1,
            )
        # One request alone on the refit engine: every position under the published
        # weights, and none under the start-up ones.
        [alone] = run(victim.backend.generate(request(400, 1, 12)), timeout=60)
        assert alone.logprobs == pytest.approx(score(other, PROMPT, alone.token_ids), abs=1e-3)
        assert alone.logprobs != pytest.approx(score(start_up, PROMPT, alone.token_ids), abs=1e-3)
        kinds = recorder.kinds("engine-1")
        # The session's engines may hold weights an earlier test's client loaded (its own
        # version numbers): then the fleet refits them at its start ("stale", "refit"), or,
        # when the publish comes first, once to the published version.
        assert kinds[:-4] in (
            ["joined", "refit"],
            ["joined", "stale", "refit"],
            ["joined", "stale", "refit", "refit"],
        )
        assert kinds[-4:] == ["lost", "joined", "stale", "refit"]
    finally:
        # The session's other clients expect the start-up weights on both engines.
        if fleet.health()["engine-1"] is EngineHealth.HEALTHY:
            run(fleet.update_weights(base_weights.items(), 2), timeout=120)
        run(fleet.close())


def test_build_fleet_from_config(tiny_model_dir: Path, run: Runner) -> None:
    from rolloutlog.controller.engines import FleetConfig, build_fleet

    async def scenario() -> dict[str, EngineHealth]:
        servers, probe = await _fake_fleet(tiny_model_dir, 2, 0.0, Recorder())
        await probe.close()
        config = FleetConfig(urls=tuple(s.url for s in servers), health_interval_s=0.5)
        fleet = build_fleet(config, config.urls, model_dir=tiny_model_dir)
        assert isinstance(fleet, FleetBackend)
        await fleet.start()
        try:
            assert [e.engine_id for e in fleet.engines] == ["engine-0", "engine-1"]
            assert fleet.health_interval == 0.5
            return fleet.health()
        finally:
            await fleet.close()
            for s in servers:
                await s.stop()

    healthy = EngineHealth.HEALTHY
    assert run(scenario(), timeout=30) == {"engine-0": healthy, "engine-1": healthy}

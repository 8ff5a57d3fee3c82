"""A fleet of fake HTTP engines inside the training process (``backend: fake-fleet``).

The demo's fast engine-loss scenario: each engine is a
:class:`~rolloutlog.controller.backends.fake_engine.FakeEngineServer` on loopback (the
model-free deterministic generator behind vLLM's HTTP API), driven by the real
:class:`~rolloutlog.controller.backends.fleet.FleetBackend` and HTTP clients, so routing,
health, loss, re-dispatch and refit are the real code paths. :meth:`kill_and_restart`
drops one engine's connections with requests in flight (as a SIGKILL would) and starts a
new one on the same port, which the fleet refits before it serves.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.backends.fake_engine import FakeEngineServer
from rolloutlog.controller.backends.fleet import EngineHealth, FleetBackend
from rolloutlog.controller.backends.vllm_server import VLLMServerBackend
from rolloutlog.controller.backends.weight_probe import WeightProbe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class InProcessFakeFleet(FleetBackend):
    """A :class:`FleetBackend` that owns ``count`` fake engines on loopback."""

    def __init__(
        self,
        count: int,
        *,
        model_dir: Path,
        vocab_size: int,
        eos_token_id: int | None,
        max_model_len: int,
        seed: int,
        latency_s: float,
        weight_version: int,
        probe_tolerance_nats: float | None = None,
    ) -> None:
        self._make = lambda port: FakeEngineServer(
            DeterministicBackend(
                vocab_size=vocab_size,
                max_model_len=max_model_len,
                eos_token_id=eos_token_id,
                seed=seed,
            ),
            latency=latency_s,
            max_model_len=max_model_len,
            port=port,
            model_dir=model_dir,
        )
        self.servers = [self._make(_free_port()) for _ in range(count)]
        super().__init__(
            [
                VLLMServerBackend(s.url, model_dir=model_dir, engine_id=f"engine-{i}")
                for i, s in enumerate(self.servers)
            ],
            model_dir=model_dir,
            weight_version=weight_version,
            health_interval=0.1,
            dead_after=2,
            weight_probe=(
                None
                if probe_tolerance_nats is None
                else WeightProbe(model_dir, probe_tolerance_nats)
            ),
        )

    async def start(self) -> None:
        """Start the engines, then the fleet."""
        for server in self.servers:
            if not server.listening:
                await server.start()
        await super().start()

    async def close(self) -> None:
        """Close the fleet, then stop the engines."""
        try:
            await super().close()
        finally:
            for server in self.servers:
                await server.stop()

    async def kill_and_restart(self, index: int, *, timeout_s: float = 30.0) -> None:
        """Kill engine ``index`` (with requests in flight when there are any within a few
        seconds), wait until the fleet declares it dead, and start a new one on its port."""
        server = self.servers[index]
        engine_id = self.engines[index].engine_id
        deadline = time.monotonic() + min(5.0, timeout_s)
        while not server.requests_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # a kill with work in flight shows the re-dispatch
        await server.stop()
        deadline = time.monotonic() + timeout_s
        while self.health()[engine_id] is not EngineHealth.DEAD:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{engine_id} was not declared dead in {timeout_s} s")
            await asyncio.sleep(0.02)
        self.servers[index] = self._make(server.port)
        await self.servers[index].start()

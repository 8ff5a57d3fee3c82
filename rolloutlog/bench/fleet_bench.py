"""``rolloutlog bench fleet``: routing overhead and scaling of the engine fleet.

Engines are :class:`~rolloutlog.controller.backends.fake_engine.FakeEngineServer` instances on
loopback TCP: each serves at most ``capacity`` requests at once, each taking a fixed
``latency``. So one engine's throughput is ``capacity / latency`` and a fleet of N can
reach N times that only if its routing spreads the load and costs little.

- **scaling**: the same offered load (``capacity`` requests in flight per engine) on a
  fleet of 1 and of ``max_engines`` engines; ``throughput_8_vs_1`` is the ratio
  (goal >= 7 for 8 engines).
- **overhead**: one request at a time on one zero-latency engine, through the plain
  :class:`~rolloutlog.controller.backends.vllm_server.VLLMServerBackend` and through a
  :class:`~rolloutlog.controller.backends.fleet.FleetBackend` over the same engine, alternating
  blocks; the difference of the medians is the fleet's per-request cost (goal <= 1 ms).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

from rolloutlog.controller.backends.base import GroupRequest, SamplingConfig, SiblingSpec
from rolloutlog.controller.backends.fleet import FleetBackend
from rolloutlog.controller.backends.vllm_server import VLLMServerBackend

VOCAB = 64
MAX_MODEL_LEN = 128


def _request(group: int) -> GroupRequest:
    return GroupRequest(
        group_id=group,
        prompt_token_ids=(1, 4, 5, 6, 7, 8),
        siblings=(SiblingSpec(0, 0),),
        sampling=SamplingConfig(max_tokens=8),
    )


class _Engines:
    """``n`` fake engines in a child process (its own process group): the engines must
    not share the fleet's event loop or CPU, as real engines do not."""

    def __init__(self, n: int, latency: float, capacity: int) -> None:
        self.args = [str(n), str(latency), str(capacity), str(VOCAB), str(MAX_MODEL_LEN)]
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> list[str]:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rolloutlog.controller.backends.fake_engine", *self.args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the child prints its URLs when listening
        if not line:
            self.__exit__()
            raise RuntimeError("the fake engines did not start")
        return list(json.loads(line))

    def __exit__(self, *exc: object) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        assert proc.stdin is not None
        proc.stdin.close()  # the child stops when its stdin closes
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _client(url: str, engine_id: str) -> VLLMServerBackend:
    return VLLMServerBackend(
        url, vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN, engine_id=engine_id
    )


async def _throughput(n: int, latency: float, capacity: int, rounds: int) -> dict[str, Any]:
    with _Engines(n, latency, capacity) as urls:
        return await _throughput_on(urls, latency, capacity, rounds)


async def _throughput_on(
    urls: list[str], latency: float, capacity: int, rounds: int
) -> dict[str, Any]:
    n = len(urls)
    fleet = FleetBackend([_client(url, f"e{i}") for i, url in enumerate(urls)])
    await fleet.start()
    try:
        total = n * capacity * rounds
        slots = asyncio.Semaphore(n * capacity)

        served: dict[str, int] = {e.engine_id: 0 for e in fleet.engines}

        async def one(g: int) -> None:
            async with slots:
                (result,) = await fleet.generate(_request(g))
                served[str(result.engine_id)] += 1

        await asyncio.gather(*(one(g) for g in range(n * capacity)))  # warm connections
        start = time.perf_counter()
        await asyncio.gather(*(one(g) for g in range(total)))
        elapsed = time.perf_counter() - start
    finally:
        await fleet.close()
    return {
        "engines": n,
        "requests": total,
        "seconds": elapsed,
        "requests_per_s": total / elapsed,
        "ideal_requests_per_s": n * capacity / latency,
        "served_per_engine": list(served.values()),
    }


async def _overhead(requests: int, blocks: int) -> dict[str, Any]:
    with _Engines(1, 0.0, 1_000_000) as (url,):
        return await _overhead_on(url, requests, blocks)


async def _overhead_on(url: str, requests: int, blocks: int) -> dict[str, Any]:
    direct = _client(url, "direct")
    fleet = FleetBackend([_client(url, "via-fleet")])
    await direct.start()
    await fleet.start()
    times: dict[str, list[float]] = {"direct": [], "fleet": []}
    try:
        for backend in (direct, fleet):  # warm up
            for g in range(20):
                await backend.generate(_request(g))
        per_block = max(1, requests // blocks)
        for _ in range(blocks):
            for name, backend in (("direct", direct), ("fleet", fleet)):
                for g in range(per_block):
                    t0 = time.perf_counter()
                    await backend.generate(_request(g))
                    times[name].append(time.perf_counter() - t0)
        picks = 20_000
        t0 = time.perf_counter()
        for _ in range(picks):
            fleet.pick(0)
        pick_s = (time.perf_counter() - t0) / picks
    finally:
        await direct.close()
        await fleet.close()
    direct_ms = statistics.median(times["direct"]) * 1e3
    fleet_ms = statistics.median(times["fleet"]) * 1e3
    return {
        "requests": len(times["direct"]),
        "direct_ms_median": direct_ms,
        "fleet_ms_median": fleet_ms,
        "overhead_ms_per_request": fleet_ms - direct_ms,
        "pick_us": pick_s * 1e6,
    }


async def run_fleet_bench(
    *,
    max_engines: int = 8,
    latency: float = 0.2,
    capacity: int = 4,
    rounds: int = 10,
    overhead_requests: int = 400,
) -> dict[str, Any]:
    """Measure scaling (1 vs ``max_engines`` engines) and the fleet's per-request overhead."""
    one = await _throughput(1, latency, capacity, rounds)
    many = await _throughput(max_engines, latency, capacity, rounds)
    overhead = await _overhead(overhead_requests, blocks=8)
    ratio = many["requests_per_s"] / one["requests_per_s"]
    return {
        "latency_s": latency,
        "capacity_per_engine": capacity,
        "scaling": [one, many],
        f"throughput_{max_engines}_vs_1": ratio,
        "overhead": overhead,
        "overhead_ms_per_request": overhead["overhead_ms_per_request"],
        "goals": {
            f"throughput_{max_engines}_vs_1": f">= {0.875 * max_engines:g}",
            "overhead_ms_per_request": "<= 1",
        },
        "goals_met": ratio >= 0.875 * max_engines and overhead["overhead_ms_per_request"] <= 1.0,
    }


def main(**kwargs: Any) -> dict[str, Any]:
    """Run the benchmark on a fresh event loop."""
    return asyncio.run(run_fleet_bench(**kwargs))

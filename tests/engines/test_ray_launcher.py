"""The Ray launcher: two vLLM server engines inside Ray actors on a local Ray instance."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from pathlib import Path

import pytest

from rolloutlog.controller.engines.config import LaunchConfig
from rolloutlog.grpo.tiny_model import build_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_two_engine_actors_serve_and_one_can_be_killed(tmp_path: Path) -> None:
    for module in ("ray", "vllm", "httpx"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (extras [ray], [fleet], vllm)")
    from rolloutlog.controller.backends import GroupRequest, SamplingConfig, SiblingSpec
    from rolloutlog.controller.backends.fleet import EngineHealth, FleetBackend
    from rolloutlog.controller.backends.vllm_server import VLLMServerBackend
    from rolloutlog.controller.engines.local import health_ok
    from rolloutlog.controller.engines.ray_launcher import RayEngineLauncher

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    model_dir = build_tiny_model(tmp_path / "tiny")
    logs = tmp_path / "logs"
    logs.mkdir()
    launcher = RayEngineLauncher(
        LaunchConfig(
            placement="ray",
            count=2,
            model_dir=model_dir,
            max_model_len=128,
            ready_timeout_s=600,
            stop_timeout_s=15,
            log_dir=logs,
        )
    )
    try:
        urls = launcher.start()
        assert len(urls) == 2 and all(health_ok(u) for u in urls)

        async def scenario() -> None:
            fleet = FleetBackend(
                [
                    VLLMServerBackend(u, model_dir=model_dir, max_model_len=128, engine_id=f"r{i}")
                    for i, u in enumerate(urls)
                ],
                health_interval=0.2,
                dead_after=2,
            )
            await fleet.start()
            try:
                request = GroupRequest(1, (1, 4, 5, 6), (SiblingSpec(0, 0), SiblingSpec(1, 0)))
                results = await asyncio.gather(
                    *(fleet.generate(request) for _ in range(4)), return_exceptions=False
                )
                assert {r.engine_id for rs in results for r in rs} == {"r0", "r1"}
                await asyncio.to_thread(launcher.kill_actor, 1)
                deadline = asyncio.get_running_loop().time() + 30
                while fleet.health()["r1"] is not EngineHealth.DEAD:
                    assert asyncio.get_running_loop().time() < deadline, fleet.health()
                    await asyncio.sleep(0.1)
                again = await fleet.generate(
                    GroupRequest(2, (1, 4), (SiblingSpec(0, 0),), SamplingConfig(max_tokens=4))
                )
                assert again[0].engine_id == "r0"
            finally:
                await fleet.close()

        asyncio.run(scenario())
        assert not health_ok(urls[1])
    finally:
        launcher.stop()

"""Engines outlive runs: ``rolloutlog run`` r1, then r2 on the same engines, then r1
``--resume`` on engines that now hold r2's weights (backend ``vllm-fleet`` over fake
HTTP engines that hold real tensors and keep whatever was loaded last).

From the log: every engine joins with the version it was found to serve (null: not the
run's), is refit before it serves, and every sample was generated with the weights of
the version it is labelled with.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch
import yaml

from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.backends.fake_engine import FakeEngineServer
from rolloutlog.controller.backends.vllm_server import model_dir_fingerprint
from rolloutlog.controller.rollout_controller import iter_history
from rolloutlog.eventstore import EventStore
from rolloutlog.grpo.loop import run_training
from rolloutlog.grpo.run_config import RunConfig
from rolloutlog.grpo.tiny_model import build_tiny_model

from .conftest import REPO


def _cfg(tmp_path: Path, urls: list[str], steps: int) -> RunConfig:
    cfg: dict[str, Any] = yaml.safe_load((REPO / "configs" / "sqlite-torch.yaml").read_text())
    cfg.update(steps=steps, checkpoint_every=1, backend="vllm-fleet")
    cfg["checkpoint_dir"] = str(tmp_path / "checkpoints")
    cfg["model"]["dir"] = str(tmp_path / "tiny-model")
    cfg["store"]["url"] = f"sqlite:///{tmp_path / 'log.db'}"
    cfg["rollout"].update(groups_per_step=4)
    cfg["fleet"] = {"urls": urls}
    return RunConfig.model_validate(cfg)


def _history(tmp_path: Path, run_id: str) -> list[Any]:
    with EventStore.open(f"sqlite:///{tmp_path / 'log.db'}") as store:
        return [ev for _row, ev in iter_history(store, run_id)]


def test_runs_on_reused_engines_serve_only_their_own_weights(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "tiny-model")
    start_up = model_dir_fingerprint(model_dir, torch.float32)
    served: dict[str, list[tuple[str, int, str | None]]] = {}

    async def scenario() -> None:
        servers = [
            FakeEngineServer(
                DeterministicBackend(vocab_size=55, max_model_len=64, eos_token_id=2),
                max_model_len=64,
                model_dir=model_dir,
            )
            for _ in range(2)
        ]
        for s in servers:
            await s.start()
        urls = [s.url for s in servers]
        try:
            for label, run_id, steps, resume in [
                ("r1", "r1", 3, False),
                ("r2", "r2", 1, False),
                ("r1-resumed", "r1", 4, True),
            ]:
                mark = [len(s.served_with) for s in servers]
                await run_training(_cfg(tmp_path, urls, steps), run_id=run_id, resume=resume)
                served[label] = [
                    e for s, n in zip(servers, mark, strict=True) for e in s.served_with[n:]
                ]
        finally:
            for s in servers:
                await s.stop()

    asyncio.run(asyncio.wait_for(scenario(), 240))

    # r2 starts on engines holding r1's version 3: they join with null, are refit to
    # version 0 (the model directory) before any sample, and serve only that.
    r2 = _history(tmp_path, "r2")
    joined = [ev for ev in r2 if ev.event_type == "EngineJoined"]
    assert sorted(ev.engine_id for ev in joined) == ["engine-0", "engine-1"]
    assert {ev.weight_version for ev in joined} == {None}
    first_sample = next(i for i, ev in enumerate(r2) if ev.event_type == "SiblingCompleted")
    refits = {
        ev.engine_id: ev.weight_version
        for ev in r2[:first_sample]
        if ev.event_type == "EngineRefit"
    }
    assert refits == {"engine-0": 0, "engine-1": 0}
    step0 = [e for e in served["r2"] if e[1] == 0]
    assert step0 and {fp for _rid, _v, fp in step0} == {start_up}
    assert {v for _rid, v, _fp in served["r2"]} <= {0, 1}  # never r1's version 3
    completed = [ev for ev in r2 if ev.event_type == "SiblingCompleted"]
    assert completed and {ev.weight_version for ev in completed} <= {0, 1}

    # r1 resumes from its newest checkpoint (step 3, version 3) while the engines hold
    # r2's version 1: they join with null and serve only after the resume's sync.
    r1 = _history(tmp_path, "r1")
    resumed_at = max(i for i, ev in enumerate(r1) if ev.event_type == "RunRestored")
    after = r1[resumed_at:]
    rejoined = [ev for ev in after if ev.event_type == "EngineJoined"]
    assert len(rejoined) == 2 and {ev.weight_version for ev in rejoined} == {None}
    samples = [ev for ev in after if ev.event_type == "SiblingCompleted" and not ev.salvaged_from]
    assert samples and min(ev.weight_version for ev in samples) >= 3
    assert {v for _rid, v, _fp in served["r1-resumed"]} <= {3, 4}

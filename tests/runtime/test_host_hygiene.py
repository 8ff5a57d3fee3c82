"""rolloutlog in a trainer's process leaves that process as it found it.

Opening and closing controllers (SQLite, PostgreSQL, the default writer and the opt-in
writer process), the runtime, a dataset, a fleet and the Ray launcher must not change
the garbage collector (no ``gc.freeze``), ``os.environ``, progress-bar or logging
settings, and must leave no child process and no thread behind. While a controller is
open with the default writer, no child process runs and nothing is frozen.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import logging
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_runtime_rules import WEIGHTS, _Prompts

from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.domain import AdmitStep
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.eventstore import EventStore

try:  # the fleet's client stack (httpx; importing transformers sets an environment
    # variable of torch's, TORCHINDUCTOR_CACHE_DIR, once per process): imported here,
    # outside the measured opens and closes
    from rolloutlog.controller.backends import GroupRequest, SiblingSpec
    from rolloutlog.controller.backends.fake_engine import FakeEngineServer
    from rolloutlog.controller.backends.fleet import FleetBackend
    from rolloutlog.controller.backends.vllm_server import VLLMServerBackend
except ImportError:  # pragma: no cover - the [fleet] extra is missing
    FleetBackend = None  # type: ignore[assignment,misc]


def _live_children() -> set[int]:
    """This process's children that are not zombies (from /proc)."""
    me = str(os.getpid())
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rfind(")") + 2 :].split()  # state ppid ...
        if fields[1] == me and fields[0] != "Z":
            found.add(int(entry.name))
    return found


def _progress_bars() -> dict[str, bool]:
    settings = {}
    if importlib.util.find_spec("datasets") is not None:
        import datasets

        settings["datasets"] = datasets.is_progress_bar_enabled()
    if importlib.util.find_spec("transformers") is not None:
        from transformers.utils import logging as hf_logging

        settings["transformers"] = hf_logging.is_progress_bar_enabled()
    return settings


def _state() -> dict[str, Any]:
    """What a library must leave as it found it in the process that imports it."""
    return {
        "gc_freeze_count": gc.get_freeze_count(),
        "gc_enabled": gc.isenabled(),
        "gc_threshold": gc.get_threshold(),
        # pytest's own bookkeeping variable changes with the test's phase.
        "environ": {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"},
        "children": _live_children(),
        "threads": sorted((t.name, t.ident) for t in threading.enumerate()),
        "progress_bars": _progress_bars(),
        "root_logging": (logging.getLogger().level, list(logging.getLogger().handlers)),
    }


@pytest.fixture
def unchanged() -> Iterator[dict[str, Any]]:
    """The process's state before the test; the test's own work must restore it."""
    gc.collect()
    before = _state()
    yield before
    gc.collect()
    after = _state()
    env_before, env_after = before.pop("environ"), after.pop("environ")
    changed = {
        k for k in env_before.keys() | env_after.keys() if env_before.get(k) != env_after.get(k)
    }
    assert not changed, {k: (env_before.get(k), env_after.get(k)) for k in sorted(changed)}
    for key in before:
        assert after[key] == before[key], f"{key} changed: {before[key]!r} -> {after[key]!r}"


def _controller(store: EventStore, run_id: str, **store_config: Any) -> RolloutController:
    return RolloutController.start(
        store,
        run_id,
        RolloutConfig(group_size=2, groups_per_step=4, lookahead=1, staleness_bound=1),
        dataset_fingerprint=_Prompts.fingerprint,
        dataset_size=_Prompts.num_prompts,
        store_config=StoreConfig(snapshot_interval=0, **store_config),
    )


class _Cycle:
    """An object in a reference cycle (only the cyclic collector frees it)."""

    def __init__(self) -> None:
        self.me = self
        self.blob = bytearray(1 << 20)


def test_a_controller_and_its_runtime_change_nothing_of_the_process(
    db_url: str, unchanged: dict[str, Any]
) -> None:
    store = EventStore.open(db_url)
    try:
        cycle = _Cycle()
        alive = weakref.ref(cycle)
        ctl = _controller(store, "hygiene")
        try:
            # While open: nothing frozen, no child process (the default writer is a
            # thread), and a cycle alive at the open is freed by del + collect.
            assert gc.get_freeze_count() == unchanged["gc_freeze_count"]
            assert _live_children() == unchanged["children"]
            assert ctl.committer.writer == "thread"
            del cycle
            gc.collect()
            assert alive() is None, "an object alive at the open outlived del + gc.collect()"

            async def train() -> None:
                runtime = RolloutRuntime(
                    ctl, DeterministicBackend(vocab_size=16), _Prompts(), GenerationConfig()
                )
                await runtime.start()
                try:
                    for step in range(2):
                        await runtime.next_batch(step)
                        await runtime.report_trained(step, step + 1)
                        await runtime.publish_weights(WEIGHTS, step + 1)
                finally:
                    await runtime.close()

            asyncio.run(train())
            ctl.checkpoint(2)
        finally:
            ctl.close()
        reopened = RolloutController.open(store, "hygiene", store_config=StoreConfig())
        reopened.close()
    finally:
        store.close()


def test_the_opt_in_writer_process_is_gone_after_close(
    db_url: str, unchanged: dict[str, Any]
) -> None:
    store = EventStore.open(db_url)
    try:
        ctl = _controller(store, "hygiene-process", commit_writer="process")
        try:
            ctl.execute(AdmitStep())
            ctl.flush()
            pid = ctl.committer.health().pid  # type: ignore[attr-defined]
            assert pid in _live_children()
        finally:
            ctl.close()
    finally:
        store.close()


def test_reading_a_dataset_changes_nothing_of_the_process(
    tmp_path: Path, unchanged: dict[str, Any]
) -> None:
    pytest.importorskip("datasets")
    from rolloutlog.controller.workloads.dataset import DatasetConfig, load_rows

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    rows = load_rows(DatasetConfig(path=str(path)))
    assert [r["prompt"] for r in rows] == ["1+1=", "2+2="]


def test_a_fleet_of_fake_engines_changes_nothing_of_the_process(
    unchanged: dict[str, Any],
) -> None:
    if FleetBackend is None:
        pytest.skip("the fleet needs httpx (the [fleet] extra)")

    async def scenario() -> None:
        servers = [
            FakeEngineServer(
                DeterministicBackend(vocab_size=55, max_model_len=64, eos_token_id=2),
                latency=0.01,
                max_model_len=64,
            )
            for _ in range(2)
        ]
        for server in servers:
            await server.start()
        fleet = FleetBackend(
            [
                VLLMServerBackend(s.url, vocab_size=55, max_model_len=64, engine_id=f"e{i}")
                for i, s in enumerate(servers)
            ],
            health_interval=0.05,
        )
        try:
            await fleet.start()
            request = GroupRequest(1, (1, 4, 5), (SiblingSpec(0, 0), SiblingSpec(1, 0)))
            results = await asyncio.gather(*(fleet.generate(request) for _ in range(4)))
            assert all(len(r) == 2 for r in results)
        finally:
            await fleet.close()
            for server in servers:
                await server.stop()

    asyncio.run(scenario())


class _FakeRay:
    """The part of the ``ray`` module the launcher's init and stop use. Like Ray 2.60,
    ``init`` writes ``RAY_AUTH_MODE=token`` into the environment when it finds none."""

    def __init__(self) -> None:
        self.initialized = False
        self.auth_mode_at_init: str | None = None

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self, **_kwargs: Any) -> None:
        self.auth_mode_at_init = os.environ.get("RAY_AUTH_MODE")
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        self.initialized = True

    def shutdown(self) -> None:
        self.initialized = False


def test_the_ray_launcher_gives_ray_its_auth_mode_without_keeping_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unchanged: dict[str, Any]
) -> None:
    """Starting a real local Ray takes long on this machine (and the launcher's full
    test needs vLLM): the environment handling is checked around a stand-in ``ray``."""
    from rolloutlog.controller.engines.config import LaunchConfig
    from rolloutlog.controller.engines.ray_launcher import RayEngineLauncher

    if "RAY_AUTH_MODE" in os.environ:  # the process's own value must win, and stay
        monkeypatch.delenv("RAY_AUTH_MODE")
    environ = dict(os.environ)
    fake = _FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    launcher = RayEngineLauncher(
        LaunchConfig(placement="ray", count=1, model_dir=tmp_path, log_dir=tmp_path)
    )
    launcher.init_ray()
    assert fake.auth_mode_at_init == "disabled"  # what the head node inherits
    assert dict(os.environ) == environ
    launcher.stop()
    assert not fake.initialized
    # A value the process set itself is what Ray gets, and it is left in place.
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    launcher.init_ray()
    assert fake.auth_mode_at_init == "token" and os.environ["RAY_AUTH_MODE"] == "token"
    launcher.stop()
    monkeypatch.undo()  # the process's own RAY_AUTH_MODE goes before the check

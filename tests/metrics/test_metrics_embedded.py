"""The exporter embedded in a training run (``telemetry: {enabled: true}``)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import urllib.error
from pathlib import Path
from typing import Any

import pytest
from test_metrics_exporter import _live_only, expected, scrape

from rolloutlog.controller.metrics import project_history
from rolloutlog.eventstore import EventStore
from rolloutlog.grpo.loop import run_training
from rolloutlog.grpo.run_config import RunConfig

RUN = "embedded"


def _cfg(tmp_path: Path, *, steps: int, port: int) -> RunConfig:
    return RunConfig.model_validate(
        {
            "steps": steps,
            "checkpoint_every": 1,
            "checkpoint_dir": str(tmp_path / "checkpoints"),
            "backend": "deterministic",
            "model": {"dir": str(tmp_path / "model"), "build": "tiny"},
            "store": {"url": f"sqlite:///{tmp_path / 'log.db'}"},
            "telemetry": {"enabled": True, "port": port},
        }
    )


def _until(fetch: Any, ok: Any, timeout: float = 60.0) -> Any:
    """``fetch()`` once ``ok`` holds for it; fails, with the last value, after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if ok(value):
            return value
        assert time.monotonic() < deadline, f"not reached within {timeout}s: {value!r}"
        time.sleep(0.02)


def test_training_serves_its_metrics_and_resume_adds_the_restore(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, steps=2, port=0)
    url = cfg.store.url
    seen: dict[str, Any] = {"steps": []}

    def progress(msg: dict[str, Any]) -> None:
        if msg["event"] == "telemetry":
            seen["url"] = msg["url"]
        elif msg["event"] == "step":
            # The callback blocks the event loop: no command runs while we look.
            samples = _until(
                lambda: scrape(seen["url"], RUN),
                lambda s: s.get(("rollout_train_step", ())) == msg["step"] + 1,
            )
            offset = int(samples[("rollout_log_offset", ())])
            store = EventStore.open(url)
            try:  # the commit thread makes the events durable meanwhile
                _until(lambda: store.last_seq(RUN), lambda n: n >= offset)
                offline = project_history(store, RUN, to_seq=offset)
            finally:
                store.close()
            fold_only = {k: v for k, v in samples.items() if not _live_only(k[0])}
            assert fold_only == expected(offline.families())
            seen["steps"].append(samples)

    result = asyncio.run(run_training(cfg, run_id=RUN, resume=False, progress=progress))
    assert result.steps_trained == 2 and len(seen["steps"]) == 2
    last = seen["steps"][-1]
    assert last[("rollout_groups_trained_total", ())] == 2 * cfg.rollout.groups_per_step
    assert last[("rollout_checkpoint_seconds_count", ())] >= 1
    assert last[("rollout_log_append_seconds_count", ())] > 0
    assert last[("rollout_restores_total", ())] == 0
    with pytest.raises(urllib.error.URLError):  # closed with the run
        scrape(seen["url"], RUN)

    # Resume to a third step: a restore, whose phase timings are exported too.
    cfg3 = _cfg(tmp_path, steps=3, port=0)
    seen = {"steps": []}
    result = asyncio.run(run_training(cfg3, run_id=RUN, resume=True, progress=progress))
    assert result.recovery is not None and len(seen["steps"]) == 1
    (samples,) = seen["steps"]
    assert samples[("rollout_restores_total", ())] == 1
    assert samples[("rollout_epoch", ())] == 2
    assert (
        samples[("rollout_restore_phase_seconds", (("phase", "total"),))]
        == (result.recovery.timings["total"])
    )


def test_a_telemetry_failure_does_not_stop_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        port = sock.getsockname()[1]
        messages: list[dict[str, Any]] = []
        with caplog.at_level(logging.ERROR, logger="rolloutlog.controller.metrics.live"):
            result = asyncio.run(
                run_training(
                    _cfg(tmp_path, steps=1, port=port),
                    run_id=RUN,
                    resume=False,
                    progress=messages.append,
                )
            )
    assert result.steps_trained == 1
    assert not [m for m in messages if m["event"] == "telemetry"]
    # One line naming the address and the cause (issue 31.9), no traceback.
    (record,) = [r for r in caplog.records if str(port) in r.getMessage()]
    assert record.getMessage() == (
        f"the metrics exporter cannot listen on 127.0.0.1:{port} (Address already in use); "
        "the run goes on without it"
    )
    assert record.exc_info is None

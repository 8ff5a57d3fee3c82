"""The Prometheus exporter: scraped over HTTP on 127.0.0.1 and parsed with
prometheus-client's own parser, the values are the projection's."""

from __future__ import annotations

import socket
import urllib.request
from typing import Any

import prometheus_client
import pytest
from metrics_helpers import RUN_ID, Scenario, run_scenario
from prometheus_client.parser import text_string_to_metric_families

from rolloutlog.controller.domain.events import GroupCommitted
from rolloutlog.controller.metrics import (
    METRICS,
    BucketCounts,
    Family,
    LogTailer,
    project_history,
    start_exporter,
)
from rolloutlog.controller.metrics import fold as projection_module
from rolloutlog.eventstore import EventStore

Key = tuple[str, tuple[tuple[str, str], ...]]


def scrape(url: str, run_id: str | None = RUN_ID) -> dict[Key, float]:
    """Every sample at ``url`` as {(sample name, sorted labels): value}.

    Every sample must carry the ``run_id`` label (``run_id``; None: any run); it is
    checked, then left out of the keys unless ``run_id`` is None."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out: dict[Key, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = dict(s.labels)
            assert "run_id" in labels, (s.name, labels)
            if run_id is not None:
                assert labels.pop("run_id") == run_id, (s.name, s.labels)
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def expected(families: list[Family]) -> dict[Key, float]:
    """What a scrape of ``families`` must give, sample by sample."""
    out: dict[Key, float] = {}
    for fam in families:
        for s in fam.samples:
            labels = tuple(sorted(s.labels.items()))
            if isinstance(s.value, BucketCounts):
                for le, n in s.value.cumulative():
                    out[(f"{fam.name}_bucket", tuple(sorted((*labels, ("le", le)))))] = n
                out[(f"{fam.name}_count", labels)] = s.value.count
                out[(f"{fam.name}_sum", labels)] = s.value.total
            else:
                out[(fam.name, labels)] = s.value
    return out


def names(samples: dict[Key, float]) -> set[str]:
    return {name for name, _ in samples}


def test_scrape_equals_the_live_projection(scenario: Scenario) -> None:
    handle = start_exporter(scenario.live, 0, addr="127.0.0.1")
    try:
        assert handle.port > 0
        samples = scrape(f"http://127.0.0.1:{handle.port}/metrics")
    finally:
        handle.close()
    assert samples == expected(scenario.live.families())
    # Every metric of the catalogue is exported under its documented name.
    exported = names(samples)
    for name, info in METRICS.items():
        wanted = f"{name}_count" if info.kind == "histogram" else name
        assert wanted in exported, name
    # And the values are the offline recomputation's (live-only timings aside).
    store = EventStore.open(scenario.url)
    try:
        offline = project_history(store, RUN_ID)
    finally:
        store.close()
    c = offline.values()["counters"]
    assert samples[("rollout_tokens_generated_total", ())] == c["rollout_tokens_generated_total"]
    assert samples[("rollout_tokens_committed_total", ())] == c["rollout_tokens_committed_total"]
    assert samples[("rollout_restores_total", ())] == 1
    assert samples[("rollout_log_append_seconds_count", ())] > 0
    assert samples[("rollout_checkpoint_seconds_count", ())] == 2
    assert scenario.report is not None
    assert (
        samples[("rollout_restore_phase_seconds", (("phase", "total"),))]
        == (scenario.report.timings["total"])
    )
    staleness = samples[("rollout_selected_group_staleness_count", ())]
    assert staleness == samples[("rollout_groups_selected_total", ())] > 0
    assert (
        samples[("rollout_groups_evicted_total", (("reason", "stale"), ("recovered", "false")))]
        >= 0
    )
    assert {k: v for k, v in samples.items() if not _live_only(k[0])} == expected(
        offline.families()
    )


def _live_only(sample_name: str) -> bool:
    return any(info.live_only and sample_name.startswith(name) for name, info in METRICS.items())


def test_own_registry_and_two_exporters_at_once(scenario: Scenario) -> None:
    store = EventStore.open(scenario.url)
    try:
        offline = project_history(store, RUN_ID)
    finally:
        store.close()
    a = start_exporter(offline, 0, addr="127.0.0.1")
    b = start_exporter(scenario.live, 0, addr="127.0.0.1")
    try:
        assert a.port != b.port
        first = scrape(a.url)
        second = scrape(b.url)
    finally:
        a.close()
        b.close()
    assert first == expected(offline.families())
    assert "rollout_log_append_seconds_count" not in names(first)  # not in the log
    assert "rollout_log_append_seconds_count" in names(second)
    # Nothing was registered with the process-global registry.
    global_names = {m.name for m in prometheus_client.REGISTRY.collect()}
    assert not any(n.startswith("rollout_") for n in global_names)


def test_port_in_use_raises_and_close_releases_the_port(scenario: Scenario) -> None:
    handle = start_exporter(scenario.live, 0, addr="127.0.0.1")
    port = handle.port
    with pytest.raises(OSError):
        start_exporter(scenario.live, port, addr="127.0.0.1")
    handle.close()
    with socket.socket() as sock:  # the port is free again
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))


def test_tailer_follows_the_log_across_a_restore(sqlite_url: str) -> None:
    """serve-metrics' source: polls the log; a restore makes it roll back, after which
    it equals the offline recomputation again."""
    store = EventStore.open(sqlite_url)
    seen: dict[str, Any] = {}

    def at_crash() -> None:
        tailer = LogTailer(store, RUN_ID, interval=0.05)
        tailer.poll()
        seen["tailer"] = tailer
        seen["values"] = tailer.follower.projection.values(work=tailer.follower.work)

    try:
        sc = run_scenario(sqlite_url, on_crash=at_crash)
        tailer = seen["tailer"]
        at_crash_values = seen["values"]
        # At the crash the tailer had folded work after the checkpoint.
        assert at_crash_values["offset"] > sc.checkpoint_offset
        assert tailer.poll() > 0
        assert tailer.follower.rollbacks == 1 and tailer.follower.recomputes == 0
        offline = project_history(store, RUN_ID)
        assert tailer.follower.projection.values(work=tailer.follower.work) == offline.values()
        assert tailer.poll() == 0  # nothing new
        # Polling on its thread, served over HTTP.
        tailer.start()
        handle = start_exporter(tailer, 0, addr="127.0.0.1")
        try:
            samples = scrape(handle.url)
        finally:
            handle.close()
            tailer.close()
        assert samples == expected(offline.families())
        assert tailer.errors == 0
    finally:
        store.close()


def test_a_failing_listener_never_stops_the_run_and_is_repaired(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Telemetry must never kill a run, nor hide its own failure: the error is logged,
    the run completes, and the projection is recomputed from the log."""
    original = projection_module._HANDLERS[GroupCommitted]
    calls = {"n": 0}

    def flaky(proj: Any, offset: int, meta: Any, event: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected metrics bug")
        original(proj, offset, meta, event)

    monkeypatch.setitem(projection_module._HANDLERS, GroupCommitted, flaky)
    sc = run_scenario(sqlite_url, steps_before_crash=5, total_steps=7)
    assert sc.live.listener_errors == 1
    assert "injected metrics bug" in caplog.text
    assert sc.final_state_values["train_step"] == 7  # the run went on
    assert sc.live.follower.recomputes >= 1
    monkeypatch.setitem(projection_module._HANDLERS, GroupCommitted, original)
    store = EventStore.open(sqlite_url)
    try:
        offline = project_history(store, RUN_ID)
    finally:
        store.close()
    assert {k: v for k, v in sc.live.values().items() if k != "live"} == offline.values()

"""Counters a real Prometheus can trust across a SIGKILL and a restore (issue 15.1).

A training worker (``rolloutlog.grpo.demo_worker``, the demo's) runs with its embedded
exporter on, ``rolloutlog serve-metrics`` tails the same log, and a real Prometheus
server scrapes both every second. The worker is killed with SIGKILL part-way (past a
checkpoint, generation in flight), a new worker restores from the newest checkpoint and
finishes. Then PromQL over the server's HTTP API shows that:

- no ``_total`` series (nor a histogram bucket) ever decreased: ``resets(...) == 0`` on
  both targets, although the restore rolled the run's history back (the
  ``rollout_history_*`` gauges did fall);
- ``increase()`` over the whole scrape window equals what the log says was done between
  the first and the last scrape: the work counted by every stored event (all epochs)
  between the two log offsets served at those scrapes.

Tolerance of ``increase()``: Prometheus extrapolates a range's increase to the range's
ends. The range is chosen to start 1 ms before the first sample and is evaluated at the
last sample, so the extrapolation adds at most ``delta * 0.001 s / window`` (and its
zero-point rule only lowers that): we allow 1% of the delta. A counter that fell back
at the restore (the bug this guards against) reads as a reset and adds its whole value
after the fall, hundreds of percent off.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prom_server import free_port, kill_group, prometheus, require_binary
from test_deploy import RULES, dashboard_queries

from rolloutlog.grpo.run_config import RunConfig

RUN = "prom-run"
pytestmark = pytest.mark.slow


def _config(tmp: Path, port: int, steps: int) -> RunConfig:
    return RunConfig.model_validate(
        {
            "steps": steps,
            "checkpoint_every": 5,
            "checkpoint_dir": str(tmp / "checkpoints"),
            "backend": "torch",  # real generation paces the run for 1 s scrapes
            "model": {"dir": str(tmp / "model"), "build": "tiny"},
            "store": {"url": f"sqlite:///{tmp / 'log.db'}"},
            "telemetry": {"enabled": True, "port": port},
            "task": {"num_prompts": 6000},  # enough for the re-run steps too
        }
    )


class Worker:
    """A demo worker process (own process group); its JSON lines arrive on a queue."""

    def __init__(self, cfg: RunConfig, mode: str, tmp: Path) -> None:
        self.messages: queue.Queue[dict[str, Any]] = queue.Queue()
        self.err = (tmp / f"worker-{mode}.err").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rolloutlog.grpo.demo_worker", cfg.model_dump_json(), RUN, mode],
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            start_new_session=True,
            env=dict(os.environ, HF_HUB_OFFLINE="1"),
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.messages.put(json.loads(line))

    def next(self, timeout: float = 120.0) -> dict[str, Any]:
        try:
            msg = self.messages.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no progress from the worker in {timeout} s") from None
        assert msg.get("event") != "error", msg
        return msg

    def newest(self, timeout: float = 120.0) -> dict[str, Any]:
        """The next message, or the newest of those already queued: what the worker is
        doing now, not what it did while the test was busy elsewhere."""
        msg = self.next(timeout)
        while True:
            try:
                msg = self.messages.get_nowait()
            except queue.Empty:
                return msg
            assert msg.get("event") != "error", msg

    def close(self) -> None:
        kill_group(self.proc)
        self.err.close()


Samples = dict[tuple[tuple[str, str], ...], list[tuple[float, float]]]


def _samples(prom: Any, selector: str, at: float) -> Samples:
    """Every raw sample of the series matching ``selector`` (10 minutes up to ``at``)."""
    out = {}
    for series in prom.query(f"{selector}[10m]", at=at):
        labels = tuple(sorted((k, v) for k, v in series["metric"].items()))
        out[labels] = [(float(t), float(v)) for t, v in series["values"]]
    return out


def test_counters_never_decrease_across_a_kill_and_a_restore(tmp_path: Path) -> None:
    require_binary("prometheus")
    embedded_port, serve_port = free_port(), free_port()
    cfg = _config(tmp_path, embedded_port, steps=60)
    targets = {"embedded": f"127.0.0.1:{embedded_port}", "serve": f"127.0.0.1:{serve_port}"}
    workers: list[Worker] = []
    serve: subprocess.Popen[str] | None = None
    with prometheus(tmp_path, targets, rule_files=(RULES,)) as prom:
        try:
            first = Worker(cfg, "fresh", tmp_path)
            workers.append(first)
            while first.next().get("event") != "telemetry":
                pass
            serve = subprocess.Popen(
                [sys.executable, "-c", "from rolloutlog.cli import main; main()",
                 "serve-metrics", cfg.store.url,
                 "--run", RUN, "--host", "127.0.0.1", "--port", str(serve_port),
                 "--interval", "0.2"],
                stdout=subprocess.DEVNULL,
                stderr=(tmp_path / "serve.err").open("w"),
                text=True,
                start_new_session=True,
            )  # fmt: skip
            # Let Prometheus see the first worker for a while, past a checkpoint.
            step = -1
            while step < 12:
                msg = first.next()
                step = msg.get("step", step)
            prom.wait_until('count_over_time(rollout_train_step{job="embedded"}[5m]) >= 3', bool)
            prom.wait_until('count_over_time(rollout_train_step{job="serve"}[5m]) >= 3', bool)
            # Kill three steps after a checkpoint (every 5 steps): work to roll back. The
            # worker trained on while Prometheus was awaited: judge by its newest message
            # (a queued older one could kill it just after a later checkpoint instead).
            msg = first.newest()
            while msg.get("step", -1) % 5 != 2:
                msg = first.newest()
            assert msg["step"] < cfg.steps - 3, "finished too soon"
            os.killpg(first.proc.pid, 9)  # a real crash: no flush, generation in flight
            first.proc.wait(timeout=30)
            time.sleep(2.5)  # Prometheus scrapes serve-metrics on the crashed log
            second = Worker(cfg, "resume", tmp_path)
            workers.append(second)
            restored = None
            while True:
                msg = second.next()
                if msg["event"] == "restored":
                    restored = msg
                if msg["event"] == "done":
                    break
            assert restored is not None
            assert second.proc.wait(timeout=60) == 0
            from rolloutlog.eventstore import EventStore

            store = EventStore.open(cfg.store.url)
            try:
                last_seq = store.last_seq(RUN)
            finally:
                store.close()
            prom.wait_until(f'rollout_log_offset{{job="serve"}} == {last_seq}', bool, timeout=30)
            _check(prom, cfg.store.url, last_seq)
            _check_deploy(prom)
        finally:
            for w in workers:
                w.close()
            if serve is not None:
                kill_group(serve)


def _check(prom: Any, url: str, last_seq: int) -> None:
    from rolloutlog.controller.metrics import METRICS, project_history
    from rolloutlog.eventstore import EventStore

    counters = [n for n, i in METRICS.items() if i.kind == "counter"]
    at = time.time()  # every range query ends here, so all see the same scrapes
    for job in ("serve", "embedded"):
        # No _total series ever fell, as Prometheus itself counts it.
        for name in [*counters, "rollout_selected_group_staleness_bucket"]:
            resets = prom.query(f'resets({name}{{job="{job}"}}[10m])')
            assert resets, (job, name)
            fell = [r["metric"] for r in resets if float(r["value"][1]) != 0]
            assert not fell, f"{job}: {name} fell {fell}"
    # Not vacuous: the restore did roll the history back (a gauge fell), and work done in
    # the abandoned branch is counted.
    # (Checked on the final scrape, not by catching the gauge's fall between two 1 s
    # scrapes: a fast machine re-trains the abandoned steps within one scrape interval.)
    history = _samples(prom, 'rollout_history_groups_trained{job="serve"}', at)
    work = _samples(prom, 'rollout_groups_trained_total{job="serve"}', at)
    ((_, history_points),) = history.items()
    ((_, work_points),) = work.items()
    assert work_points[-1][1] > history_points[-1][1], (work_points[-1], history_points[-1])

    # increase() over the scrape window = the work the log records between the offsets
    # served at the first and the last scrape (serve-metrics folds only durable events).
    offsets = _samples(prom, 'rollout_log_offset{job="serve"}', at)
    ((_, offset_points),) = offsets.items()
    store = EventStore.open(url)
    try:
        whole = project_history(store, RUN).values()
        ranges: dict[tuple[int, int], dict[str, Any]] = {}
        checked = 0
        for name in counters:
            for labels, pts in _samples(prom, f'{name}{{job="serve"}}', at).items():
                (t0, v0), (t1, v1) = pts[0], pts[-1]
                off = dict(offset_points)
                assert t0 in off and t1 in off, (name, labels, t0, t1, sorted(off)[:3], pts[:3])
                first_off, last_off = int(off[t0]), int(off[t1])
                assert last_off == last_seq
                if (first_off, last_off) not in ranges:
                    ranges[first_off, last_off] = project_history(
                        store, RUN, from_seq=first_off + 1, to_seq=last_off
                    ).values()["counters"]
                want = _value(ranges[first_off, last_off][name], dict(labels))
                assert v1 - v0 == want, (name, labels)
                assert v1 == _value(whole["counters"][name], dict(labels)), (name, labels)
                window_ms = round((t1 - t0) * 1000) + 1
                sel = ",".join(f'{k}="{v}"' for k, v in labels if k != "__name__")
                got = prom.query(f"increase({name}{{{sel}}}[{window_ms}ms])", at=t1)
                inc = float(got[0]["value"][1]) if got else 0.0
                assert abs(inc - want) <= 0.01 * want + 1e-6, (name, labels, inc, want)
                checked += 1
    finally:
        store.close()
    assert checked >= len(counters)
    _check_first_events_counted(prom, at, offset_points)
    c, h = whole["counters"], whole["history_counters"]
    assert c["rollout_groups_trained_total"] > h["rollout_groups_trained_total"]
    assert c["rollout_restores_total"] == 1


def _check_first_events_counted(
    prom: Any, at: float, offset_points: list[tuple[float, float]]
) -> None:
    """Issue 31.9: every event type is exported from the first scrape on, at 0 before its
    first event, so Prometheus's ``increase()`` over the run counts the restore (a series
    born at 1 reads as no increase)."""
    from rolloutlog.controller.metrics import EVENT_TYPES

    first_scrape = offset_points[0][0]
    by_type = {
        dict(labels)["type"]: pts
        for labels, pts in _samples(prom, 'rollout_events_total{job="serve"}', at).items()
    }
    assert set(by_type) == set(EVENT_TYPES)
    assert {pts[0][0] for pts in by_type.values()} == {first_scrape}
    assert by_type["RunRestored"][0][1] == 0 and by_type["RunRestored"][-1][1] == 1
    for job in ("serve", "embedded"):
        (points,) = _samples(prom, f'rollout_log_offset{{job="{job}"}}', at).values()
        # From 1 ms before the first scrape to the last: extrapolation adds < 0.1 %.
        (t0, _), (t1, _) = points[0], points[-1]
        window_ms = round((t1 - t0) * 1000) + 1
        got = prom.query(
            f'increase(rollout_events_total{{job="{job}",type="RunRestored"}}[{window_ms}ms])',
            at=t1,
        )
        assert got, job
        assert float(got[0]["value"][1]) == pytest.approx(1.0, rel=0.01), (job, got)


def _check_deploy(prom: Any) -> None:
    """The dashboard's queries run and return data; the alert rules evaluate cleanly."""
    # While both exporters were up: the last scrape of the training process.
    (points,) = _samples(prom, 'rollout_log_offset{job="embedded"}', time.time()).values()
    alive = points[-1][0]
    for title, expr in dashboard_queries():
        result = prom.query(expr, at=alive)
        assert result, (title, expr)
    groups = prom.wait_until_rules()
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 5
    for rule in rules:
        assert rule["health"] == "ok", rule
        assert not rule.get("lastError"), rule


def _value(counter: Any, labels: dict[str, str]) -> float:
    if not isinstance(counter, list):
        return float(counter)
    for sample in counter:
        if all(labels.get(k) == str(v) for k, v in sample.items() if k != "value"):
            return float(sample["value"])
    return 0.0

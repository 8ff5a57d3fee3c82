"""The Prometheus alert rules and the Grafana dashboard in deploy/ (issue 15.5):
``promtool check rules``, the rules' unit tests (``promtool test rules``), and the
dashboard's queries: well-formed, on documented metrics. The queries and rules also run
against a real Prometheus scraping a killed and restored run in
``test_prometheus_counters``."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

from prom_server import require_binary

from rolloutlog.controller.metrics import METRICS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "rolloutlog-alerts.yml"
RULES_TEST = DEPLOY / "prometheus" / "rolloutlog-alerts.test.yml"
DASHBOARD = DEPLOY / "grafana" / "rolloutlog-dashboard.json"


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every dashboard target, Grafana variables substituted
    the way Grafana would for "all runs" and a rate interval of one minute (the tests
    scrape every second: a shorter window could hold fewer than the two samples ``rate``
    needs when a loaded machine misses scrapes)."""
    dash: dict[str, Any] = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$run_id", ".+").replace("$__rate_interval", "1m")
            out.append((panel["title"], expr))
    return out


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_binary("promtool"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=RULES.parent,
        start_new_session=True,
    )


def test_promtool_checks_and_unit_tests_the_rules() -> None:
    check = _promtool("check", "rules", RULES.name)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 5 rules found" in check.stdout
    unit = _promtool("test", "rules", RULES_TEST.name)
    assert unit.returncode == 0, unit.stdout + unit.stderr
    assert "SUCCESS" in unit.stdout


def test_the_dashboard_uses_documented_metrics_and_the_run_variable() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "rolloutlog"
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "run_id"} <= variables
    queries = dashboard_queries()
    assert len(queries) >= 12
    known = set(METRICS)
    for title, expr in queries:
        assert 'run_id=~".+"' in expr, (title, expr)
        names = set(re.findall(r"\b(rollout_[a-z_]+)", expr))
        assert names, (title, expr)
        for name in names:
            base = re.sub(r"_(bucket|count|sum)$", "", name)
            assert name in known or base in known, (title, name)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_dashboard_queries_count_a_run_once_when_both_exporters_are_scraped(
    tmp_path: Path,
) -> None:
    """Issue 31.9: docs/metrics.md describes scraping the trainer's embedded exporter and
    ``serve-metrics`` together; they serve the same values for a run (the same log), so
    every panel must show one series per run with the value of one exporter, not their
    sum. And the staleness quantiles are exact: every selected group 1 version behind
    shows p50 = p90 = 1 (histogram_quantile alone interpolates 0.5 and 0.9).

    Evaluated by ``promtool test rules`` (promql_expr_test) on series of two targets,
    scraped every 15 s: counters grow by 1/s, gauges are 5, every staleness is 1, every
    append takes 0.5-1 ms, the newest event is 10 s old at the evaluation."""
    from rolloutlog.controller.metrics.catalog import STALENESS_BUCKETS
    from rolloutlog.controller.metrics.histogram import _le
    from rolloutlog.controller.metrics.live import APPEND_BUCKETS

    targets = (("embedded", "127.0.0.1:9400"), ("serve", "127.0.0.1:9401"))
    metric_labels = {
        "rollout_groups_evicted_total": 'reason="stale",recovered="true",',
        "rollout_prompts_dropped_total": 'outcome="replaced",',
    }
    queries = dashboard_queries()
    names = {n for _, expr in queries for n in re.findall(r"\b(rollout_[a-z_]+)", expr)}
    series: list[dict[str, str]] = []

    def add(name: str, labels: str, values: str) -> None:
        for job, instance in targets:
            selector = f'{name}{{{labels}job="{job}",instance="{instance}",run_id="r"}}'
            series.append({"series": selector, "values": values})

    for name in sorted(names):
        if name == "rollout_selected_group_staleness_bucket":
            for bound in (*STALENESS_BUCKETS, float("inf")):
                add(name, f'le="{_le(bound)}",', "0x40" if bound < 1 else "0+15x40")
        elif name == "rollout_log_append_seconds_bucket":
            for bound in (*APPEND_BUCKETS, float("inf")):
                add(name, f'le="{_le(bound)}",', "0x40" if bound < 0.001 else "0+15x40")
        elif name == "rollout_last_event_timestamp_seconds":
            add(name, "", "290x40")
        elif name.endswith("_total"):
            add(name, metric_labels.get(name, ""), "0+15x40")
        else:
            add(name, "", "5x40")
    tests = []
    for title, expr in queries:
        if "histogram_quantile(0.99" in expr:
            want = 0.0005 + 0.99 * 0.0005  # interpolated inside (0.0005, 0.001]
        elif "ceil(histogram_quantile(" in expr:
            want = 1.0
        elif expr.startswith("time() -"):
            want = 10.0
        elif "rate(" in expr:
            want = 1.0
        elif "increase(" in expr:
            want = 60.0
        elif re.search(r"\brollout_[a-z_]+_total\b", expr):
            want = 300.0  # the counter at 5 minutes
        else:
            want = 5.0
        by = re.search(r"\bby \(([^)]*)\)", expr)
        assert by is not None, (title, expr)
        keys = [k.strip() for k in by.group(1).split(",") if k.strip() != "le"]
        known = {"run_id": "r", "reason": "stale", "recovered": "true", "outcome": "replaced"}
        labels = "{" + ",".join(f'{k}="{known[k]}"' for k in keys) + "}"
        tests.append(
            {"expr": expr, "eval_time": "5m", "exp_samples": [{"labels": labels, "value": want}]}
        )
    spec = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": series, "promql_expr_test": tests}],
    }
    path = tmp_path / "dashboard.test.yml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    run = _promtool("test", "rules", str(path))
    assert run.returncode == 0, run.stdout + run.stderr

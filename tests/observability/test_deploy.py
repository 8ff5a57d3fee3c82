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

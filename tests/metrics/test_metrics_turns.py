"""Multi-turn metrics: turns per trajectory, tool call seconds, tool failures by tool
(bounded labels), from the fold, on a real multi-turn run with a restore and a tool
failure, and on hand-made events for the label bound."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

_AUDIT = str(Path(__file__).resolve().parents[1] / "audit")
if _AUDIT not in sys.path:
    sys.path.insert(0, _AUDIT)

from mt_audit_helpers import BuiltMtRun, build_mt_run  # noqa: E402

from rolloutlog.controller.domain.trajectory import (  # noqa: E402
    ToolCallCompleted,
    ToolCallFailed,
    ToolCallRequested,
    TrajectoryCompleted,
)
from rolloutlog.controller.metrics import project_history  # noqa: E402
from rolloutlog.controller.metrics.catalog import (  # noqa: E402
    MAX_TOOL_LABELS,
    OTHER_TOOL,
    TOOL_SECONDS_BUCKETS,
)
from rolloutlog.controller.metrics.fold import EventMeta, MetricsProjection  # noqa: E402
from rolloutlog.eventstore import EventStore  # noqa: E402


@pytest.fixture(scope="module")
def mt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BuiltMtRun]:
    root = tmp_path_factory.mktemp("mt-metrics")
    url = f"sqlite:///{root / 'log.db'}"
    with EventStore.open(url) as store:
        built = build_mt_run(store, url, root / "ledger.tsv")
    yield built
    built.audit.close()


def _failures(counters: dict[str, object]) -> dict[tuple[str, str], float]:
    rows = counters["rollout_tool_failures_total"]
    assert isinstance(rows, list)
    return {(r["tool"], r["outcome"]): r["value"] for r in rows}


def test_the_fold_counts_turns_tool_seconds_and_failures(mt: BuiltMtRun) -> None:
    with EventStore.open(mt.url) as store:
        values = project_history(store, mt.run_id).values()
    events = [e for _, _, e in mt.turn_events]  # every stored event: what work counts
    done = [e for e in events if isinstance(e, TrajectoryCompleted)]
    answers = [e for e in events if isinstance(e, ToolCallCompleted | ToolCallFailed)]
    failed = [e for e in answers if isinstance(e, ToolCallFailed)]
    assert done and answers and failed
    turns = values["histograms"]["rollout_trajectory_turns"]
    assert turns["count"] == len(done) and turns["sum"] == sum(e.turns for e in done)
    assert turns["buckets"]["3"] == sum(e.turns <= 3 for e in done)
    seconds = values["histograms"]["rollout_tool_call_seconds"]
    assert seconds["count"] == len(answers)
    assert seconds["sum"] == pytest.approx(sum(e.seconds for e in answers), abs=1e-5)
    first = TOOL_SECONDS_BUCKETS[0]
    assert seconds["buckets"][str(first)] == sum(e.seconds <= first for e in answers)
    tool_of = {e.idempotency_key: e.tool for e in events if isinstance(e, ToolCallRequested)}
    want = Counter((tool_of[e.idempotency_key], e.outcome) for e in failed)
    got = _failures(values["counters"])
    # Every tool requested is exported (0 until it fails), "other" always.
    assert set(got) == {
        (t, o) for t in {"add", "submit", OTHER_TOOL} for o in ("error", "not_rerun")
    }
    assert {k: v for k, v in got.items() if v} == dict(want)
    assert got[("add", "error")] > 0 and got[("submit", "error")] == 0
    # The history's own counts cover the current history only (the restore abandoned some).
    history = _failures(values["history_counters"])
    assert all(history[k] <= got[k] for k in got)


def test_a_run_without_turns_exports_them_at_zero() -> None:
    values = MetricsProjection().values()
    assert _failures(values["counters"]) == {(OTHER_TOOL, "error"): 0, (OTHER_TOOL, "not_rerun"): 0}
    assert values["histograms"]["rollout_trajectory_turns"]["count"] == 0
    assert values["histograms"]["rollout_tool_call_seconds"]["count"] == 0
    names = {f.name for f in MetricsProjection().families()}
    assert {"rollout_tool_failures_total", "rollout_tool_call_seconds"} <= names


def _meta() -> EventMeta:
    return EventMeta(datetime(2026, 12, 5, tzinfo=UTC), 0, 0, 1)


def test_tool_labels_are_bounded_and_survive_a_snapshot() -> None:
    proj = MetricsProjection()
    offset = 0
    extra = 3
    for i in range(MAX_TOOL_LABELS + extra):
        key = f"k{i}"
        offset += 1
        proj.apply(
            offset,
            _meta(),
            ToolCallRequested(
                group_id=0, sibling=0, attempt=1, turn=i, call=0, tool=f"tool{i}",
                arguments={}, idempotency_key=key, idempotent=False, status_check=False,
            ),
        )  # fmt: skip
        if i == MAX_TOOL_LABELS + extra - 1:
            # A snapshot between a request and its failure: the tool is remembered.
            proj = MetricsProjection.from_snapshot(proj.to_snapshot(), proj.state)  # type: ignore[arg-type]
        offset += 1
        proj.apply(
            offset,
            _meta(),
            ToolCallFailed(
                group_id=0, sibling=0, attempt=1, turn=i, idempotency_key=key, reason="boom",
                outcome="not_rerun" if i % 2 else "error", seconds=0.002 * i,
                observation_tokens=1, payload_id=f"p{i}",
            ),
        )  # fmt: skip
    got = _failures(proj.values()["counters"])
    tools = {t for t, _ in got}
    assert len(tools) == MAX_TOOL_LABELS + 1 and OTHER_TOOL in tools
    assert sum(got.values()) == MAX_TOOL_LABELS + extra
    assert got[(OTHER_TOOL, "error")] + got[(OTHER_TOOL, "not_rerun")] == extra
    assert got[("tool0", "error")] == 1 and got[("tool1", "not_rerun")] == 1
    seconds = proj.values()["histograms"]["rollout_tool_call_seconds"]
    assert seconds["count"] == MAX_TOOL_LABELS + extra
    # A failure whose request the fold never saw counts as "other".
    proj.apply(
        offset + 1,
        _meta(),
        ToolCallFailed(
            group_id=0, sibling=0, attempt=1, turn=0, idempotency_key="unseen", reason="x",
            outcome="error", seconds=0.0, observation_tokens=1, payload_id="q",
        ),
    )  # fmt: skip
    assert (
        _failures(proj.values()["counters"])[(OTHER_TOOL, "error")]
        == got[(OTHER_TOOL, "error")] + 1
    )


def test_the_report_has_a_turns_view(mt: BuiltMtRun, tmp_path: Path) -> None:
    from rolloutlog.controller.domain.trajectory import fold_trajectories
    from rolloutlog.controller.metrics.report import collect, render_html, write_report

    book = fold_trajectories((epoch, e) for _, epoch, e in mt.turn_events)
    with EventStore.open(mt.url) as store:
        data = collect(store, mt.run_id)
        charts = write_report(store, mt.run_id, tmp_path / "report.html")
    rows = {(t["group_id"], t["sibling"]): t for t in data.trajectories}
    assert set(rows) == set(book)
    for key, traj in book.items():
        row = rows[key]
        assert (row["turns"], row["resumes"], row["completed"]) == (
            traj.turns,
            traj.resumes,
            traj.completed,
        )
        assert row["model_tokens"] == sum(traj.loss_mask())
        assert row["tool_failures"] == sum(c.status == "failed" for c in traj.tool_calls)
    assert any(r["resumes"] for r in rows.values())
    assert charts == 8  # the six of every run, then turns and trajectories
    page = render_html(data)
    assert 'id="chart-turns"' in page and 'id="chart-trajectories"' in page


def test_the_turns_view_draws_in_headless_chromium(mt: BuiltMtRun, tmp_path: Path) -> None:
    import re

    obs = str(Path(__file__).resolve().parents[1] / "observability")
    if obs not in sys.path:
        sys.path.insert(0, obs)
    from test_report import _chromium

    from rolloutlog.controller.metrics.report import write_report

    out = tmp_path / "report.html"
    with EventStore.open(mt.url) as store:
        assert write_report(store, mt.run_id, out) == 8
    dom = _chromium(["--dump-dom", out.as_uri()], tmp_path / "profile").decode()
    marker = re.search(r'<p id="render-status" data-plots="(\d+)" data-drawn="(\d+)"', dom)
    assert marker is not None and marker.groups() == ("8", "8"), dom[:2000]
    for chart in ("turns", "trajectories"):
        start = dom.index(f'id="chart-{chart}"')
        end = dom.find('class="plotly-graph-div"', start + 1)
        chunk = dom[start : end if end > 0 else len(dom)]
        assert "main-svg" in chunk and ('class="trace' in chunk or 'class="table' in chunk)

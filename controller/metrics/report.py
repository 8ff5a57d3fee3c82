"""``rolloutlog report``: one self-contained HTML file of plots from the projections.

The data come from the log alone: :func:`~rolloutlog.controller.metrics.projection.project_history`
(the step and restore series, the history and work-done counters) and one pass over
every stored event of the run (the epochs, which of their offsets the current history
kept and which a restore abandoned, the staleness of each selected group, and the
generated tokens over time). The plots are drawn with plotly; its JavaScript is embedded
in the file, so the report opens offline, from a file or an e-mail attachment.

plotly is an optional dependency (the ``report`` extra): :func:`write_report` raises
:class:`ReportError` naming the extra when it is missing.
"""

from __future__ import annotations

import html
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from rolloutlog.eventstore import EventStoreProtocol
from rolloutlog.eventstore.errors import RolloutlogError

from ..domain.events import CODEC, GroupSelected, RunRestored, SiblingCompleted
from ..domain.trajectory import TURN_EVENT_TYPES, TrajectoryBook, evolve_trajectory
from .ranges import project_history


class ReportError(RolloutlogError, RuntimeError):
    """The report cannot be written (plotly missing, an empty run, ...)."""


@dataclass
class EpochSpan:
    """The offsets one epoch wrote, and how much of them the current history kept."""

    epoch: int
    first: int
    last: int
    start: datetime
    end: datetime
    kept: int = 0  # events of this epoch in the current history
    restore: dict[str, Any] | None = None  # the RunRestored fields, for a restore

    @property
    def events(self) -> int:
        """Events the epoch wrote."""
        return self.last - self.first + 1


@dataclass
class ReportData:
    """Everything the plots show, from the log."""

    run_id: str
    values: dict[str, Any]  # project_history(...).values()
    epochs: list[EpochSpan]
    history: list[tuple[int, int]]
    staleness_by_step: dict[int, Counter[int]]  # history: step -> staleness -> groups
    tokens_by_second: list[tuple[float, int]] = field(default_factory=list)  # work done
    #: Multi-turn runs: one row per trajectory (the fold of every stored turn event, all
    #: epochs: a restore reuses turns an abandoned branch recorded); empty otherwise.
    trajectories: list[dict[str, Any]] = field(default_factory=list)


#: Trajectories listed in the report's turns table (the rest are counted, not listed).
MAX_TRAJECTORY_ROWS = 200


def _trajectory_rows(book: TrajectoryBook) -> list[dict[str, Any]]:
    """The report's row of each trajectory of ``book``, by group and sibling."""
    rows = []
    for (group, sibling), t in sorted(book.items()):
        mask = t.loss_mask()
        versions = sorted({s.weight_version for s in t.segments if s.weight_version is not None})
        rows.append(
            {
                "group_id": group,
                "sibling": sibling,
                "prompt_index": t.prompt[1],
                "turns": t.turns,
                "tool_calls": len(t.tool_calls),
                "tool_failures": sum(c.status == "failed" for c in t.tool_calls),
                "resumes": t.resumes,
                "model_tokens": sum(mask),
                "other_tokens": len(mask) - sum(mask),
                "weight_versions": versions,
                "completed": t.completed,
                "final_reward": t.final_reward,
            }
        )
    return rows


def collect(store: EventStoreProtocol, run_id: str) -> ReportData:
    """Read what the report shows from the log of ``run_id``."""
    values = project_history(store, run_id).values()
    history = store.history_segments(run_id)

    def in_history(seq: int) -> bool:
        return any(first <= seq <= last for first, last in history)

    epochs: dict[int, EpochSpan] = {}
    staleness: dict[int, Counter[int]] = defaultdict(Counter)
    tokens: list[tuple[datetime, int]] = []
    book: TrajectoryBook = {}
    for row in store.read(run_id, 1):
        span = epochs.get(row.epoch)
        if span is None:
            span = epochs[row.epoch] = EpochSpan(
                row.epoch, row.seq, row.seq, row.recorded_at, row.recorded_at
            )
        span.last, span.end = row.seq, row.recorded_at
        kept = in_history(row.seq)
        span.kept += kept
        if row.type == RunRestored.event_type:
            ev = CODEC.decode(row)
            assert isinstance(ev, RunRestored)
            span.restore = ev.model_dump()
        elif row.type == GroupSelected.event_type and kept:
            ev = CODEC.decode(row)
            assert isinstance(ev, GroupSelected)
            staleness[ev.train_step][ev.staleness] += 1
        elif row.type in TURN_EVENT_TYPES:
            evolve_trajectory(book, CODEC.decode(row), row.epoch)  # type: ignore[arg-type]
        elif row.type == SiblingCompleted.event_type:
            ev = CODEC.decode(row)
            assert isinstance(ev, SiblingCompleted)
            if ev.salvaged_from is None:  # generated once, in the abandoned branch
                tokens.append((row.recorded_at, ev.completion_tokens))
    if not epochs:
        raise ReportError(f"run {run_id!r} has no events")
    return ReportData(
        run_id,
        values,
        [epochs[e] for e in sorted(epochs)],
        history,
        dict(staleness),
        _per_second(tokens, values["started_at"]),
        _trajectory_rows(book),
    )


def _per_second(tokens: list[tuple[datetime, int]], started: str | None) -> list[tuple[float, int]]:
    """Generated tokens per second of log time, in about 60 bins over the run."""
    if not tokens or started is None:
        return []
    t0 = datetime.fromisoformat(started)
    offsets = [((t - t0).total_seconds(), n) for t, n in tokens]
    span = max(s for s, _ in offsets)
    width = max(0.05, span / 60)
    bins: Counter[int] = Counter()
    for s, n in offsets:
        bins[int(s // width)] += n
    last = max(bins)
    return [((i + 0.5) * width, round(bins[i] / width)) for i in range(last + 1)]


# ---------------------------------------------------------------------------- figures
def _figures(data: ReportData) -> list[tuple[str, str, Any]]:
    """(id, title, plotly figure) of every chart."""
    try:
        import plotly.graph_objects as go
    except ImportError as exc:
        raise ReportError("the HTML report needs plotly: pip install 'rolloutlog[report]'") from exc
    v = data.values
    steps = v["steps"]
    figs: list[tuple[str, str, Any]] = []

    reward = go.Figure()
    by_epoch: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in steps:
        by_epoch[row["epoch"]].append(row)
    for epoch, rows in sorted(by_epoch.items()):
        reward.add_trace(
            go.Scatter(
                x=[r["step"] for r in rows],
                y=[r["reward_mean"] for r in rows],
                mode="lines+markers",
                name=f"epoch {epoch}",
            )
        )
    reward.update_layout(xaxis_title="train step", yaxis_title="mean reward of the batch")
    figs.append(("reward", "Reward per train step (the history trained)", reward))

    stale = go.Figure()
    values = sorted({s for c in data.staleness_by_step.values() for s in c})
    xs = sorted(data.staleness_by_step)
    for s in values:
        stale.add_trace(
            go.Bar(
                x=xs,
                y=[data.staleness_by_step[x].get(s, 0) for x in xs],
                name=f"staleness {s}",
            )
        )
    stale.update_layout(barmode="stack", xaxis_title="train step", yaxis_title="groups selected")
    figs.append(("staleness", "Staleness of the selected groups, per train step", stale))

    throughput = go.Figure(
        go.Scatter(
            x=[t for t, _ in data.tokens_by_second],
            y=[n for _, n in data.tokens_by_second],
            mode="lines",
            fill="tozeroy",
            name="tokens/s",
        )
    )
    for span in data.epochs[1:]:
        throughput.add_vline(
            x=(span.start - datetime.fromisoformat(v["started_at"])).total_seconds(),
            line_dash="dash",
            annotation_text=f"epoch {span.epoch}",
        )
    throughput.update_layout(
        xaxis_title="seconds since the run started (log time)",
        yaxis_title="completion tokens generated per second",
    )
    figs.append(
        ("throughput", "Generation throughput (all work, abandoned branches included)", throughput)
    )

    h = v["history_counters"]
    labels: list[str] = ["trained"]
    counts: list[float] = [h["rollout_groups_trained_total"]]
    for sample in h["rollout_prompts_dropped_total"]:
        labels.append(f"dropped ({sample['outcome']})")
        counts.append(sample["value"])
    for sample in h["rollout_groups_evicted_total"]:
        recovered = ", recovered" if sample["recovered"] == "true" else ""
        labels.append(f"evicted ({sample['reason']}{recovered})")
        counts.append(sample["value"])
    labels.append("still in flight or ready")
    g = v["gauges"]
    counts.append(
        g["rollout_groups_generating"] + g["rollout_buffer_groups"] + g["rollout_spare_groups"]
    )
    outcomes = go.Figure(go.Bar(x=counts, y=labels, orientation="h", text=counts))
    outcomes.update_layout(xaxis_title="prompts (groups) of the current history")
    figs.append(("outcomes", "Prompt outcomes", outcomes))

    timeline = go.Figure()
    for span in data.epochs:
        abandoned = span.events - span.kept
        timeline.add_trace(
            go.Bar(
                x=[span.kept],
                y=[f"epoch {span.epoch}"],
                base=[span.first - 1],
                orientation="h",
                name="kept in the history",
                marker_color="#2a9d8f",
                showlegend=span is data.epochs[0],
                hovertext=f"offsets {span.first}..{span.first + span.kept - 1} kept",
            )
        )
        if abandoned:
            timeline.add_trace(
                go.Bar(
                    x=[abandoned],
                    y=[f"epoch {span.epoch}"],
                    base=[span.first - 1 + span.kept],
                    orientation="h",
                    name="abandoned by a restore",
                    marker_color="#e76f51",
                    hovertext=f"offsets {span.first + span.kept}..{span.last} abandoned",
                )
            )
        if span.restore is not None:
            r = span.restore
            timeline.add_annotation(
                x=span.first,
                y=f"epoch {span.epoch}",
                text=(
                    f"restore from offset {r['from_offset']}: reused {r['siblings_reused']},"
                    f" salvaged {r['siblings_salvaged']}, re-ran {r['siblings_rerun']}"
                ),
                showarrow=True,
                ax=40,
                ay=-30,
            )
    timeline.update_layout(
        barmode="overlay",
        xaxis_title="log offset",
        yaxis={"autorange": "reversed"},
    )
    figs.append(("timeline", "Epochs and restores: what each epoch wrote and kept", timeline))

    header = ["epoch", "from offset", "mode", "complete groups", "unfinished groups",
              "siblings reused", "salvaged", "re-run", "log time rolled back (s)"]  # fmt: skip
    restore_rows = [
        [
            r["epoch"],
            r["from_offset"],
            f"{r['mode']} / {r['granularity']}",
            r["complete_groups_restored"],
            r["unfinished_groups_found"],
            r["siblings_reused"],
            r["siblings_salvaged"],
            r["siblings_rerun"],
            "-" if r["rolled_back_seconds"] is None else f"{r['rolled_back_seconds']:.1f}",
        ]
        for r in v["restores"]
    ] or [["none", "", "", "", "", "", "", "", ""]]
    table = go.Figure(
        go.Table(
            header={"values": header},
            cells={"values": [list(col) for col in zip(*restore_rows, strict=True)]},
        )
    )
    figs.append(("restores", "What each restore reused, salvaged and re-ran", table))
    if data.trajectories:
        figs.extend(_turn_figures(go, data.trajectories))
    return figs


def _turn_figures(go: Any, trajectories: list[dict[str, Any]]) -> list[tuple[str, str, Any]]:
    """A multi-turn run's turns view: turns per trajectory, and a table of trajectories."""
    per_turns = Counter(t["turns"] for t in trajectories)
    done = Counter(t["turns"] for t in trajectories if t["completed"])
    xs = sorted(per_turns)
    hist = go.Figure()
    hist.add_trace(go.Bar(x=xs, y=[done[x] for x in xs], name="completed"))
    hist.add_trace(go.Bar(x=xs, y=[per_turns[x] - done[x] for x in xs], name="not completed"))
    hist.update_layout(
        barmode="stack", xaxis_title="turns (model calls)", yaxis_title="trajectories"
    )
    header = ["group", "sibling", "prompt", "turns", "tool calls", "failed", "resumes",
              "model tokens", "other tokens", "weight versions", "reward"]  # fmt: skip
    shown = trajectories[:MAX_TRAJECTORY_ROWS]
    rows = [
        [
            t["group_id"],
            t["sibling"],
            t["prompt_index"],
            t["turns"],
            t["tool_calls"],
            t["tool_failures"],
            t["resumes"],
            t["model_tokens"],
            t["other_tokens"],
            ", ".join(map(str, t["weight_versions"])),
            ("-" if t["final_reward"] is None else f"{t['final_reward']:.3g}")
            if t["completed"]
            else "not completed",
        ]
        for t in shown
    ]
    table = go.Figure(
        go.Table(
            header={"values": header},
            cells={"values": [list(col) for col in zip(*rows, strict=True)]},
        )
    )
    title = "Trajectories turn by turn (every epoch: restores reuse recorded turns)"
    if len(trajectories) > len(shown):
        title += f": the first {len(shown)} of {len(trajectories)}"
    return [
        ("turns", "Turns per trajectory (multi-turn)", hist),
        ("trajectories", title, table),
    ]


_RENDER_CHECK = """
<script>
// Marks how many charts drew: each plot div must hold an svg with at least one trace
// (or table). Tests (headless Chromium) read the marker from the DOM.
window.addEventListener("load", function () {
  setTimeout(function () {
    var divs = document.querySelectorAll(".plotly-graph-div");
    var drawn = 0;
    divs.forEach(function (d) {
      if (d.querySelector("svg.main-svg") &&
          d.querySelectorAll("g.trace, g.table").length > 0) { drawn += 1; }
    });
    var m = document.getElementById("render-status");
    m.setAttribute("data-plots", String(divs.length));
    m.setAttribute("data-drawn", String(drawn));
    m.textContent = drawn + " of " + divs.length + " charts drawn";
  }, 500);
});
</script>
"""


def render_html(data: ReportData) -> str:
    """The report as one self-contained HTML page."""
    figs = _figures(data)
    from plotly.offline import get_plotlyjs

    v = data.values
    c, h = v["counters"], v["history_counters"]
    kept = sum(b - a + 1 for a, b in data.history)

    def pair(name: str) -> str:
        return f"{c[name]} / {h[name]}"

    summary = [
        ("run", data.run_id),
        ("started (UTC)", v["started_at"]),
        ("newest event (UTC)", (v["last_event"] or {}).get("time")),
        ("train steps in the history", v["gauges"]["rollout_train_step"]),
        ("epochs", len(data.epochs)),
        ("restores", c["rollout_restores_total"]),
        ("events stored / in the history", f"{data.epochs[-1].last} / {kept}"),
        ("groups trained (work done / history)", pair("rollout_groups_trained_total")),
        ("tokens generated (work done / history)", pair("rollout_tokens_generated_total")),
    ]  # fmt: skip
    rows = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(x))}</td></tr>" for k, x in summary
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>rolloutlog report — {html.escape(data.run_id)}</title>",
        "<style>body{font-family:sans-serif;margin:1.5em;max-width:1100px}"
        "table.s th{text-align:left;padding-right:1em}h2{margin-top:1.5em}</style>",
        f"<script>{get_plotlyjs()}</script>",
        "</head><body>",
        f"<h1>rolloutlog report — run {html.escape(data.run_id)}</h1>",
        f'<table class="s">{rows}</table>',
        '<p id="render-status" data-plots="0" data-drawn="0"></p>',
    ]
    for div_id, title, fig in figs:
        fig.update_layout(height=420, margin={"t": 30})
        parts.append(f"<h2>{html.escape(title)}</h2>")
        parts.append(
            fig.to_html(
                full_html=False,
                include_plotlyjs=False,
                div_id=f"chart-{div_id}",
                config={"displaylogo": False},
            )
        )
    parts.append(f"<script>window.rolloutlogData = {json.dumps({'run_id': data.run_id})};</script>")
    parts.append(_RENDER_CHECK)
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(store: EventStoreProtocol, run_id: str, out: Path) -> int:
    """Write the report of ``run_id`` to ``out``; returns the number of charts."""
    data = collect(store, run_id)
    page = render_html(data)
    out.write_text(page, encoding="utf-8")
    return page.count('class="plotly-graph-div"')

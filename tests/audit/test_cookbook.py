"""Every SQL block of ``docs/sql-cookbook.md`` runs on SQLite and PostgreSQL against the
scripted run, through the read-only runner, and its result agrees with the Python
prompt ledger, the replayed state and the store's history; the documented view columns
are the views' columns."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from audit_helpers import BuiltRun
from mt_audit_helpers import FAILING, BuiltMtRun

from rolloutlog.controller.sql_audit import VIEWS, param_names

COOKBOOK = Path(__file__).resolve().parents[2] / "docs" / "sql-cookbook.md"
_BLOCK = re.compile(r"^```sql\n(.*?)^```", re.S | re.M)
_RECIPE = re.compile(r"^-- recipe: ([a-z0-9-]+)\n")


def recipes() -> dict[str, str]:
    """The cookbook's ```sql blocks by recipe name (each block's first line names it)."""
    out: dict[str, str] = {}
    for block in _BLOCK.findall(COOKBOOK.read_text()):
        m = _RECIPE.match(block)
        assert m, f"a cookbook SQL block has no '-- recipe: NAME' first line:\n{block}"
        assert m.group(1) not in out, f"recipe {m.group(1)} appears twice"
        out[m.group(1)] = block
    return out


def documented_columns() -> dict[str, list[str]]:
    """View name -> the columns its table in the cookbook lists, in order."""
    out: dict[str, list[str]] = {}
    current: str | None = None
    for line in COOKBOOK.read_text().splitlines():
        heading = re.match(r"^### `(\w+)`$", line)
        if heading:
            current = heading.group(1)
            out[current] = []
            continue
        if line.startswith("## "):
            current = None
        cell = re.match(r"^\| `(\w+)` \|", line)
        if current is not None and cell:
            out[current].append(cell.group(1))
    return out


def run(b: BuiltRun, name: str, **params: Any) -> list[dict[str, Any]]:
    sql = recipes()[name]
    bound = {"run_id": b.run.run_id, **params}
    return b.audit.select(sql, {k: bound[k] for k in param_names(sql)}, limit=None).rows


def pairs(rows: list[dict[str, Any]], *cols: str) -> list[tuple[Any, ...]]:
    return [tuple(r[c] for c in cols) for r in rows]


# ---------------------------------------------------------------- one check per recipe


def check_step_of_prompt(b: BuiltRun) -> None:
    ledger = b.ledger
    for prompt, group in ledger.group_of_prompt.items():
        (row,) = run(b, "step-of-prompt", prompt_index=prompt)
        assert row["group_id"] == group
        if prompt in ledger.step_of_prompt:
            assert row["outcome"] == "trained"
            assert [row["train_step"]] == ledger.step_of_prompt[prompt]
        else:
            assert row["train_step"] is None
            assert row["outcome"] == (
                "dropped" if prompt in ledger.dropped
                else "evicted" if prompt in ledger.evicted else "live"
            )  # fmt: skip
    assert run(b, "step-of-prompt", prompt_index=10_000) == []


def check_steps_of_all_prompts(b: BuiltRun) -> None:
    got = pairs(run(b, "steps-of-all-prompts"), "prompt_index", "train_step")
    want = sorted((p, s) for p, steps in b.ledger.step_of_prompt.items() for s in steps)
    assert got == want and got


def check_prompts_trained_twice(b: BuiltRun) -> None:
    assert run(b, "prompts-trained-twice") == []
    assert b.ledger.trained_twice == []


def check_dropped_prompts(b: BuiltRun) -> None:
    rows = run(b, "dropped-prompts")
    assert {r["prompt_index"]: r["reason"] for r in rows if r["outcome"] == "dropped"} == (
        b.ledger.dropped
    )
    assert {r["prompt_index"]: r["reason"] for r in rows if r["outcome"] == "evicted"} == (
        b.ledger.evicted
    )
    assert {r["outcome"] for r in rows} == {"dropped", "evicted"}


def check_vacated_slots(b: BuiltRun) -> None:
    rows = {r["prompt_index"]: r for r in run(b, "vacated-slots")}
    assert set(rows) == set(b.ledger.dropped) | set(b.ledger.evicted)
    dropped = rows[b.ledger.prompt_of_group[b.run.dropped_group]]
    assert dropped["vacate_outcome"] == "borrowed" and dropped["replaced_by_prompt"] is None
    evicted = rows[b.ledger.prompt_of_group[b.run.evicted_group]]
    assert evicted["vacate_outcome"] == "replaced"
    assert evicted["replaced_by_prompt"] in b.ledger.step_of_prompt  # the spare trained


def check_live_prompts(b: BuiltRun) -> None:
    rows = run(b, "live-prompts")
    assert {(r["data_pass"], r["prompt_index"]) for r in rows} == b.ledger.unfinished()
    state_phase = {(g.data_pass, g.prompt_index): g.phase.value for g in b.state.groups.values()}
    assert {(r["data_pass"], r["prompt_index"]): r["phase"] for r in rows} == state_phase


def _selected_staleness(b: BuiltRun) -> dict[int, list[int]]:
    from rolloutlog.controller.domain import CODEC
    from rolloutlog.controller.domain.events import GroupSelected

    out: dict[int, list[int]] = defaultdict(list)
    for row in b.history:
        if row.type == "GroupSelected":
            ev = CODEC.decode(row)
            assert isinstance(ev, GroupSelected)
            out[ev.train_step].append(ev.staleness)
    return out


def check_staleness_per_step(b: BuiltRun) -> None:
    rows = run(b, "staleness-per-step")
    stale = _selected_staleness(b)
    assert [r["train_step"] for r in rows] == sorted(stale)
    trained_per_step = Counter(s for steps in b.ledger.step_of_prompt.values() for s in steps)
    for r in rows:
        values = stale[r["train_step"]]
        assert r["groups"] == len(values)
        assert (r["min_staleness"], r["max_staleness"]) == (min(values), max(values))
        assert r["avg_staleness"] == pytest.approx(sum(values) / len(values))
        assert r["shortfall"] == 0
        assert bool(r["trained"]) == (r["train_step"] in b.ledger.step_rewards)
        if r["trained"]:
            assert r["groups"] == trained_per_step[r["train_step"]]


def check_reward_per_step(b: BuiltRun) -> None:
    rows = run(b, "reward-per-step")
    got = {r["train_step"]: r["mean_reward"] for r in rows}
    assert got == pytest.approx(b.ledger.step_rewards)
    assert len(got) == b.state.train_step


def check_step_batch(b: BuiltRun) -> None:
    by_step: dict[int, set[int]] = defaultdict(set)
    for prompt, steps in b.ledger.step_of_prompt.items():
        for s in steps:
            by_step[s].add(prompt)
    for step, prompts in by_step.items():
        rows = run(b, "step-batch", train_step=step)
        assert {r["prompt_index"] for r in rows} == prompts
        assert all(r["trained"] and r["weight_version"] == step + 1 for r in rows)
    # The selected, untrained batch: the state's.
    (pending,) = b.state.batches
    rows = run(b, "step-batch", train_step=pending)
    assert [r["group_id"] for r in rows] == sorted(b.state.batches[pending])
    assert not any(r["trained"] for r in rows)


def check_group_lifecycle(b: BuiltRun) -> None:
    ledger = b.ledger
    for group, prompt in ledger.prompt_of_group.items():
        (row,) = run(b, "group-lifecycle", group_id=group)
        assert row["prompt_index"] == prompt
        if prompt in ledger.step_of_prompt:
            assert row["phase"] == "trained" and row["trained"]
            assert [row["selected_train_step"]] == ledger.step_of_prompt[prompt]
        elif prompt in ledger.dropped:
            assert row["phase"] == "dropped"
            assert row["dropped_reason"] == ledger.dropped[prompt]
        elif prompt in ledger.evicted:
            assert row["phase"] == "evicted"
            assert row["evicted_reason"] == ledger.evicted[prompt]
        else:
            assert row["phase"] == b.state.groups[group].phase.value
    (lent,) = run(b, "group-lifecycle", group_id=b.run.borrowed_group)
    assert (lent["admitted_step"], lent["borrowed_from_step"], lent["target_step"]) == (1, 1, 0)


def check_group_events(b: BuiltRun) -> None:
    groups = {e.group_id for e in b.history if e.group_id is not None}
    for group in groups:
        rows = run(b, "group-events", group_id=group)
        want = [(e.seq, e.epoch, e.type) for e in b.history if e.group_id == group]
        assert pairs(rows, "seq", "epoch", "type") == want


def check_recoveries(b: BuiltRun) -> None:
    rows = run(b, "recoveries")
    restore = rows[0]
    assert [r["kind"] for r in rows] == ["restore", "resume"]
    for key in ("epoch", "from_offset", "mode", "complete_groups_restored",
                "unfinished_groups_found", "siblings_reused", "siblings_rerun",
                "siblings_salvaged"):  # fmt: skip
        assert restore[key] == b.run.report[key], key
    assert restore["recovered_groups_evicted"] == b.run.report["groups_evicted_stale"]
    assert restore["rolled_back_events"] == len(b.all_rows) - len(b.history)


def check_abandoned_events(b: BuiltRun) -> None:
    kept = {e.seq for e in b.history}
    want = Counter((e.epoch, e.type) for e in b.all_rows if e.seq not in kept)
    got = {(r["epoch"], r["type"]): r["events"] for r in run(b, "abandoned-events")}
    assert got == dict(want) and got


def check_history_spans(b: BuiltRun) -> None:
    assert pairs(run(b, "history-spans"), "first_seq", "last_seq") == b.segments


def check_events_per_type_per_epoch(b: BuiltRun) -> None:
    want = Counter((e.epoch, e.type) for e in b.history)
    rows = run(b, "events-per-type-per-epoch")
    assert {(r["epoch"], r["type"]): r["events"] for r in rows} == dict(want)
    assert pairs(rows, "epoch", "type") == sorted(want)


def check_engine_of_sample(b: BuiltRun) -> None:
    # The scripted run generates in process: every sample is there, with no engine (the
    # fleet run in tests/backends/test_fleet_membership.py checks real engine ids).
    gid = next(e.group_id for e in b.history if e.type == "SiblingCompleted")
    want = sorted(
        (e.group_id, json.loads(e.payload)["sibling"], json.loads(e.payload)["attempt"])
        for e in b.history
        if e.type == "SiblingCompleted" and e.group_id == gid
    )
    rows = run(b, "engine-of-sample", group_id=gid)
    assert pairs(rows, "group_id", "sibling", "attempt") == want and want
    assert {r["engine_id"] for r in rows} == {None}


def check_in_flight_on_lost_engine(b: BuiltRun) -> None:
    assert run(b, "in-flight-on-lost-engine", engine_id="e0") == []  # no engine was lost


# ---------------------------------------------------------------- multi-turn recipes


def run_mt(b: BuiltMtRun, name: str, **params: Any) -> list[dict[str, Any]]:
    sql = recipes()[name]
    bound = {"run_id": b.run_id, **params}
    return b.audit.select(sql, {k: bound[k] for k in param_names(sql)}, limit=None).rows


def _requests_by_prompt(b: BuiltMtRun) -> dict[int, list[tuple[int, int, int, str, str]]]:
    """prompt -> (group, sibling, seq, tool, key) of its tool requests: each request is
    its sibling's trajectory in effect at its offset (the newest start before it)."""
    current: dict[tuple[int, int], int] = {}
    out: dict[int, list[tuple[int, int, int, str, str]]] = defaultdict(list)
    for seq, _, e in b.turn_events:
        key = (e.group_id, e.sibling)
        if e.event_type == "TrajectoryStarted":
            current[key] = e.prompt_index  # type: ignore[attr-defined]
        elif e.event_type == "ToolCallRequested":
            out[current[key]].append(
                (e.group_id, e.sibling, seq, e.tool, e.idempotency_key)  # type: ignore[attr-defined]
            )
    return {p: sorted(v) for p, v in out.items()}


def check_tool_calls_of_prompt(b: BuiltMtRun) -> None:
    requests = _requests_by_prompt(b)
    results = {
        e.idempotency_key: e  # type: ignore[attr-defined]
        for _, _, e in b.turn_events
        if e.event_type in ("ToolCallCompleted", "ToolCallFailed")
    }
    seen_failure = seen_status_check = False
    assert len(requests) > 4
    for prompt, want in requests.items():
        rows = run_mt(b, "tool-calls-of-prompt", prompt_index=prompt)
        got = [(r["group_id"], r["sibling"], r["tool"]) for r in rows]
        assert got == [(g, s, tool) for g, s, _, tool, _ in want], prompt
        for row, (*_, key) in zip(rows, want, strict=True):
            res = results.get(key)
            if res is None:
                assert (row["status"], row["result"]) == ("open", None), key
            elif res.event_type == "ToolCallCompleted":
                assert row["status"] == "completed" and row["result"] == res.result  # type: ignore[attr-defined]
                assert row["outcome"] == res.source  # type: ignore[attr-defined]
                seen_status_check |= res.source == "status_check"  # type: ignore[attr-defined]
            else:
                assert row["status"] == "failed" and row["result"] == res.reason  # type: ignore[attr-defined]
                assert row["outcome"] == "error" and row["tool"] == "add"
                assert json.loads(row["arguments"]) == dict(zip("ab", FAILING, strict=True))
                seen_failure = True
    assert seen_failure, "the run holds a failed tool call"
    # Each completed call of the side-effecting tool ran exactly once (its ledger).
    ran = Counter(k for k, _ in b.ledger)
    assert ran and max(ran.values()) == 1
    del seen_status_check  # present only when the restore cut a call mid-way
    assert run_mt(b, "tool-calls-of-prompt", prompt_index=10_000) == []


def check_turns_regenerated_after_restore(b: BuiltMtRun) -> None:
    rows = run_mt(b, "turns-regenerated-after-restore")
    want_calls = Counter(
        (epoch, e.attempt) for _, epoch, e in b.turn_events if e.event_type == "ModelCallCompleted"
    )
    want_resumed = Counter(
        (epoch, e.attempt) for _, epoch, e in b.turn_events if e.event_type == "TrajectoryResumed"
    )
    keys = set(want_calls) | set(want_resumed)
    assert pairs(rows, "epoch", "attempt") == sorted(keys)
    for r in rows:
        key = (r["epoch"], r["attempt"])
        assert r["model_calls"] == want_calls[key], key
        assert r["trajectories_resumed"] == want_resumed[key], key
        assert r["turns_regenerated"] == 0, key
    # The restore's epoch resumed trajectories (turns reused, not regenerated).
    assert sum(r["trajectories_resumed"] for r in rows if r["epoch"] == b.restore_epoch) > 0


def check_tokens_per_weight_version(b: BuiltMtRun) -> None:
    completed = {
        (e.group_id, e.sibling): e.payload_id  # type: ignore[attr-defined]
        for _, _, e in b.turn_events
        if e.event_type == "TrajectoryCompleted"
    }
    assert completed
    for (group, sibling), pid in completed.items():
        arrays = b.token_payloads[pid]
        want = Counter(
            v for v, m in zip(arrays["weight_versions"], arrays["loss_mask"], strict=True) if m
        )
        rows = run_mt(b, "tokens-per-weight-version", group_id=group, sibling=sibling)
        assert {r["weight_version"]: r["tokens"] for r in rows} == dict(want), (group, sibling)
        assert sum(r["model_calls"] for r in rows) == sum(
            1
            for _, _, e in b.turn_events
            if e.event_type == "ModelCallCompleted" and (e.group_id, e.sibling) == (group, sibling)
        )
    assert run_mt(b, "tokens-per-weight-version", group_id=10_000, sibling=0) == []


MT_CHECKS: dict[str, Callable[[BuiltMtRun], None]] = {
    "tool-calls-of-prompt": check_tool_calls_of_prompt,
    "turns-regenerated-after-restore": check_turns_regenerated_after_restore,
    "tokens-per-weight-version": check_tokens_per_weight_version,
}


CHECKS: dict[str, Callable[[BuiltRun], None]] = {
    "step-of-prompt": check_step_of_prompt,
    "steps-of-all-prompts": check_steps_of_all_prompts,
    "prompts-trained-twice": check_prompts_trained_twice,
    "dropped-prompts": check_dropped_prompts,
    "vacated-slots": check_vacated_slots,
    "live-prompts": check_live_prompts,
    "staleness-per-step": check_staleness_per_step,
    "reward-per-step": check_reward_per_step,
    "step-batch": check_step_batch,
    "group-lifecycle": check_group_lifecycle,
    "group-events": check_group_events,
    "recoveries": check_recoveries,
    "abandoned-events": check_abandoned_events,
    "history-spans": check_history_spans,
    "events-per-type-per-epoch": check_events_per_type_per_epoch,
    "engine-of-sample": check_engine_of_sample,
    "in-flight-on-lost-engine": check_in_flight_on_lost_engine,
}


#: The questions the cookbook must answer in one query each.
REQUIRED = {
    "step-of-prompt",  # which step trained prompt 17
    "dropped-prompts",  # which prompts were dropped and why
    "staleness-per-step",
    "step-batch",  # a step's batch
    "group-lifecycle",  # the lifecycle of group G
    "recoveries",  # what each restore recovered
    "events-per-type-per-epoch",
    "tool-calls-of-prompt",  # which tool calls ran for prompt P, with what result
    "turns-regenerated-after-restore",  # 0 on a correct run
    "tokens-per-weight-version",  # in trajectory T
}


def test_every_recipe_has_a_check() -> None:
    names = set(recipes())
    assert not set(CHECKS) & set(MT_CHECKS)
    assert names == set(CHECKS) | set(MT_CHECKS), (
        "each cookbook recipe needs a check here, and vice versa"
    )
    assert names >= REQUIRED


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_recipe(audit_run: BuiltRun, name: str) -> None:
    CHECKS[name](audit_run)


@pytest.mark.parametrize("name", sorted(MT_CHECKS))
def test_multi_turn_recipe(mt_run: BuiltMtRun, name: str) -> None:
    MT_CHECKS[name](mt_run)


class _CliAudit:
    """The recipes as a user runs them: ``rolloutlog audit URL --run R --sql SQL --param
    NAME=VALUE --json`` (the CLI's read-only audit connection; on PostgreSQL as a reader
    role made by ``rolloutlog db create-reader``). Stands in for :class:`SqlAudit` in
    the checks: ``select(sql, params, limit=None).rows``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.queries = 0

    def select(self, sql: str, params: dict[str, Any], *, limit: int | None) -> Any:
        assert limit is None
        from click.testing import CliRunner

        from rolloutlog.cli import main

        args = ["audit", self.url, "--run", str(params["run_id"]), "--sql", sql, "--json"]
        for key, value in params.items():
            if key != "run_id":
                args += ["--param", f"{key}={value}"]
        result = CliRunner().invoke(main, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        self.queries += 1
        return SimpleNamespace(rows=json.loads(result.stdout))


@pytest.fixture
def mt_sql_url(mt_run: BuiltMtRun, request: pytest.FixtureRequest) -> str:
    """The URL a user's ``audit --sql`` runs on: the SQLite file, or a reader role's URL
    on PostgreSQL."""
    if mt_run.dialect == "sqlite":
        return mt_run.url
    url, _role = request.getfixturevalue("mt_reader_role")
    return str(url)


@pytest.mark.parametrize("name", sorted(MT_CHECKS))
def test_multi_turn_recipe_through_the_cli(mt_run: BuiltMtRun, mt_sql_url: str, name: str) -> None:
    """The same checks, each recipe run by ``rolloutlog audit --sql`` as a user would."""
    cli = _CliAudit(mt_sql_url)
    MT_CHECKS[name](dataclasses.replace(mt_run, audit=cli))  # type: ignore[arg-type]
    assert cli.queries > 0


def test_documented_columns_are_the_view_columns(audit_run: BuiltRun) -> None:
    documented = documented_columns()
    assert set(documented) == set(VIEWS)
    for view, columns in documented.items():
        got = audit_run.audit.select(f"SELECT * FROM {view} WHERE 1 = 0").columns
        assert columns == got, view

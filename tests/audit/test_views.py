"""The audit views on a real run agree with the Python prompt ledger, the replayed state
and the store's history; abandoned events never reach them; the migration creates and
drops them on both dialects."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import sqlalchemy as sa
from alembic.script import ScriptDirectory
from audit_helpers import BuiltRun

from rolloutlog.controller.domain import CODEC
from rolloutlog.controller.domain.events import GroupSelected, RunRestored
from rolloutlog.controller.domain.state import Phase
from rolloutlog.controller.sql_audit import VIEWS
from rolloutlog.eventstore import EventStore, migrate

VIEW_NAMES = set(VIEWS)


def rows(b: BuiltRun, sql: str, **params: Any) -> list[dict[str, Any]]:
    return b.audit.select(sql, {"run_id": b.run.run_id, **params}, limit=None).rows


def test_history_events_are_exactly_the_replayed_history(audit_run: BuiltRun) -> None:
    b = audit_run
    got = rows(b, "SELECT seq, epoch, type FROM history_events WHERE run_id = :run_id ORDER BY seq")
    assert [(r["seq"], r["epoch"], r["type"]) for r in got] == [
        (e.seq, e.epoch, e.type) for e in b.history
    ]
    spans = rows(b, "SELECT first_seq, last_seq FROM history_spans WHERE run_id = :run_id "
                 "ORDER BY first_seq")  # fmt: skip
    assert [(r["first_seq"], r["last_seq"]) for r in spans] == b.segments
    kept = {e.seq for e in b.history}
    gone = rows(b, "SELECT seq FROM abandoned_events WHERE run_id = :run_id ORDER BY seq")
    assert [r["seq"] for r in gone] == [e.seq for e in b.all_rows if e.seq not in kept]
    assert gone, "the scripted restore must abandon events"


def test_abandoned_branch_never_reaches_the_views(audit_run: BuiltRun) -> None:
    """The abandoned branch trained prompt 4 at step 1 and dropped prompt 3; the history
    trained prompt 3 at step 1 and prompt 4 at step 3."""
    b = audit_run
    abandoned = [e for e in b.all_rows if e.seq not in {h.seq for h in b.history}]
    abandoned_selected = {
        (ev.prompt_index, ev.train_step)
        for e in abandoned
        if e.type == "GroupSelected"
        for ev in [CODEC.decode(e)]
        if isinstance(ev, GroupSelected)
    }
    assert (b.run.abandoned_trained_prompt, 1) in abandoned_selected
    assert any(e.type == "PromptDropped" and e.prompt_index == 3 for e in abandoned)
    outcomes = {
        r["prompt_index"]: (r["outcome"], r["train_step"])
        for r in rows(b, "SELECT * FROM prompt_outcomes WHERE run_id = :run_id")
    }
    assert outcomes[3] == ("trained", 1)
    assert outcomes[4] == ("trained", 3)
    # No row of any view carries an abandoned offset.
    abandoned_seqs = {e.seq for e in abandoned}
    for sql in (
        "SELECT first_seq AS s FROM group_lifecycle WHERE run_id = :run_id",
        "SELECT last_seq AS s FROM group_lifecycle WHERE run_id = :run_id",
        "SELECT selected_seq AS s FROM step_batches WHERE run_id = :run_id",
        "SELECT selected_seq AS s FROM step_staleness WHERE run_id = :run_id",
        "SELECT seq AS s FROM recoveries WHERE run_id = :run_id",
    ):
        assert not {r["s"] for r in rows(b, sql)} & abandoned_seqs, sql


def test_prompt_outcomes_match_the_ledger(audit_run: BuiltRun) -> None:
    b, ledger = audit_run, audit_run.ledger
    got = rows(b, "SELECT * FROM prompt_outcomes WHERE run_id = :run_id ORDER BY prompt_index")
    assert {r["prompt_index"]: r["group_id"] for r in got} == ledger.group_of_prompt
    trained = defaultdict(list)
    for r in got:
        if r["outcome"] == "trained":
            trained[r["prompt_index"]].append(r["train_step"])
    assert dict(trained) == ledger.step_of_prompt
    assert {r["prompt_index"]: r["reason"] for r in got if r["outcome"] == "dropped"} == (
        ledger.dropped
    )
    assert {r["prompt_index"]: r["reason"] for r in got if r["outcome"] == "evicted"} == (
        ledger.evicted
    )
    # A prompt's identity is (pass, index); this run has one pass.
    assert {r["data_pass"] for r in got} == {0}
    live = {(r["data_pass"], r["prompt_index"]) for r in got if r["outcome"] == "live"}
    assert live == ledger.unfinished()
    assert not ledger.trained_twice and not ledger.pulled_twice
    # The scripted run has every outcome.
    assert Counter(r["outcome"] for r in got).keys() == {"trained", "dropped", "evicted", "live"}


def test_group_lifecycle_matches_the_replayed_state(audit_run: BuiltRun) -> None:
    b, state = audit_run, audit_run.state
    got = {
        r["group_id"]: r for r in rows(b, "SELECT * FROM group_lifecycle WHERE run_id = :run_id")
    }
    assert len(got) == state.next_group_id
    for gid, g in state.groups.items():  # live groups: the phase and stamp of the state
        assert got[gid]["phase"] == g.phase.value, gid
        assert got[gid]["target_step"] == g.target_step, gid
        assert got[gid]["prompt_index"] == g.prompt_index
        if g.phase is Phase.SELECTED:
            assert got[gid]["selected_train_step"] == g.selected_for
            assert got[gid]["staleness"] == g.selected_staleness
    phases = Counter(r["phase"] for r in got.values())
    assert phases["trained"] == state.counters.groups_trained
    assert phases["evicted"] == state.counters.groups_evicted
    assert phases["dropped"] == state.counters.prompts_dropped
    assert {"spare", "admitted", "ready", "selected"} <= phases.keys()
    # The drop, the borrow it caused (repaid by a spare) and the eviction.
    dropped, lent, evicted = (got[b.run.dropped_group], got[b.run.borrowed_group],
                              got[b.run.evicted_group])  # fmt: skip
    assert dropped["vacate_outcome"] == "borrowed" and dropped["failures"] == 2
    assert dropped["dropped_reason"] == b.ledger.dropped[dropped["prompt_index"]]
    assert lent["borrowed_from_step"] == 1 and lent["target_step"] == 0
    assert lent["admitted_step"] == 1 and lent["selected_train_step"] == 0
    repayer = [r for r in got.values() if r["repays_group_id"] == b.run.borrowed_group]
    assert len(repayer) == 1 and repayer[0]["target_step"] == 1
    assert repayer[0]["pulled_as"] == "spare"
    assert repayer[0]["salvaged"] == 1, "the restore salvaged one of its completions"
    assert evicted["phase"] == "evicted" and evicted["vacate_outcome"] == "replaced"
    assert not evicted["evicted_recovered"]
    replacer = [r for r in got.values() if r["replaces_group_id"] == b.run.evicted_group]
    assert len(replacer) == 1 and replacer[0]["target_step"] == evicted["target_step"]


def test_steps_match_the_ledger(audit_run: BuiltRun) -> None:
    b, ledger = audit_run, audit_run.ledger
    batches = rows(b, "SELECT * FROM step_batches WHERE run_id = :run_id")
    by_step: dict[int, set[int]] = defaultdict(set)
    for r in batches:
        if r["trained"]:
            by_step[r["train_step"]].add(r["prompt_index"])
    want: dict[int, set[int]] = defaultdict(set)
    for prompt, steps in ledger.step_of_prompt.items():
        for step in steps:
            want[step].add(prompt)
    assert by_step == want
    steps = {
        r["train_step"]: r for r in rows(b, "SELECT * FROM step_staleness WHERE run_id = :run_id")
    }
    selected = defaultdict(list)
    for e in b.history:
        if e.type == "GroupSelected":
            ev = CODEC.decode(e)
            assert isinstance(ev, GroupSelected)
            selected[ev.train_step].append(ev.staleness)
    assert set(steps) == set(selected)
    for step, stale in selected.items():
        row = steps[step]
        assert row["groups"] == len(stale)
        assert row["max_staleness"] == max(stale) and row["min_staleness"] == min(stale)
        assert abs(row["avg_staleness"] - sum(stale) / len(stale)) < 1e-9
        assert bool(row["trained"]) == (step in ledger.step_rewards)
        if step in ledger.step_rewards:
            assert abs(row["mean_reward"] - ledger.step_rewards[step]) < 1e-9
            assert row["weight_version"] == step + 1
    assert max(r["max_staleness"] for r in steps.values()) <= 1  # the staleness bound


def test_recoveries_match_the_restore_report(audit_run: BuiltRun) -> None:
    b = audit_run
    got = rows(b, "SELECT * FROM recoveries WHERE run_id = :run_id ORDER BY seq")
    assert [r["kind"] for r in got] == ["restore", "resume"]
    restore, resume = got
    report = b.run.report
    for key in ("from_offset", "epoch", "mode", "granularity", "complete_groups_restored",
                "unfinished_groups_found", "siblings_reused", "siblings_rerun",
                "siblings_salvaged"):  # fmt: skip
        assert restore[key] == report[key], key
    assert restore["recovered_groups_evicted"] == report["groups_evicted_stale"]
    assert not restore["forced"]
    restored = next(CODEC.decode(e) for e in b.history if e.type == "RunRestored")
    assert isinstance(restored, RunRestored)
    assert restore["checkpoint_train_step"] == restored.checkpoint_train_step
    assert restore["rolled_back_events"] == len(b.all_rows) - len(b.history)
    assert resume["epoch"] == 3 and resume["rolled_back_events"] == 0
    assert resume["siblings_rerun"] == 2


def test_run_summary(audit_run: BuiltRun) -> None:
    b = audit_run
    (row,) = rows(b, "SELECT * FROM run_summary WHERE run_id = :run_id")
    ledger = b.ledger
    assert row["epochs"] == row["current_epoch"] == 3
    assert row["history_events"] == len(b.history)
    assert row["abandoned_events"] == len(b.all_rows) - len(b.history)
    assert row["steps_trained"] == len(ledger.step_rewards) == b.state.train_step
    assert row["prompts_pulled"] == ledger.prompts_pulled == b.state.dataset_cursor
    assert row["prompts_trained"] == len(ledger.trained)
    assert row["prompts_dropped"] == len(ledger.dropped)
    assert row["prompts_evicted"] == len(ledger.evicted)
    assert row["prompts_live"] == len(ledger.unfinished())


# ---------------------------------------------------------------- the migration


def _views(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(sa.inspect(conn).get_view_names())


def test_migration_creates_and_drops_the_views(db_url: str) -> None:
    store = EventStore.open(db_url, check_schema=False)
    engine = store.engine
    try:
        migrate.upgrade(engine)
        assert _views(engine) == VIEW_NAMES
        with engine.connect() as conn:  # every view runs on an empty log
            for name in VIEW_NAMES:
                assert conn.exec_driver_sql(f"SELECT * FROM {name}").all() == []
        migrate.downgrade(engine, "0001_initial")
        assert _views(engine) == set()
        with engine.connect() as conn:
            assert migrate.current_revision(conn) == "0001_initial"
            assert {"runs", "events", "epochs"} <= set(sa.inspect(conn).get_table_names())
        migrate.upgrade(engine)
        assert _views(engine) == VIEW_NAMES
        migrate.downgrade(engine, "base")
        assert _views(engine) == set()
        with engine.connect() as conn:
            assert set(sa.inspect(conn).get_table_names()) <= {"alembic_version"}
    finally:
        store.close()


def test_the_store_creates_the_views(db_url: str) -> None:
    """``EventStore.open`` upgrades an empty database to head, which includes the views."""
    with EventStore.open(db_url) as store:
        assert _views(store.engine) == VIEW_NAMES
    chain = ScriptDirectory.from_config(migrate.alembic_config()).walk_revisions()
    assert "0002_audit_views" in {s.revision for s in chain}

"""A real run for the SQL audit tests, driven through :class:`RolloutController`.

:func:`build_audit_run` scripts one run whose history has every case the audit views
must get right: a prompt dropped after its attempts ran out (its slot refilled by a
borrow repaid by a spare), a group generated two steps ahead (lookahead 2) and evicted
as stale at weight sync (replaced by a spare),
checkpoints, a crash and a restore to the first checkpoint (salvaging one completion)
after which the abandoned branch and the new history disagree on what trained, a
takeover (``RolloutController.open``), a batch selected but not trained, and live
groups in every phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.domain.commands import (
    AdmitStep,
    CompleteSibling,
    DispatchSiblings,
    FailSibling,
    PublishWeights,
    RecordTrainStep,
    SelectBatch,
)
from rolloutlog.controller.domain.completion import Completion
from rolloutlog.controller.domain.state import RunState, SiblingStatus
from rolloutlog.controller.prompt_ledger import PromptLedger
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_index import IndexedEvent
from rolloutlog.controller.sql_audit import SqlAudit
from rolloutlog.eventstore import EventStore

RUN_ID = "audit-run"
DATASET_SIZE = 60
RULES = RolloutConfig(
    group_size=2,
    groups_per_step=3,
    sampler="in_order",
    staleness_bound=1,
    lookahead=2,
    spare_pool_size=2,
    drop_policy="replace",
    attempts_per_sibling=2,
)


@dataclass
class AuditRun:
    """What the scripted run did, for the tests to check the SQL against."""

    run_id: str
    checkpoints: list[int] = field(default_factory=list)
    restored_from: int = 0
    dropped_group: int = 0
    borrowed_group: int = 0
    evicted_group: int = 0
    abandoned_trained_prompt: int = 0
    report: dict[str, object] = field(default_factory=dict)


class _Driver:
    def __init__(self, ctl: RolloutController) -> None:
        self.ctl = ctl

    def admit(self) -> None:
        self.ctl.execute(AdmitStep())

    def dispatch(
        self, gid: int, siblings: tuple[int, ...] | None = None, version: int | None = None
    ) -> None:
        g = self.ctl.state.groups[gid]
        sibs = siblings or tuple(
            i for i, s in enumerate(g.siblings) if s.status is SiblingStatus.PENDING
        )
        v = self.ctl.state.published_version if version is None else version
        self.ctl.execute(DispatchSiblings(gid, sibs, v))

    def complete(self, gid: int, sibling: int, reward: float | None = None) -> None:
        s = self.ctl.state.groups[gid].siblings[sibling]
        self.ctl.execute(
            CompleteSibling(
                Completion(
                    group_id=gid,
                    sibling=sibling,
                    attempt=s.attempt,
                    weight_version=s.weight_version or 0,
                    prompt_tokens=3,
                    completion_tokens=4 + sibling,
                    reward=reward if reward is not None else (gid % 5) / 4 + sibling / 8,
                    payload_id=f"g{gid}-s{sibling}-a{s.attempt}-e{self.ctl.epoch}",
                    finish_reason="stop",
                )
            )
        )

    def fail(self, gid: int, sibling: int) -> None:
        s = self.ctl.state.groups[gid].siblings[sibling]
        self.ctl.execute(FailSibling(gid, sibling, s.attempt, True, "engine error"))

    def finish(self, gid: int, version: int | None = None) -> None:
        if any(s.status is SiblingStatus.PENDING for s in self.ctl.state.groups[gid].siblings):
            self.dispatch(gid, version=version)
        for i, s in enumerate(self.ctl.state.groups[gid].siblings):
            if s.status is SiblingStatus.IN_FLIGHT:
                self.complete(gid, i)

    def train(self, *, publish: bool = True) -> None:
        step = self.ctl.state.train_step
        self.ctl.execute(SelectBatch(step))
        self.ctl.execute(RecordTrainStep(step, self.ctl.state.weight_version + 1))
        if publish:
            self.ctl.execute(PublishWeights(self.ctl.state.weight_version))


def build_audit_run(store: EventStore, run_id: str = RUN_ID) -> AuditRun:
    """Script the run (see the module docstring) into ``store``; return what it did."""
    # The scripted completions name payloads they do not store.
    sc = StoreConfig(snapshot_interval=0, group_commit_window_ms=0, require_stored_payloads=False)
    out = AuditRun(run_id)
    ctl = RolloutController.start(
        store, run_id, RULES, dataset_fingerprint="toy", dataset_size=DATASET_SIZE,
        store_config=sc,
    )  # fmt: skip
    d = _Driver(ctl)
    d.admit()  # step 0: groups 0, 1, 2 (prompts 0..2); spares 3, 4
    d.admit()  # step 1: groups 5, 6, 7
    for gid in (5, 6, 7, 0, 1):
        d.finish(gid)
    # Group 2 fails twice: dropped; step 0 borrows ready group 7 from step 1, and spare
    # group 3 repays the loan with step 1's stamp.
    d.dispatch(2)
    d.fail(2, 0)
    d.dispatch(2, (0,))
    d.fail(2, 0)
    out.dropped_group, out.borrowed_group = 2, 7
    d.train()  # step 0: groups 0, 1, 7 -> weights 1
    d.dispatch(3)  # in flight at the checkpoint
    out.checkpoints.append(ctl.checkpoint(1))
    # ---- the branch the restore abandons: sibling 0 of group 3 completes with weights
    # the restored trainer still has (salvaged later), sibling 1 fails out, so group 3
    # is dropped and spare 4 trains at step 1 in its place.
    d.complete(3, 0)
    d.fail(3, 1)
    d.dispatch(3, (1,))
    d.fail(3, 1)
    d.admit()  # step 2
    d.finish(4)
    d.train()  # step 1 (abandoned): groups 4, 5, 6
    out.abandoned_trained_prompt = 4
    ctl.close()  # the crash: everything above is durable but will leave the history
    # ---- restore to the first checkpoint (epoch 2), salvaging group 3's sibling 0.
    out.restored_from = out.checkpoints[0]
    ctl, report = RolloutController.restore(
        store, run_id, out.restored_from, rollout=RULES, dataset_fingerprint="toy",
        store_config=sc,
    )  # fmt: skip
    out.report = report.to_dict()
    d = _Driver(ctl)
    d.finish(3)  # sibling 1 re-runs and completes: group 3 trains at step 1 this time
    d.admit()  # step 2: groups 9, 10, 11
    d.admit()  # step 3 (lookahead 2)
    step3 = sorted(g.group_id for g in ctl.state.groups.values() if g.target_step == 3)
    out.evicted_group = step3[0]
    d.finish(step3[0])  # generated with weights 1: too stale once weights 3 are published
    d.train()  # step 1: groups 3, 5, 6 -> weights 2
    for gid in (9, 10, 11):
        d.finish(gid)
    d.train()  # step 2 -> weights 3; publishing them evicts step3[0], spare 4 replaces it
    out.checkpoints.append(ctl.checkpoint(3))
    for gid in sorted(g.group_id for g in ctl.state.groups.values() if g.target_step == 3):
        d.finish(gid)
    d.admit()  # step 4
    step4 = sorted(g.group_id for g in ctl.state.groups.values() if g.target_step == 4)
    d.finish(step4[0])
    d.dispatch(step4[1])
    ctl.close()
    # ---- a takeover (epoch 3): in-flight work re-runs; step 3 trains, step 4 is
    # selected but not trained, step 5 has a ready, an in-flight and an idle group.
    ctl = RolloutController.open(store, run_id, store_config=sc)
    d = _Driver(ctl)
    for gid in step4[1:]:
        d.finish(gid)
    d.train()  # step 3 -> weights 4
    ctl.execute(SelectBatch(4))
    d.admit()  # step 5
    step5 = sorted(g.group_id for g in ctl.state.groups.values() if g.target_step == 5)
    d.finish(step5[0])
    d.dispatch(step5[1])
    ctl.close()
    return out


@dataclass
class BuiltRun:
    """A scripted run in a database, with everything the Python side knows about it."""

    url: str
    dialect: str
    run: AuditRun
    ledger: PromptLedger
    state: RunState
    history: list[IndexedEvent]
    all_rows: list[IndexedEvent]
    segments: list[tuple[int, int]]
    audit: SqlAudit


def db_fingerprint(url: str) -> dict[str, object]:
    """Every table's row count and a hash of its content, read behind the audit (plus, on
    PostgreSQL, the large objects, advisory locks, and the roles' settings and grants)."""
    import hashlib

    import sqlalchemy as sa

    engine = sa.create_engine(url)
    out: dict[str, object] = {}
    try:
        with engine.connect() as conn:
            if engine.dialect.name == "sqlite":
                tables = (
                    conn.exec_driver_sql(
                        "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
                    )
                    .scalars()
                    .all()
                )
                out["schema"] = conn.exec_driver_sql(
                    "SELECT type, name, sql FROM sqlite_master ORDER BY type, name"
                ).all()
            else:
                # The rows of every table and materialized view; a view by its definition,
                # and the functions a view may call by theirs: a view's rows follow from
                # those (evaluating the audit's views took most of the fingerprint's time).
                user_schema = (
                    "n.nspname NOT IN ('pg_catalog', 'information_schema') "
                    "AND n.nspname NOT LIKE 'pg_toast%%'"
                )
                tables = (
                    conn.exec_driver_sql(
                        "SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname) "
                        "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                        f"WHERE c.relkind IN ('r', 'p', 'm') AND {user_schema} ORDER BY 1"
                    )
                    .scalars()
                    .all()
                )
                out["views"] = conn.exec_driver_sql(
                    "SELECT n.nspname, c.relname, pg_get_viewdef(c.oid) "
                    "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                    f"WHERE c.relkind = 'v' AND {user_schema} ORDER BY 1, 2"
                ).all()
                out["functions"] = conn.exec_driver_sql(
                    "SELECT p.oid::regprocedure::text, p.prokind, "
                    "CASE WHEN p.prokind IN ('f', 'p') THEN pg_get_functiondef(p.oid) END "
                    "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
                    f"WHERE {user_schema} ORDER BY 1"
                ).all()
                out["large_objects"] = conn.exec_driver_sql(
                    "SELECT count(*) FROM pg_largeobject_metadata"
                ).scalar()
                # pg_locks and roles are the whole server's, and other test sessions
                # (pytest-xdist workers, other checkouts) take locks in their own databases
                # and make and drop their own `rl_` scratch roles meanwhile: count this
                # database's locks, and of the scratch roles only those granted something
                # here (this test's reader role), every other role as before.
                out["advisory_locks"] = conn.exec_driver_sql(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = "
                    "(SELECT oid FROM pg_database WHERE datname = current_database())"
                ).scalar()
                out["role_settings"] = conn.exec_driver_sql(
                    "SELECT r.rolname, r.rolsuper, r.rolcreaterole, s.setconfig FROM pg_roles r "
                    "LEFT JOIN pg_db_role_setting s ON s.setrole = r.oid "
                    "WHERE r.rolname NOT LIKE 'rl\\_%%' OR r.oid IN "
                    "(SELECT (aclexplode(c.relacl)).grantee FROM pg_class c "
                    "WHERE c.relnamespace = 'public'::regnamespace AND c.relacl IS NOT NULL) "
                    "ORDER BY 1"
                ).all()
                out["grants"] = conn.exec_driver_sql(
                    "SELECT relname, relacl::text FROM pg_class WHERE relnamespace = "
                    "'public'::regnamespace ORDER BY 1"
                ).all()
            if engine.dialect.name == "sqlite":
                for table in tables:
                    rows = conn.exec_driver_sql(f"SELECT * FROM {table}").all()
                    digest = hashlib.sha256(
                        "\n".join(sorted(repr(tuple(r)) for r in rows)).encode()
                    ).hexdigest()
                    out[table] = (len(rows), digest)
            elif tables:
                # Every relation's rows (each as its whole-row text, sorted) hashed by the
                # server, in one statement: one round trip, not one per table and view
                # (the hypothesis test takes two fingerprints per example).
                per_table = " UNION ALL ".join(
                    f"SELECT {i}, count(*), md5(coalesce(string_agg(x::text, chr(10) "
                    f"ORDER BY x::text), '')) FROM {table} x"
                    for i, table in enumerate(tables)
                )
                for i, count, digest in conn.exec_driver_sql(per_table).all():
                    out[tables[i]] = (count, digest)
    finally:
        engine.dispose()
    return out


def drop_role(admin_url: str, role: str) -> None:
    """Drop a role made by a test, with its grants in the database ``admin_url`` names."""
    import sqlalchemy as sa

    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            exists = conn.exec_driver_sql(
                "SELECT 1 FROM pg_roles WHERE rolname = %(r)s", {"r": role}
            ).first()
            if exists:
                conn.exec_driver_sql(f'DROP OWNED BY "{role}"')
                conn.exec_driver_sql(f'DROP ROLE "{role}"')
    finally:
        engine.dispose()

"""What the rollout log says about a TRL run that was killed and resumed.

Read from the log alone (SQLite or PostgreSQL): the independent prompt ledger's
cross-check (no prompt lost, none trained twice in the current history), the restore's
``RunRestored`` record, and the salvaged siblings (``SiblingCompleted`` with
``salvaged_from``) with any dispatch of one of them after the restore (there must be
none: a salvaged completion is reused, not regenerated).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rolloutlog.controller.domain.events import (
    CODEC,
    RunRestored,
    SiblingCompleted,
    SiblingDispatched,
)
from rolloutlog.controller.domain.invariants import find_violations
from rolloutlog.controller.prompt_ledger import build_ledger, cross_check
from rolloutlog.controller.rollout_controller import replay
from rolloutlog.eventstore import EventStore


@dataclass
class ResumeAudit:
    """The log's account of a run (after its last restore, where there is one)."""

    run_id: str
    prompts_pulled: int
    prompts_trained: int
    prompts_dropped: int
    prompts_evicted: int
    prompts_live_at_end: int
    prompts_lost: int
    prompts_trained_twice: int
    steps_trained: int
    #: The last restore (``None``: the run was never restored).
    restored_from_offset: int | None
    checkpoint_train_step: int | None
    unfinished_groups_found: int
    complete_groups_restored: int
    #: Groups with at least one sibling salvaged by the restore, and those siblings.
    groups_salvaged: int
    siblings_salvaged: int
    #: Salvaged siblings dispatched again after the restore (must be 0).
    salvaged_siblings_redispatched: int
    invariant_violations: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return asdict(self)


def audit_run(store_url: str, run_id: str) -> ResumeAudit:
    """Audit run ``run_id`` of the log at ``store_url`` (see the module doc)."""
    store = EventStore.open(store_url)
    try:
        state = replay(store, run_id).state
        check = cross_check(build_ledger(store, run_id), state)
        violations = [str(v) for v in find_violations(state)]
        history = [CODEC.decode(row) for row in store.read_history(run_id)]
    finally:
        store.close()
    restored_at = max(
        (i for i, ev in enumerate(history) if isinstance(ev, RunRestored)), default=None
    )
    restore = None if restored_at is None else history[restored_at]
    after = [] if restored_at is None else history[restored_at + 1 :]
    salvaged = {
        (ev.group_id, ev.sibling)
        for ev in after
        if isinstance(ev, SiblingCompleted) and ev.salvaged_from is not None
    }
    redispatched = sum(
        1
        for ev in after
        if isinstance(ev, SiblingDispatched) and (ev.group_id, ev.sibling) in salvaged
    )
    assert restore is None or isinstance(restore, RunRestored)
    return ResumeAudit(
        run_id=run_id,
        prompts_pulled=check.prompts_pulled,
        prompts_trained=check.prompts_trained,
        prompts_dropped=check.prompts_dropped,
        prompts_evicted=check.prompts_evicted,
        prompts_live_at_end=check.prompts_live,
        prompts_lost=check.prompts_lost,
        prompts_trained_twice=check.prompts_trained_twice,
        steps_trained=state.train_step,
        restored_from_offset=None if restore is None else restore.from_offset,
        checkpoint_train_step=None if restore is None else restore.checkpoint_train_step,
        unfinished_groups_found=0 if restore is None else restore.unfinished_groups_found,
        complete_groups_restored=0 if restore is None else restore.complete_groups_restored,
        groups_salvaged=len({g for g, _ in salvaged}),
        siblings_salvaged=len(salvaged),
        salvaged_siblings_redispatched=redispatched,
        invariant_violations=violations,
    )

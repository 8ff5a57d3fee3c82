"""A salvaged completion keeps the engine that generated it (issue 31, item 2).

``engine_id`` is null only where no engine is known (an in-process backend, an older
log): a completion salvaged by a restore names the engine that generated it in the
abandoned branch, in the event and in the ``sample_engines`` view. On a SQLite file.
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from domain_helpers import admit, dispatch, restore, rules, start

from rolloutlog.controller.domain import CompleteSibling, Completion
from rolloutlog.controller.domain.events import SiblingCompleted
from rolloutlog.controller.rollout_controller import iter_history
from rolloutlog.eventstore import EventStore, PayloadPut


def test_a_salvaged_completion_keeps_its_engine(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    config = rules(group_size=2, groups_per_step=1, spare_pool_size=0)
    store = EventStore.open(url)
    try:
        ctl = start(store, config)
        admit(ctl)
        dispatch(ctl, 0)
        checkpoint = ctl.checkpoint(0)
        # After the checkpoint, engine e7 generates sibling 0; then the process dies.
        sib = ctl.state.groups[0].siblings[0]
        completion = Completion(0, 0, sib.attempt, 0, 3, 4, 1.0, "p-0-0", "stop", "e7")
        ctl.execute(
            CompleteSibling(completion), payload_puts=(PayloadPut("p-0-0", "sibling", b"t"),)
        )
        ctl.flush()
        ctl.close()
        restored, report = restore(store, config, checkpoint)
        restored.close()
        assert report.siblings_salvaged == 1
        salvaged = [
            (row.seq, ev)
            for row, ev in iter_history(store, "run")
            if isinstance(ev, SiblingCompleted) and ev.salvaged_from is not None
        ]
        assert [(ev.sibling, ev.engine_id) for _, ev in salvaged] == [(0, "e7")]
        engine = sa.create_engine(url)
        try:
            with engine.connect() as conn:
                rows = conn.execute(
                    sa.text("SELECT seq, engine_id FROM sample_engines WHERE run_id = 'run'")
                ).all()
        finally:
            engine.dispose()
        # The view holds the current history's completions: the salvaged one, engine kept.
        assert [tuple(r) for r in rows] == [(salvaged[0][0], "e7")]
    finally:
        store.close()

"""A real multi-turn run for the SQL audit tests of the turn views.

:func:`build_mt_run` drives the calculator task of ``tests/multiturn/mt_task.py`` (a
TRL-shaped environment, a plain tool with side effects and a status check, an
idempotent environment method) through the rollout runtime on the given store: two
steps with a checkpoint after each, a restore to the first step's checkpoint (which
abandons the second step's turns and resumes the trajectories the checkpoint left
open), then a third step. The ``add`` tool raises for one operand pair, so the log
also holds tool failures.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_MT = str(Path(__file__).resolve().parents[1] / "multiturn")
if _MT not in sys.path:
    sys.path.insert(0, _MT)

from mt_task import ROLLOUT, RUN, STORE, Ledger, Prompts, runtime, start  # noqa: E402

from rolloutlog.controller.domain.events import CODEC  # noqa: E402
from rolloutlog.controller.domain.trajectory import TURN_EVENT_TYPES, TurnEvent  # noqa: E402
from rolloutlog.controller.environments import Tool  # noqa: E402
from rolloutlog.controller.rollout_controller import RolloutController  # noqa: E402
from rolloutlog.controller.sql_audit import SqlAudit  # noqa: E402
from rolloutlog.eventstore import EventStore  # noqa: E402

WEIGHTS = [("w", torch.zeros(1))]
#: The operands the calculator refuses (a tool failure, outcome ``error``).
FAILING = (5, 1)


class FailingLedger(Ledger):
    """The calculator ledger, raising for :data:`FAILING` (before any side effect)."""

    def add(self, a: int, b: int, idempotency_key: str) -> str:
        if (int(a), int(b)) == FAILING:
            raise ValueError(f"calculator refuses {a}+{b}")
        return super().add(a, b, idempotency_key)

    def tool(self) -> Tool:
        return Tool("add", self.add, status=self.status)


async def _drive(ctl: RolloutController, ledger: Ledger, steps: int) -> None:
    rt, _, _ = runtime(ctl, ledger)
    await rt.start()
    try:
        await rt.sync_weights(WEIGHTS, ctl.state.weight_version)
        for step in range(ctl.state.train_step, steps):
            await rt.next_batch(step, timeout=60)
            await rt.report_trained(step, step + 1)
            await rt.publish_weights(WEIGHTS, step + 1)
            await rt.checkpoint(step + 1)
    finally:
        await rt.close()


@dataclass
class BuiltMtRun:
    """The multi-turn run, its turn events (every epoch) and a read-only audit."""

    url: str
    dialect: str
    run_id: str
    restored_from: int
    restore_epoch: int
    #: ``(seq, epoch, event)`` of every trajectory event, history and abandoned.
    turn_events: list[tuple[int, int, TurnEvent]]
    #: The offsets of the current history.
    history: set[int]
    ledger: list[tuple[str, str]]
    token_payloads: dict[str, dict[str, Any]]
    audit: SqlAudit


def build_mt_run(store: EventStore, url: str, ledger_path: Path) -> BuiltMtRun:
    from rolloutlog.eventstore import decode_arrays

    ledger = FailingLedger(ledger_path)
    ctl = start(store)
    ctl.checkpoint(0)
    asyncio.run(_drive(ctl, ledger, 2))
    ctl.close()
    checkpoints = [r.seq for r in store.read(RUN) if r.type == "CheckpointMarked"]
    restored_from = checkpoints[-2]  # step 1's: step 2's turns are abandoned
    ctl, _ = RolloutController.restore(
        store,
        RUN,
        restored_from,
        rollout=ROLLOUT,
        dataset_fingerprint=Prompts.fingerprint,
        store_config=STORE,
    )
    restore_epoch = ctl.epoch
    asyncio.run(_drive(ctl, ledger, 3))
    ctl.close()
    events: list[tuple[int, int, TurnEvent]] = []
    payloads: dict[str, dict[str, Any]] = {}
    for r in store.read(RUN):
        if r.type in TURN_EVENT_TYPES:
            ev = CODEC.decode(r)
            assert isinstance(ev, TurnEvent)
            events.append((r.seq, r.epoch, ev))
            if r.type == "TrajectoryCompleted":
                pid = ev.payload_id  # type: ignore[attr-defined]
                payloads[pid] = {
                    k: v.tolist() for k, v in decode_arrays(store.get_payload(RUN, pid)).items()
                }
    history = {s for a, b in store.history_segments(RUN) for s in range(a, b + 1)}
    return BuiltMtRun(
        url=url,
        dialect=store.dialect,
        run_id=RUN,
        restored_from=restored_from,
        restore_epoch=restore_epoch,
        turn_events=events,
        history=history,
        ledger=ledger.entries(),
        token_payloads=payloads,
        audit=SqlAudit(url, allow_privileged_role=True),
    )

"""``replay --check`` agrees with restore (issue 9, item 12), and a restore checks the
dataset fingerprint even without the rollout rules (item 13)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from rolloutlog.cli import main
from rolloutlog.controller import replay_tool as rt
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.domain import AdmitStep
from rolloutlog.controller.domain.errors import CursorBehindError, RestoreError
from rolloutlog.controller.domain.events import CheckpointMarked
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_index import encode
from rolloutlog.eventstore import EventStore

CFG = RolloutConfig(group_size=2, groups_per_step=2, lookahead=2, spare_pool_size=1)


def _log_with_a_stale_checkpoint(url: str, field: str) -> int:
    """A run whose last event is a CheckpointMarked with one stale cursor; its offset."""
    store = EventStore.open(url)
    ctl = RolloutController.start(
        store,
        "r",
        CFG,
        dataset_fingerprint="ds",
        dataset_size=40,
        store_config=StoreConfig(group_commit_window_ms=0),
    )
    for _ in range(3):
        ctl.execute(AdmitStep())
    ctl.flush()
    state = ctl.state.copy()
    ctl.close()
    cursors = {"dispatch_cursor": state.dispatch_cursor, "dataset_cursor": state.dataset_cursor}
    cursors[field] = 1 if field == "dispatch_cursor" else 3
    forged = CheckpointMarked(train_step=0, weight_version=0, **cursors)
    row = encode(forged, recorded_at=datetime.now(UTC), train_step=0, weight_version=0)
    info = store.get_run("r")
    offset = store.append("r", [row], expected_seq=info.last_seq + 1, epoch=info.current_epoch)
    store.close()
    return offset


@pytest.mark.parametrize("field", ["dispatch_cursor", "dataset_cursor"])
def test_check_reports_a_checkpoint_that_restore_refuses(tmp_path: Path, field: str) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    offset = _log_with_a_stale_checkpoint(url, field)
    store = EventStore.open(url)
    with pytest.raises(CursorBehindError):
        RolloutController.restore(store, "r", offset)
    res = rt.check_history(store, "r")
    store.close()
    assert res.violation is not None
    assert res.violation["offset"] == offset
    assert res.violation["error"] == "CursorBehindError"
    assert field.split("_")[0] in res.violation["message"]
    result = CliRunner().invoke(main, ["replay", url, "--check", "--json"])
    assert result.exit_code == 1, result.output
    assert json.loads(result.output)["violation"]["offset"] == offset


def test_restore_checks_the_dataset_fingerprint_without_the_rules(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    store = EventStore.open(url)
    ctl = RolloutController.start(store, "r", CFG, dataset_fingerprint="ds", dataset_size=40)
    offset = ctl.checkpoint(0)
    ctl.close()
    before = store.get_run("r")
    with pytest.raises(RestoreError, match=r"dataset fingerprint mismatch.*'ds'.*'other'"):
        RolloutController.restore(store, "r", offset, dataset_fingerprint="other")
    after = store.get_run("r")
    assert (after.last_seq, after.current_epoch) == (before.last_seq, before.current_epoch)
    ctl, _ = RolloutController.restore(store, "r", offset, dataset_fingerprint="ds")
    ctl.close()
    ctl, _ = RolloutController.restore(store, "r", offset, dataset_fingerprint="other", force=True)
    ctl.close()
    store.close()

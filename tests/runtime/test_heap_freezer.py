"""``store.gc_freeze_interval``: the controller moves the live heap out of CPython's
full collections every interval events, and gives it back when the last such
controller closes (a process-wide setting must not outlive its users)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.domain import AdmitStep
from rolloutlog.controller.gc_freeze import HeapFreezer
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.eventstore import EventStore


def _controller(tmp_path: Path, name: str, interval: int) -> RolloutController:
    url = f"sqlite:///{tmp_path / f'{name}.db'}"
    return RolloutController.start(
        EventStore.open(url),
        name,
        RolloutConfig(group_size=2, groups_per_step=2, lookahead=50, spare_pool_size=0),
        dataset_fingerprint="d",
        dataset_size=1000,
        store_config=StoreConfig(url=url, gc_freeze_interval=interval),
    )


def test_off_by_default_nothing_is_frozen(tmp_path: Path) -> None:
    assert StoreConfig().gc_freeze_interval == 0
    before = gc.get_freeze_count()
    ctl = _controller(tmp_path, "off", 0)
    try:
        for _ in range(5):
            ctl.execute(AdmitStep())
        assert ctl.heap_freezer.freezes == 0
        assert gc.get_freeze_count() == before
    finally:
        ctl.close()
        ctl.store.close()


def test_freezes_every_interval_and_the_last_close_unfreezes(tmp_path: Path) -> None:
    gc.unfreeze()
    a = _controller(tmp_path, "a", 4)
    b = _controller(tmp_path, "b", 4)
    try:
        assert a.heap_freezer.freezes == 1  # at open: the full collection is the opening's
        assert gc.get_freeze_count() > 0
        start = a.heap_freezer.freezes
        for _ in range(12):  # each admission: 3 events (StepAdmitted, 2 GroupAdmitted)
            a.execute(AdmitStep())
        # 36 events at one freeze per >= 4 events, checked after each 3-event command.
        assert a.heap_freezer.freezes - start == 36 // 6
        assert a.heap_freezer.max_freeze_s > 0
        a.close()
        assert gc.get_freeze_count() > 0  # b still holds the freeze
    finally:
        a.close()
        b.close()
        a.store.close()
        b.store.close()
    assert gc.get_freeze_count() == 0  # everything is collectable again


def test_a_frozen_cycle_is_reclaimed_after_the_unfreeze() -> None:
    gc.unfreeze()

    class Node:
        other: object = None

    freezer = HeapFreezer(1)
    x, y = Node(), Node()
    x.other, y.other = y, x

    probe = weakref.ref(x)
    freezer.start(0)  # the cycle is alive: it is frozen
    del x, y
    gc.collect()
    assert probe() is not None  # frozen garbage: the documented price
    freezer.close()
    gc.collect()
    assert probe() is None

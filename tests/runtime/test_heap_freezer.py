"""The controller keeps the process's heap out of CPython's full collections: once at
the first open (``store.gc_freeze_at_open``, the default) and, opt-in, every interval
events (``store.gc_freeze_interval``); it gives the heap back when the last controller
holding the freeze closes (a process-wide setting must not outlive its users)."""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from rolloutlog.controller import gc_freeze
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.domain import AdmitStep
from rolloutlog.controller.gc_freeze import HeapFreezer
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.eventstore import EventStore


@pytest.fixture(autouse=True)
def _no_freeze_held(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts from a process with nothing frozen and no holder (the freeze is
    process-wide: another test's open controller must not decide these)."""
    monkeypatch.setattr(gc_freeze, "_holders", 0)
    monkeypatch.setattr(gc_freeze, "_owned", False)
    monkeypatch.setattr(gc_freeze, "_count_after", 0)
    gc.unfreeze()
    yield
    gc.unfreeze()


def _controller(
    tmp_path: Path, name: str, interval: int = 0, *, at_open: bool = True
) -> RolloutController:
    url = f"sqlite:///{tmp_path / f'{name}.db'}"
    return RolloutController.start(
        EventStore.open(url),
        name,
        RolloutConfig(group_size=2, groups_per_step=2, lookahead=50, spare_pool_size=0),
        dataset_fingerprint="d",
        dataset_size=1000,
        store_config=StoreConfig(url=url, gc_freeze_interval=interval, gc_freeze_at_open=at_open),
    )


def _close(*ctls: RolloutController) -> None:
    for ctl in ctls:
        ctl.close()
        ctl.store.close()


def test_the_first_open_freezes_once_and_the_last_close_unfreezes(tmp_path: Path) -> None:
    assert StoreConfig().gc_freeze_at_open is True
    assert StoreConfig().gc_freeze_interval == 0
    a = _controller(tmp_path, "a")
    try:
        assert a.heap_freezer.freezes == 1 and a.heap_freezer.holding
        frozen = gc.get_freeze_count()
        assert frozen > 0
        b = _controller(tmp_path, "b")  # joins the freeze: nothing more is frozen
        try:
            assert b.heap_freezer.freezes == 0 and b.heap_freezer.holding
            # Frozen objects freed by reference counting leave the count; none join it.
            assert 0 < gc.get_freeze_count() <= frozen
            for _ in range(5):
                b.execute(AdmitStep())
            assert b.heap_freezer.freezes == 0  # no interval: never again
            a.close()
            assert gc.get_freeze_count() > 0  # b still holds the freeze
        finally:
            _close(b)
        assert gc.get_freeze_count() == 0  # everything is collectable again
    finally:
        _close(a)


def test_an_open_that_fails_leaves_the_freeze(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _controller(tmp_path, "run")
    _close(first)
    assert gc.get_freeze_count() == 0

    seen: list[tuple[int, int]] = []

    def refuse(self: RolloutController, command: object) -> None:
        seen.append((self.heap_freezer.freezes, gc.get_freeze_count()))
        raise RuntimeError(f"injected: {type(command).__name__} refused")

    monkeypatch.setattr(RolloutController, "execute", refuse)
    url = f"sqlite:///{tmp_path / 'run.db'}"
    store = EventStore.open(url)
    try:
        with pytest.raises(RuntimeError, match="injected: Resume refused"):
            RolloutController.open(store, "run", store_config=StoreConfig(url=url))
    finally:
        store.close()
    ((freezes, frozen),) = seen
    assert freezes == 1 and frozen > 0  # the failed open had frozen the heap
    assert gc_freeze._holders == 0
    assert gc.get_freeze_count() == 0  # and gave it back


def test_off_nothing_is_frozen(tmp_path: Path) -> None:
    ctl = _controller(tmp_path, "off", at_open=False)
    try:
        for _ in range(5):
            ctl.execute(AdmitStep())
        assert ctl.heap_freezer.freezes == 0 and not ctl.heap_freezer.holding
        assert gc.get_freeze_count() == 0
    finally:
        _close(ctl)


def test_a_process_that_froze_objects_itself_is_left_alone(tmp_path: Path) -> None:
    keep = [object() for _ in range(3)]  # noqa: F841 - alive while frozen
    gc.freeze()
    theirs = gc.get_freeze_count()
    ctl = _controller(tmp_path, "theirs")
    try:
        assert ctl.heap_freezer.freezes == 0
        assert 0 < gc.get_freeze_count() <= theirs  # nothing of ours joined it
    finally:
        _close(ctl)
    assert gc.get_freeze_count() > 0  # not unfrozen on close either


def test_an_interval_freezer_freezes_nothing_where_the_process_froze_first(
    tmp_path: Path,
) -> None:
    gc.freeze()
    theirs = gc.get_freeze_count()
    ctl = _controller(tmp_path, "interval", 4)
    try:
        for _ in range(6):  # 18 events: four intervals
            ctl.execute(AdmitStep())
        assert ctl.heap_freezer.freezes == 0
        assert 0 < gc.get_freeze_count() <= theirs  # it would grow without bound
    finally:
        _close(ctl)
    assert gc.get_freeze_count() > 0  # the process's own freeze stands


def test_a_freeze_the_process_makes_while_held_is_not_undone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ctl = _controller(tmp_path, "later")
    try:
        assert ctl.heap_freezer.freezes == 1
        theirs = [[] for _ in range(1000)]  # noqa: F841 - tracked, alive while frozen
        gc.freeze()  # the process's own, after ours
    finally:
        with caplog.at_level(logging.WARNING, logger="rolloutlog.controller.gc_freeze"):
            _close(ctl)
    assert gc.get_freeze_count() > 0  # left frozen: an unfreeze would undo theirs
    assert "frozen outside rolloutlog" in caplog.text


def test_at_open_and_interval_freezers_share_one_freeze(tmp_path: Path) -> None:
    a = _controller(tmp_path, "a")  # the first: freezes at open
    b = _controller(tmp_path, "b", 4)  # an interval: freezes at open and every interval
    try:
        assert (a.heap_freezer.freezes, b.heap_freezer.freezes) == (1, 1)
        for _ in range(4):  # 12 events
            b.execute(AdmitStep())
        assert b.heap_freezer.freezes == 1 + 12 // 6
        a.close()
        assert gc.get_freeze_count() > 0  # b still holds the freeze
    finally:
        _close(a, b)
    assert gc.get_freeze_count() == 0


def test_a_finalizer_that_closes_a_controller_during_the_collection_does_not_deadlock() -> None:
    held = HeapFreezer(0, at_open=True)
    held.start(0)  # the first holder: freezes

    class Closer:
        other: object = None

        def __del__(self) -> None:
            held.close()

    x, y = Closer(), Closer()
    x.other, y.other = y, x
    del x, y  # cyclic garbage whose finalizer closes `held`
    joiner = HeapFreezer(1)
    done = threading.Event()

    def open_() -> None:
        joiner.start(0)  # collects: the finalizer runs inside
        done.set()

    thread = threading.Thread(target=open_, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert done.is_set(), "the open deadlocked on the freezer's lock"
    assert not held.holding and joiner.holding and joiner.freezes == 1
    joiner.close()
    assert gc.get_freeze_count() == 0


def test_cyclic_garbage_at_open_is_collected_before_the_freeze() -> None:
    class Node:
        other: object = None

    x, y = Node(), Node()
    x.other, y.other = y, x
    probe = weakref.ref(x)
    del x, y  # garbage, but only a collection finds it
    freezer = HeapFreezer(0, at_open=True)
    freezer.start(0)
    try:
        assert freezer.holding
        assert probe() is None  # collected at open, not held back by the freeze
    finally:
        freezer.close()


def test_freezes_every_interval_and_the_last_close_unfreezes(tmp_path: Path) -> None:
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

"""A drain gate shared by the backends: weight swaps wait for in-flight generation.

``update_weights`` must never change the weights under a running request, or its
tokens would be labelled with one weight version but sampled from two. The gate lets
any number of requests generate at once; a swap closes the gate to new requests,
waits until the running ones have finished (or were aborted), swaps, and reopens.
Requests that arrive while a swap is pending wait and then see the new version.

It holds no asyncio primitive bound to a loop: each waiter creates its future on
the running loop, so one backend object can be used from successive event loops.

A task that is already inside the gate (generating or swapping) and enters it again
would wait for itself forever; the gate refuses that with :class:`GateReentryError`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from rolloutlog.eventstore.errors import RolloutlogError


class GateReentryError(RolloutlogError, RuntimeError):
    """A task inside the drain gate tried to enter it again (it would deadlock)."""


class DrainGate:
    """Many concurrent generators or one weight swap, never both."""

    def __init__(self) -> None:
        self._active = 0
        self._swapping = False
        self._waiters: list[asyncio.Future[None]] = []
        #: Tasks inside the gate and what they hold ("generating" or "swapping").
        self._holders: dict[asyncio.Task[object], str] = {}

    def _enter(self, what: str) -> asyncio.Task[object] | None:
        """Refuse a task that already holds the gate (it would wait for itself)."""
        task = asyncio.current_task()
        held = self._holders.get(task) if task is not None else None
        if held is not None:
            raise GateReentryError(
                f"drain gate re-entered: this task is already {held} and tried to start "
                f"{what}; a weight swap waits for running generation and generation waits "
                "for the swap, so this would deadlock"
            )
        return task

    @property
    def active(self) -> int:
        """Number of requests inside the gate."""
        return self._active

    async def _wait(self) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                # RuntimeError: its loop is closed, so nobody is waiting any more.
                with contextlib.suppress(RuntimeError):
                    fut.get_loop().call_soon_threadsafe(_resolve, fut)

    @asynccontextmanager
    async def generating(self) -> AsyncIterator[None]:
        """Hold the gate open for one request (waits while a swap is pending)."""
        task = self._enter("generating")
        while self._swapping:
            await self._wait()
        self._active += 1
        if task is not None:
            self._holders[task] = "generating"
        try:
            yield
        finally:
            if task is not None:
                self._holders.pop(task, None)
            self._active -= 1
            if self._active == 0:
                self._wake()

    @asynccontextmanager
    async def swapping(self) -> AsyncIterator[None]:
        """Close the gate, wait for the running requests to finish, then yield."""
        task = self._enter("a weight swap")
        while self._swapping:
            await self._wait()
        self._swapping = True
        if task is not None:
            self._holders[task] = "swapping"
        try:
            while self._active:
                await self._wait()
            yield
        finally:
            if task is not None:
                self._holders.pop(task, None)
            self._swapping = False
            self._wake()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)

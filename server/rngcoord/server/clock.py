"""Time, as the coordinator sees it: timestamps for records and expiries, and timed waits.

Everything in the coordinator that waits (a join barrier, a Restore by consensus) or stamps a
record goes through a `Clock`, so tests drive time by hand instead of sleeping (tests/harness.py
has a `ManualClock`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

__all__ = ["Clock", "SystemClock"]


class Clock(Protocol):
    """A source of time for one event loop."""

    def now_us(self) -> int:
        """Unix time in microseconds, for records and stored expiry times."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back, for deadlines."""
        ...

    async def wait(self, future: asyncio.Future[object], timeout_s: float) -> bool:
        """Wait until `future` is done or `timeout_s` seconds have passed; True when it is done.

        The future is never cancelled by the wait.
        """
        ...


class SystemClock:
    """The real clock: `time.time_ns()`, `time.monotonic()` and the event loop's timers."""

    def now_us(self) -> int:
        return time.time_ns() // 1000

    def monotonic(self) -> float:
        return time.monotonic()

    async def wait(self, future: asyncio.Future[object], timeout_s: float) -> bool:
        if future.done() or timeout_s <= 0:
            return future.done()
        # One timer and one callback: cheaper than asyncio.wait's task and set, which counts
        # when 10^5 joins wait at once.
        loop = asyncio.get_running_loop()
        woken = loop.create_future()

        def wake(_: object = None) -> None:
            if not woken.done():
                woken.set_result(None)

        timer = loop.call_later(timeout_s, wake)
        future.add_done_callback(wake)
        try:
            await woken
        finally:
            timer.cancel()
            future.remove_done_callback(wake)
        return future.done()

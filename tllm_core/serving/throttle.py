"""At most one read of the engine's report at a time, shared by the requests waiting: each gets
a read that started after it arrived, or one younger than ``min_interval_s``; a failed read
fails every request that waited for it (a hung engine costs one wait, not one per request)."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Awaitable, Callable
from typing import Any


class Throttle:
    def __init__(self, fetch: Callable[[], Awaitable[Any]], min_interval_s: float = 0.0):
        self.fetch = fetch
        self.min_interval_s = min_interval_s
        self.reads = 0
        self._lock = asyncio.Lock()
        self._value: Any = None
        self._started = -float("inf")  # when the last completed read started
        # The last failed read: when it failed, and why (None: the last read succeeded).
        self._failed: tuple[float, BaseException] | None = None

    async def get(self) -> Any:
        arrived = time.monotonic()
        async with self._lock:
            if self._failed is not None and self._failed[0] >= arrived:
                raise _again(self._failed[1])  # failed while this request waited: not read again
            fresh = self._started >= arrived  # a read that began after this request did
            recent = time.monotonic() - self._started < self.min_interval_s
            if not (fresh or recent):
                started = time.monotonic()
                try:
                    self._value = await self.fetch()
                except Exception as e:
                    self._failed = (time.monotonic(), e)
                    raise
                self._failed = None
                self._started = started
                self.reads += 1
            return self._value


def _again(e: BaseException) -> BaseException:
    """``e`` for one more waiter: a copy, chained to it, so that each raise does not add its
    frames to one shared traceback (which every waiter then logs)."""
    try:
        again = copy.copy(e)
    except Exception:  # noqa: BLE001 - an exception that cannot be rebuilt from its args
        return e
    again.__cause__ = e
    return again

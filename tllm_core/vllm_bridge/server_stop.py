"""Requests of tllm's routes that wait for the engine, cut short when the server stops: vLLM
stops its engine before its HTTP server, so an engine call made meanwhile is never answered
while uvicorn waits for every request to end."""

from __future__ import annotations

import asyncio
from typing import Any

# How often a tllm route waiting for the engine looks whether the server is stopping.
STOP_POLL_S = 0.25


class ServerStopping(RuntimeError):
    """The server began to stop while a tllm route waited for its engine."""


async def until_server_stops(app: Any, awaitable: Any) -> Any:
    """``await awaitable``, unless the HTTP server starts to stop first (``app.state.server``
    gets ``should_exit``): then the wait is cancelled and :class:`ServerStopping` raised."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=STOP_POLL_S)
            if done:
                return task.result()
            if getattr(getattr(app.state, "server", None), "should_exit", False):
                raise ServerStopping("the server is stopping")
    finally:
        if not task.done():
            task.cancel()

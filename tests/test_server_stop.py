"""tllm's routes that wait for the engine end when the server stops (vLLM stops its engine
before its HTTP server: an engine call made in between is never answered, and uvicorn waits
for the request; an idle ``tllm serve`` needed the stop watchdog after Ctrl-C)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tllm_core.vllm_bridge.request_marks import ServerStopping, until_server_stops


def app_with_server() -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(server=SimpleNamespace(should_exit=False)))


def test_an_answered_call_returns_its_value():
    async def answer():
        await asyncio.sleep(0.01)
        return [1, 2]

    assert asyncio.run(until_server_stops(app_with_server(), answer(), "'x'", 60)) == [1, 2]


def test_a_call_never_answered_ends_once_the_server_stops():
    app = app_with_server()
    never = asyncio.Event()
    cancelled = []

    async def engine_gone():
        try:
            await never.wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main():
        waiting = asyncio.ensure_future(until_server_stops(app, engine_gone(), "'x'", 60))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # still waiting while the server runs
        app.state.server.should_exit = True
        with pytest.raises(ServerStopping):
            await asyncio.wait_for(waiting, timeout=5)

    asyncio.run(main())
    assert cancelled == [True]  # the engine call is not left behind


def test_a_call_never_answered_ends_after_its_timeout_naming_it():
    from tllm_core.vllm_bridge.request_marks import EngineNoAnswer

    app, cancelled = app_with_server(), []

    async def engine_hung():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main():
        call = until_server_stops(app, engine_hung(), "'tllm_collect'", timeout=0.3)
        await asyncio.wait_for(call, timeout=10)

    with pytest.raises(EngineNoAnswer, match="did not answer 'tllm_collect' in 0.3 s"):
        asyncio.run(main())
    assert cancelled == [True]

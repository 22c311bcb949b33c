"""What the server tells about single requests: the ``X-Tllm-Failed`` mark and the
``cut_short`` mark of requests vLLM aborts; and tllm routes' waits on the engine, cut short
when the server stops (vLLM stops its engine before its HTTP server)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

from tllm_core.serving.throttle import Throttle

log = logging.getLogger("vllm.tllm")

# Caller ids of the requests an HTTP request made vLLM run (FailureMarks gives each HTTP
# request its own list; serving's assign_request_id wrapper fills it through note_request).
REQUEST_IDS: ContextVar[list[str] | None] = ContextVar("tllm_request_ids", default=None)
FAILED_HEADER = b"x-tllm-failed"
# The last event of an OpenAI stream; a stream's mark is an SSE comment line just before it
# (clients skip comment lines, as the SSE format says they must).
STREAM_END = b"data: [DONE]"
SSE = b"text/event-stream"

Ask = Callable[[str, list[str] | None], Awaitable[list[Any]]]
STOP_POLL_S = 0.25  # how often a wait on the engine looks whether the server is stopping


class ServerStopping(RuntimeError):
    """The server began to stop while a tllm route waited for its engine."""


class EngineNoAnswer(RuntimeError):
    """The engine did not answer a tllm route's call in time."""


async def until_server_stops(app: Any, awaitable: Any, what: str, timeout: float) -> Any:
    """``await awaitable``, unless the HTTP server starts to stop first (``app.state.server``
    gets ``should_exit``: :class:`ServerStopping`) or ``timeout`` s pass
    (:class:`EngineNoAnswer` naming ``what``); the wait is then cancelled."""
    task = asyncio.ensure_future(awaitable)
    deadline = asyncio.get_running_loop().time() + timeout
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=STOP_POLL_S)
            if done:
                return task.result()  # bounded: done
            if getattr(getattr(app.state, "server", None), "should_exit", False):
                raise ServerStopping("the server is stopping")
            if asyncio.get_running_loop().time() > deadline:
                raise EngineNoAnswer(f"the engine did not answer {what} in {timeout:g} s")
    finally:
        if not task.done():
            task.cancel()


def is_stream(start: dict) -> bool:
    """Whether a response start is an event stream's."""
    return any(k.lower() == b"content-type" and SSE in v for k, v in start.get("headers", ()))


def before_end(body: bytes, line: bytes) -> bytes:
    """A stream's last body with ``line`` just before its ``data: [DONE]``."""
    at = body.index(STREAM_END)
    return body[:at] + line + body[at:]


def note_request(request: Any) -> None:
    """Called once per request vLLM admits: remember its caller id for the HTTP request."""
    ids = REQUEST_IDS.get()
    if ids is not None:
        ids.append(getattr(request, "external_req_id", None) or request.request_id)


class FailureMarks:
    """Pure ASGI middleware: a response on ``paths`` whose requests a consumer failed on gets
    the header ``X-Tllm-Failed: name[,name]`` (a stream: the comment line ``: tllm-failed
    name[,name]`` before ``data: [DONE]``), as the workers knew when it was complete."""

    def __init__(self, app: Any, paths: tuple[str, ...], ask: Callable[[], Ask | None]):
        self.app = app
        self.paths = paths
        self.ask = ask
        self.reads = Throttle(self._read)

    async def _read(self) -> dict[str, set[str]]:
        ask = self.ask()
        known: dict[str, set[str]] = {}
        for answer in [] if ask is None else await ask("tllm_failed_requests", None):
            for request, names in (answer or {}).items():
                known.setdefault(request, set()).update(names)
        return known

    async def failed(self, ids: list[str]) -> list[str]:
        try:
            known = await self.reads.get()  # bounded: until_server_stops' timeout, shared
        except ServerStopping:
            return []  # the response goes out unmarked: the engine is gone
        except Exception:  # noqa: BLE001 - the response goes out unmarked
            log.exception("tllm: could not read which consumers failed on %s", ids)
            return []
        return sorted({n for r in ids for n in known.get(r, ())})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].endswith(self.paths):
            return await self.app(scope, receive, send)
        ids: list[str] = []
        token = REQUEST_IDS.set(ids)

        stream = False

        async def marked(msg: dict) -> None:
            nonlocal stream
            if msg["type"] == "http.response.start":
                stream = is_stream(msg)
                if not stream and ids and (names := await self.failed(list(ids))):
                    header = (FAILED_HEADER, ",".join(names).encode())
                    msg = {**msg, "headers": [*msg.get("headers", ()), header]}
            elif stream and ids and STREAM_END in (body := msg.get("body", b"")):
                if names := await self.failed(list(ids)):
                    line = b": tllm-failed " + ",".join(names).encode() + b"\n\n"
                    msg = {**msg, "body": before_end(body, line)}
            await send(msg)

        try:
            await self.app(scope, receive, marked)
        finally:
            REQUEST_IDS.reset(token)


def install_abort_marks(engine_core: Any, ask: Ask) -> None:
    """Requests vLLM aborts (a client gone) reach the consumers as ``cut_short``: the workers
    mark them before the abort (the engine core handles its input in order)."""
    abort_orig = engine_core.abort_requests_async

    async def abort_requests_async(request_ids: list[str]) -> None:
        if request_ids:
            try:
                await ask("tllm_mark_cut_short", list(request_ids))
            except ServerStopping:
                pass  # the engine is stopping: its requests end with it
            except Exception:  # noqa: BLE001 - the abort itself must still happen
                log.exception("tllm: could not mark aborted requests %s", request_ids)
        await abort_orig(request_ids)

    engine_core.abort_requests_async = abort_requests_async

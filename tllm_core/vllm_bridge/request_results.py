"""Per-request results in the OpenAI server's responses: a top-level ``"tllm"`` list, one
``{"index": i, "<consumer>": result}`` per choice (a stream: one more event before
``data: [DONE]``), read from the workers until all are there or ``results_wait_s`` passed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from tllm_core.api.results import PlannedRequest, asked_results, merge_taken, with_missing
from tllm_core.serving.keys import EngineConsumers, result_bounds
from tllm_core.vllm_bridge.request_marks import (
    STREAM_END,
    Ask,
    ServerStopping,
    before_end,
    is_stream,
)

log = logging.getLogger("vllm.tllm")

# Caller id -> (consumers asked, n) of the requests of one HTTP request that ask for results.
ASKED: ContextVar[dict[str, tuple[list[str], int]] | None] = ContextVar(
    "tllm_results_asked", default=None
)
# vLLM's completion route runs prompt i of a request as "{request id}-{i}".
_PROMPT_SUFFIX = re.compile(r"-(\d+)$")
FIRST_POLL_S = 0.005
LAST_POLL_S = 0.25


def check_bounds(
    request: Any, extra: dict[str, Any], server: EngineConsumers, limit: int, hidden_size: int
) -> str | None:
    """Why vLLM's engine ``request`` must be refused (a result bounded past ``limit``)."""
    params = request.sampling_params
    prompt = len(getattr(request, "prompt_token_ids", None) or ())
    max_tokens = int(getattr(params, "max_tokens", None) or 0)
    planned = PlannedRequest(prompt, max_tokens, hidden_size, dict(extra))
    for name, bound in result_bounds(planned, server).items():
        if bound > limit:
            return (
                f"tllm: the {name!r} result of this request could hold up to {bound} bytes "
                f"({prompt} prompt tokens, max_tokens {max_tokens}), past this server's limit "
                f"of {limit} bytes (setting max_result_bytes); ask for fewer rows (a narrower "
                "window, fewer tokens or layers)"
            )
    return None


def note_asked(request: Any, extra: dict[str, Any] | None) -> None:
    """Called once per request vLLM admits: remember what it asked for, by caller id."""
    asked = ASKED.get()
    names = asked_results(extra) if extra else []
    if asked is None or not names:
        return
    rid = getattr(request, "external_req_id", None) or request.request_id
    asked[str(rid)] = (names, int(getattr(request.sampling_params, "n", 1) or 1))


def choice_index(rid: str, ids: list[str], n: int, sample: int) -> int:
    """The choice a sample fills: prompt ``i`` (id suffix ``-i``) holds ``i*n .. i*n+n-1``."""
    m = _PROMPT_SUFFIX.search(rid)
    prompt = int(m.group(1)) if (m and len(ids) > 1) else 0
    return prompt * n + sample


async def gather_results(
    ask: Ask, asked: dict[str, tuple[list[str], int]], wait_s: float
) -> list[dict[str, Any]]:
    """The ``tllm`` entries of a response, read until all are there or ``wait_s`` passed."""
    ids = list(asked)
    have: dict[str, dict[str, dict[str, Any]]] = {}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    pause = FIRST_POLL_S

    def made(rid: str, sample: int) -> dict[str, Any]:
        return have.get(rid, {}).get(str(sample), {})

    while True:
        merge_taken(await ask("tllm_take_results", ids), into=have)
        done = all(
            c in made(rid, s) for rid, (names, n) in asked.items() for s in range(n) for c in names
        )
        if done or loop.time() >= deadline:
            break
        await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
        pause = min(pause * 2, LAST_POLL_S)
    out = [
        {"index": choice_index(rid, ids, n, s), **with_missing(names, made(rid, s), wait_s)}
        for rid, (names, n) in asked.items()
        for s in range(n)
    ]
    return sorted(out, key=lambda e: e["index"])


class ResultReturn:
    """Pure ASGI middleware: the ``tllm`` results in responses on ``paths`` that asked."""

    def __init__(
        self, app: Any, paths: tuple[str, ...], ask: Callable[[], Ask | None], wait_s: float
    ):
        self.app = app
        self.paths = paths
        self.ask = ask
        self.wait_s = wait_s

    async def results(self, asked: dict[str, tuple[list[str], int]]) -> list[dict[str, Any]]:
        ask = self.ask()
        try:
            if ask is None:
                raise ServerStopping
            return await gather_results(ask, dict(asked), self.wait_s)
        except ServerStopping:
            why = "the engine stopped before the results were read"
        except Exception as e:  # noqa: BLE001 - the completion still goes out
            log.exception("tllm: could not read the results of %s", sorted(asked))
            why = f"could not read the results: {type(e).__name__}"
        return [{"index": i, "error": why} for i in range(sum(n for _, n in asked.values()))]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].endswith(self.paths):
            return await self.app(scope, receive, send)
        asked: dict[str, tuple[list[str], int]] = {}
        token = ASKED.set(asked)
        held: dict[str, Any] = {}  # a non-streamed response: its start and body so far
        chunks: list[bytes] = []
        first_event: list[dict[str, Any]] = []  # a stream's first JSON event (id, model...)

        async def with_results(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                if is_stream(msg):
                    # A stream starts before its requests are admitted: its end decides.
                    held["stream"] = True
                elif asked and msg.get("status", 200) == 200:
                    held["start"] = msg  # held until the body is complete
                    return None
                return await send(msg)
            is_body = msg["type"] == "http.response.body"
            if is_body and held.get("stream") and asked:
                msg = await self._stream_event(msg, asked, first_event)
            if not is_body or "start" not in held:
                return await send(msg)
            chunks.append(msg.get("body", b""))
            if msg.get("more_body", False):
                return None
            body = await self._with_results(b"".join(chunks), asked)
            start = held.pop("start")
            headers = [
                (k, v) for k, v in start.get("headers", ()) if k.lower() != b"content-length"
            ]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        try:
            await self.app(scope, receive, with_results)
        finally:
            ASKED.reset(token)

    async def _with_results(self, body: bytes, asked: dict) -> bytes:
        try:
            data = json.loads(body)
        except ValueError:
            return body  # not a completion: vLLM's own answer goes out as it is
        if not isinstance(data, dict) or "choices" not in data:
            return body
        data["tllm"] = await self.results(asked)
        return json.dumps(data, separators=(",", ":")).encode()

    async def _stream_event(self, msg: dict, asked: dict, first: list[dict[str, Any]]) -> dict:
        body = msg.get("body", b"")
        if not first:
            for line in body.split(b"\n"):
                if line.startswith(b"data: {"):
                    with contextlib.suppress(ValueError):
                        first.append(json.loads(line[6:]))
                    break
        if STREAM_END not in body:
            return msg
        event = {k: v for k, v in (first[0] if first else {}).items() if k in _EVENT_FIELDS}
        event.update({"choices": [], "tllm": await self.results(asked)})
        line = b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
        return {**msg, "body": before_end(body, line)}


_EVENT_FIELDS = ("id", "object", "created", "model")

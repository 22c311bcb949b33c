"""What the server tells about single requests: the ``X-Tllm-Failed`` mark, ``cut_short`` of
requests vLLM aborts, per-request results (a top-level ``"tllm"`` list, one entry per choice;
a stream: one more event before ``data: [DONE]``); and waits on the engine that end at the
server's stop (vLLM stops its engine before its HTTP server)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

from tllm_core.api.results import (
    PlannedRequest,
    asked_results,
    json_safe,
    merge_taken,
    with_missing,
)
from tllm_core.runtime.request_results import STORE_RESULTS
from tllm_core.serving.guard import bound
from tllm_core.serving.keys import EngineConsumers, result_bounds
from tllm_core.serving.throttle import Throttle
from tllm_core.vllm_bridge.errors import EngineCallFailed, EngineNoAnswer

log = logging.getLogger("vllm.tllm")

# vLLM's ids of the requests an HTTP request had admitted (note_request): bound by the outer
# middleware that needs them (FailureMarks: its marks; ResultReturn: a refused one's discard).
ADMITTED: ContextVar[list[str] | None] = ContextVar("tllm_admitted", default=None)
FAILED_HEADER = b"x-tllm-failed"
# The last event of an OpenAI stream; a stream's mark is an SSE comment line just before it.
# At a line's start only: a JSON event's text may hold these bytes (echo, generated text).
STREAM_END = re.compile(rb"^data: \[DONE\]", re.MULTILINE)
SSE = b"text/event-stream"

Ask = Callable[[str, list[str] | None], Awaitable[list[Any]]]
Asked = dict[str, tuple[list[str], int]]  # caller id -> (consumers asked, n)
STOP_POLL_S = 0.25  # how often a wait on the engine looks whether the server is stopping


class AskedResults(dict):
    """The :data:`Asked` of one HTTP request; ``ids``: each caller id it holds in
    ``RESULTS_IN_FLIGHT`` (kept when a refusal clears what it waits for), freed at its end."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []


class ServerStopping(RuntimeError):
    """The server began to stop while a tllm route waited for its engine."""


async def until_server_stops(app: Any, awaitable: Any, what: str, timeout: float) -> Any:
    """``await awaitable``, cancelled with :class:`ServerStopping` once ``app.state.server``
    should exit, or with :class:`EngineNoAnswer` naming ``what`` past ``timeout`` s."""
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
    return any(k.lower() == b"content-type" and SSE in v for k, v in start.get("headers", ()))


def ends_stream(body: bytes) -> bool:
    """Whether ``body`` holds a stream's ``data: [DONE]`` event."""
    return STREAM_END.search(body) is not None


def before_end(body: bytes, line: bytes) -> bytes:
    """A stream's last body with ``line`` just before its ``data: [DONE]``."""
    at = STREAM_END.search(body).start()
    return body[:at] + line + body[at:]


def caller_id(request: Any) -> str:
    return str(getattr(request, "external_req_id", None) or request.request_id)


def note_request(request: Any, extra: dict[str, Any] | None) -> None:
    """Called once per request vLLM admits: note its caller id and the results it asks for."""
    rid = caller_id(request)
    if (engines := ADMITTED.get()) is not None:
        engines.append(str(request.request_id))  # vLLM's engine id by now
    names = asked_results(extra) if extra else []
    if (asked := ASKED.get()) is not None and names:
        asked[rid] = (names, int(getattr(request.sampling_params, "n", 1) or 1))
        if (busy := RESULTS_IN_FLIGHT.get()) is not None:
            busy[rid] = asked  # its HTTP request's, until that one is answered
            asked.ids.append(rid)


def id_in_use(request: Any) -> str | None:
    """Why ``request`` may not ask for results (None: it may): its caller id is that of
    another HTTP request still waiting for its results (results are kept by caller id)."""
    busy, mine = RESULTS_IN_FLIGHT.get(), ASKED.get()
    rid = caller_id(request)
    if busy is None or busy.get(rid, mine) is mine:
        return None
    return (
        f"tllm: request id {rid!r} (vLLM's, made from the id the request gave) is that of "
        "another request still waiting for its results; give each request its own id "
        "(X-Request-Id, request_id), or none"
    )


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
            for engine_id, names in (answer or {}).items():
                known.setdefault(engine_id, set()).update(names)
        return known

    async def failed(self, ids: list[str]) -> list[str]:
        try:
            known = await self.reads.get()  # bounded: until_server_stops' timeout, shared
        except ServerStopping:
            return []  # the response goes out unmarked: the engine is gone
        except (EngineNoAnswer, EngineCallFailed) as e:  # the engine's: one line, as it says
            log.warning("tllm: could not read which consumers failed on %s: %s", ids, e)
            return []
        except Exception:  # noqa: BLE001 - the response goes out unmarked
            log.exception("tllm: could not read which consumers failed on %s", ids)
            return []
        return sorted({n for r in ids for n in known.get(r, ())})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].endswith(self.paths):
            return await self.app(scope, receive, send)
        ids: list[str] = []
        stream = False

        async def marked(msg: dict) -> None:
            nonlocal stream
            if msg["type"] == "http.response.start":
                stream = is_stream(msg)
                if not stream and ids and (names := await self.failed(list(ids))):
                    header = (FAILED_HEADER, ",".join(names).encode())
                    msg = {**msg, "headers": [*msg.get("headers", ()), header]}
            elif stream and ids and ends_stream(body := msg.get("body", b"")):
                if names := await self.failed(list(ids)):
                    line = b": tllm-failed " + ",".join(names).encode() + b"\n\n"
                    msg = {**msg, "body": before_end(body, line)}
            await send(msg)

        with bound(ADMITTED, ids):
            await self.app(scope, receive, marked)


# Set while ``AsyncLLM.abort`` runs (a client gone): the engine core's aborts of requests ended
# on a stop string (by the output handler, another task) are not marked.
FRONT_END_ABORT: ContextVar[bool] = ContextVar("tllm_front_end_abort", default=False)


class IdBatches:
    """Calls of one worker method on request ids, one RPC at a time: the ids given while one
    is in flight (many clients gone, or many responses reading their results, at once) share
    the next, and each caller gets that RPC's answer. Each RPC runs in a task of its own, so
    a caller that stops waiting leaves its batch to the others."""

    def __init__(self, ask: Ask, method: str) -> None:
        self.ask, self.method = ask, method
        self.open: tuple[list[str], asyncio.Future] | None = None  # the next RPC's ids, task
        self.sending: asyncio.Future | None = None  # the RPC in flight

    async def call(self, request_ids: list[str]) -> Any:
        """The answer of the RPC that carried ``request_ids``; raises as ``ask`` does."""
        if self.open is None:
            ids: list[str] = []
            task = asyncio.ensure_future(self._send(ids, self.sending))
            task.add_done_callback(_retrieved)  # told to its callers, if any are left
            self.open = (ids, task)
        self.open[0].extend(request_ids)
        # bounded: the batch's RPC is bounded as ask, and waits for one such RPC at most
        return await asyncio.shield(self.open[1])

    async def _send(self, ids: list[str], before: asyncio.Future | None) -> Any:
        if before is not None:
            await asyncio.wait([before])  # bounded as ask; its outcome is its callers'
        me = asyncio.current_task()
        self.open, self.sending = None, me  # from here on, new ids open the next batch
        try:
            return await self.ask(self.method, list(dict.fromkeys(ids)))  # bounded: as ask
        finally:
            if self.sending is me:
                self.sending = None


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


def install_abort_marks(engine_client: Any, ask: Ask) -> None:
    """Requests the front end aborts (a client gone) reach the consumers as ``cut_short``
    (marked before the abort; the engine core handles its input in order)."""
    engine_core = engine_client.engine_core
    abort_orig, core_abort_orig = engine_client.abort, engine_core.abort_requests_async

    async def abort(*args: Any, **kwargs: Any) -> None:
        with bound(FRONT_END_ABORT, True):
            await abort_orig(*args, **kwargs)

    pending: set[asyncio.Future] = set()  # strong references: a bare task may be collected
    marks = IdBatches(ask, "tllm_mark_cut_short")

    async def mark_then_abort(request_ids: list[str]) -> None:
        try:  # bounded: ask is serving.answered (engine_answer_s), twice at most
            await marks.call(request_ids)
        except EngineNoAnswer as e:  # a stopping or stuck engine: one line, no traceback
            log.warning("tllm: aborted requests %s not marked cut short: %s", request_ids, e)
        except Exception:  # noqa: BLE001 - the abort itself must still happen
            log.exception("tllm: could not mark aborted requests %s", request_ids)
        await core_abort_orig(request_ids)

    async def abort_requests_async(request_ids: list[str]) -> None:
        if not (request_ids and FRONT_END_ABORT.get()):
            return await core_abort_orig(request_ids)
        # A task of its own, shielded: anyio cancels a gone stream's caller at each await,
        # which would skip the abort after the mark (the request would run to max_tokens).
        task = asyncio.ensure_future(mark_then_abort(list(request_ids)))
        pending.add(task)
        outer = asyncio.shield(task)

        def settled(t: asyncio.Future) -> None:
            pending.discard(t)
            # A caller cancelled meanwhile cannot hear the error from ``outer``: logged here.
            if not t.cancelled() and t.exception() is not None and outer.cancelled():
                log.error("tllm: aborting requests %s failed: %r", request_ids, t.exception())

        task.add_done_callback(settled)
        await outer

    engine_client.abort = abort
    engine_core.abort_requests_async = abort_requests_async


# Per HTTP request (set by ResultReturn): what its requests asked.
ASKED: ContextVar[AskedResults | None] = ContextVar("tllm_results_asked", default=None)
# Server-wide (bound by ResultReturn): caller id -> the ASKED of the HTTP request it belongs to.
RESULTS_IN_FLIGHT: ContextVar[dict[str, Any] | None] = ContextVar(
    "tllm_results_in_flight", default=None
)


class Held(dict):
    """Caller id -> the bytes its results can hold, of the requests admitted (check_bounds),
    and their sum: one request may carry many prompts, each checked against it."""

    total = 0

    def admit(self, rid: str, nbytes: int) -> None:
        self.total += nbytes - self.get(rid, 0)
        self[rid] = nbytes


HELD: ContextVar[Held | None] = ContextVar("tllm_results_held", default=None)
# Why a prompt was refused: vLLM starts all prompts together, the later ones get this reason.
REFUSED: ContextVar[list[str] | None] = ContextVar("tllm_results_refused", default=None)
# vLLM's completion route runs prompt i of a request as "{request id}-{i}".
_PROMPT_SUFFIX = re.compile(r"-(\d+)$")
FIRST_POLL_S = 0.005
LAST_POLL_S = 0.25


def check_bounds(
    request: Any,
    extra: dict[str, Any],
    server: EngineConsumers,
    limit: int,
    hidden_size: int,
    held: Held | None = None,
) -> str | None:
    """Why ``request`` must be refused (a result bounded past ``limit``, or its HTTP request's
    past the store), else None; ``held``: :data:`HELD` (this one is added when admitted)."""
    params = request.sampling_params
    prompt = len(getattr(request, "prompt_token_ids", None) or ())
    max_tokens = int(getattr(params, "max_tokens", None) or 0)
    planned = PlannedRequest(prompt, max_tokens, hidden_size, dict(extra))
    bounds = result_bounds(planned, server)
    for name, most in bounds.items():
        if most > limit:
            return (
                f"tllm: the {name!r} result of this request could hold up to {most} bytes "
                f"({prompt} prompt tokens, max_tokens {max_tokens}), past this server's limit "
                f"of {limit} bytes (setting max_result_bytes); ask for fewer rows (a narrower "
                "window, fewer tokens or layers)"
            )
    # All choices of all prompts ("{id}-{i}", checked one by one) wait in one store together.
    n = int(getattr(params, "n", None) or 1)
    mine = n * sum(bounds.values())
    if (total := (held.total if held is not None else 0) + mine) > STORE_RESULTS * limit:
        what, fewer = f"{n} choices", "choices (n)"
        if held:  # the requests admitted before are aborted by vLLM with this one's error
            what, fewer = f"first {len(held) + 1} prompts x {n} choices", "prompts, choices (n)"
        return (
            f"tllm: the results of this request's {what} could hold up to {total} bytes, "
            f"past the {STORE_RESULTS * limit} bytes this server keeps uncollected "
            f"({STORE_RESULTS} x max_result_bytes); ask for fewer {fewer} or rows"
        )
    if held is not None:
        held.admit(caller_id(request), mine)
    return None


async def gather_results(
    take: Callable[[list[str]], Awaitable[list[Any]]],
    asked: Asked,
    wait_s: float,
    complete: set[str] | None = None,
) -> list[dict[str, Any]]:
    """The ``tllm`` entries of a response, taken (``take(ids)``: every rank's
    ``tllm_take_results``) until all are there or ``wait_s`` passed; ``complete`` gets the
    caller ids whose every result was taken."""
    ids = list(asked)
    have: dict[str, dict[str, dict[str, Any]]] = {}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    pause = FIRST_POLL_S

    def made(rid: str, sample: int) -> dict[str, Any]:
        return have.get(rid, {}).get(str(sample), {})

    while True:
        answers = await take(ids)  # bounded: as ask; a batch's answers hold other ids too
        merge_taken(({r: a[r] for r in ids if r in a} for a in answers if a), into=have)
        whole = {
            rid
            for rid, (names, n) in asked.items()
            if all(c in made(rid, s) for s in range(n) for c in names)
        }
        if len(whole) == len(asked) or loop.time() >= deadline:
            break
        await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
        pause = min(pause * 2, LAST_POLL_S)
    if complete is not None:
        complete.update(whole)
    out = []
    for rid, (names, n) in asked.items():  # prompt i (id suffix -i) fills choices i*n .. i*n+n-1
        m = _PROMPT_SUFFIX.search(rid)
        first = int(m.group(1)) * n if (m and len(ids) > 1) else 0
        out += [{"index": first + s, **with_missing(names, made(rid, s), wait_s)} for s in range(n)]
    return sorted(out, key=lambda e: e["index"])


class ResultReturn:
    """Pure ASGI middleware: the ``tllm`` results in responses on ``paths`` that asked."""

    def __init__(
        self,
        app: Any,
        paths: tuple[str, ...],
        ask: Callable[[], Ask | None],
        wait_s: float,
        discard: Callable[[list[str], list[str]], Awaitable[Any]] | None = None,
    ):
        self.app = app
        self.paths = paths
        self.ask = ask
        self.in_flight: dict[str, Any] = {}  # RESULTS_IN_FLIGHT
        self.wait_s = wait_s
        self.discard = discard  # of the caller ids whose response failed
        self.takes: IdBatches | None = None  # the responses' reads of their results
        self._settling: set[asyncio.Future] = set()  # strong references to the discards

    async def results(self, asked: Asked, complete: set[str]) -> list[dict[str, Any]]:
        ask = self.ask()
        try:
            if ask is None:
                raise ServerStopping
            if self.takes is None or self.takes.ask is not ask:
                self.takes = IdBatches(ask, "tllm_take_results")
            return await gather_results(self.takes.call, dict(asked), self.wait_s, complete)
        except ServerStopping:
            why = "the engine stopped before the results were read"
        except Exception as e:  # noqa: BLE001 - the completion still goes out
            log.exception("tllm: could not read the results of %s", sorted(asked))
            why = f"could not read the results: {type(e).__name__}"
        return [{"index": i, "error": why} for i in range(sum(n for _, n in asked.values()))]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].endswith(self.paths):
            return await self.app(scope, receive, send)
        asked = AskedResults()
        admitted = Held()  # HELD: the prompts admitted, refused: REFUSED's why
        refused: list[str] = []
        held: dict[str, Any] = {}  # a non-streamed response: its start and body so far
        chunks: list[bytes] = []
        first_event: list[dict[str, Any]] = []  # a stream's first JSON event (id, model...)
        complete: set[str] = set()  # the caller ids whose every result the response took

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
                msg = await self._stream_event(msg, asked, first_event, complete)
            if not is_body or "start" not in held:
                return await send(msg)
            chunks.append(msg.get("body", b""))
            if msg.get("more_body", False):
                return None
            body = await self._with_results(b"".join(chunks), asked, complete)
            start = held.pop("start")
            headers = [
                (k, v) for k, v in start.get("headers", ()) if k.lower() != b"content-length"
            ]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        engines = ADMITTED.get()  # FailureMarks' list, when it runs outside this one
        if engines is None:
            engines = []
        try:
            with bound(ASKED, asked), bound(HELD, admitted), bound(REFUSED, refused):
                with bound(RESULTS_IN_FLIGHT, self.in_flight), bound(ADMITTED, engines):
                    await self.app(scope, receive, with_results)
        finally:
            # Left in the engine, a result would go to the next request of the same caller id
            # (a retry, another client): what was not taken is discarded (a late or cut-short
            # result, a failed or gone response; the prompts admitted before a refused one),
            # in a task of its own (a gone client's handler is cancelled at each await).
            leftover = [r for r in asked if r not in complete]
            leftover += [r for r in admitted if refused and r not in asked]
            settle = None
            if leftover and self.discard:
                settle = asyncio.ensure_future(self._settle(asked, leftover, engines))
                self._settling.add(settle)
                settle.add_done_callback(self._settling.discard)
            else:
                self._free(asked)
        if settle is not None:
            await asyncio.shield(settle)  # bounded: ask's

    async def _settle(self, asked: AskedResults, leftover: list[str], engines: list[str]) -> None:
        """Discard what ``leftover`` (caller ids) left in the engine, then free ``asked``'s ids:
        a request reusing one is refused until its discard is sent."""
        try:
            await self.discard(leftover, engines)  # bounded: ask's
        except Exception as e:  # noqa: BLE001 - the response is out; they expire instead
            log.warning("tllm: results of %s not discarded: %r", sorted(leftover), e)
        finally:
            self._free(asked)

    def _free(self, asked: AskedResults) -> None:
        """The caller ids of ``asked``'s HTTP request may ask for results again."""
        for rid in asked.ids:
            if self.in_flight.get(rid) is asked:
                del self.in_flight[rid]

    async def _with_results(self, body: bytes, asked: dict, complete: set[str]) -> bytes:
        try:
            data = json.loads(body)
        except ValueError:
            return body  # not a completion: vLLM's own answer goes out as it is
        if not isinstance(data, dict) or "choices" not in data:
            return body
        data["tllm"] = json_safe(await self.results(asked, complete))  # strict JSON
        return json.dumps(data, separators=(",", ":")).encode()

    async def _stream_event(
        self, msg: dict, asked: dict, first: list[dict[str, Any]], complete: set[str]
    ) -> dict:
        body = msg.get("body", b"")
        if not first:
            for line in body.split(b"\n"):
                if line.startswith(b"data: {"):
                    with contextlib.suppress(ValueError):
                        first.append(json.loads(line[6:]))
                    break
        if not ends_stream(body):
            return msg
        event = {k: v for k, v in (first[0] if first else {}).items() if k in _EVENT_FIELDS}
        event.update({"choices": [], "tllm": json_safe(await self.results(asked, complete))})
        line = b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
        return {**msg, "body": before_end(body, line)}


_EVENT_FIELDS = ("id", "object", "created", "model")

"""tllm in vLLM's OpenAI-compatible server, API-server side (active with
``--additional-config '{"tllm": {...}}'``, :class:`~.plugin.EndpointGate`): request checks,
cache salts, ``/tllm`` routes, ``/health`` while hung, results and failure marks (docs/serving.md).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import secrets
from collections import OrderedDict, deque
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tllm_core.api.consumer import ControlError
from tllm_core.api.request_settings import (
    GROUP_KEY,
    OWN_GROUP,
    RESULTS_KEY,
    SAMPLES_KEY,
    short_repr,
)
from tllm_core.api.results import json_safe
from tllm_core.runtime.reports import merge_reports
from tllm_core.runtime.settings import ADDITIONAL_CONFIG_KEY, MIB, RuntimeSettings, ServerSettings
from tllm_core.runtime.watchdog import read_note
from tllm_core.serving.guard import (
    CLIENT,
    BearerGuard,
    ClientScope,
    bound,
    hide_paths,
    scoped_group,
    send_json,
)
from tllm_core.serving.keys import EngineConsumers, request_salt, validate_extra_args
from tllm_core.serving.throttle import Throttle
from tllm_core.vllm_bridge import nodes
from tllm_core.vllm_bridge.engine_settings import tllm_settings
from tllm_core.vllm_bridge.errors import EngineCallFailed, EngineLost
from tllm_core.vllm_bridge.request_marks import (
    ASKED,
    HELD,
    REFUSED,
    EngineNoAnswer,
    FailureMarks,
    ResultReturn,
    ServerStopping,
    check_bounds,
    id_in_use,
    install_abort_marks,
    note_request,
    until_server_stops,
)
from tllm_core.vllm_bridge.server_entry import close_http_soon
from tllm_core.vllm_bridge.version import require_attrs
from tllm_core.vllm_bridge.worker_ext import checked

# Under "vllm." so the line goes through vLLM's configured handler in the server log.
log = logging.getLogger("vllm.tllm")

COUNTERS_PATH = "/tllm/counters"
CONTROL_PATH = "/tllm/consumers/{name}/control"
STATUS_PATH = "/tllm/status"
HEALTH_PATH = "/health"  # vLLM's own route


# Set by XargsCheck in the request's task: assign_request_id need not check vllm_xargs again.
XARGS_CHECKED: ContextVar[bool] = ContextVar("tllm_xargs_checked", default=False)
# Routes whose answers carry per-request results (choices); with /v1/responses, which cannot,
# the routes whose JSON body carries ``vllm_xargs`` at the top level.
RESULTS_PATHS = ("/v1/completions", "/v1/chat/completions")
CHECKED_PATHS = (*RESULTS_PATHS, "/v1/responses")
NO_RESULTS_ERROR = (
    f"tllm: {RESULTS_KEY} is answered on {' and '.join(RESULTS_PATHS)} only; this route "
    "returns no results"
)
# A body past the limit is still read up to this many times it, so the client sees the 413.
DRAIN_FACTOR = 4
# A control call answered after its 504 is still adopted up to this many times engine_answer_s.
LATE_CONTROL_FACTOR = 10


def parse_xargs(body: bytes) -> tuple[dict | None, tuple[int, str] | None]:
    """``vllm_xargs`` naming tllm keys (else None), or the 400 of a body nested too deeply."""
    if b"tllm_" not in body and b"\\u" not in body:  # a key may be spelt "\u0074llm_..."
        return None, None
    try:
        data = json.loads(body)
    except ValueError:
        return None, None  # vLLM answers malformed JSON itself
    except RecursionError:  # Python's parser gives up on deep nesting (vLLM's would, with 500)
        return None, (400, "tllm: the JSON body is nested too deeply")
    xargs = data.get("vllm_xargs") if isinstance(data, dict) else None
    return (xargs, None) if isinstance(xargs, dict) else (None, None)


def check_xargs(
    xargs: dict, server: EngineConsumers, results_route: bool, validate: bool = True
) -> tuple[int, str] | None:
    """(HTTP status, message) for ``vllm_xargs`` that must not reach vLLM, else None: 400 for
    bad ``tllm_*`` keys (with ``validate``) or results asked on a route without them, 503 for
    a failed consumer."""
    if validate:
        try:
            validate_extra_args(xargs, server)
        except ValueError as e:
            return 400, f"tllm: {e}"
    if failed := server.failed_named(xargs):
        return 503, (
            f"tllm: consumer {', '.join(map(repr, failed))} failed on this server and is "
            f"switched off until it restarts (see GET {STATUS_PATH}); requests naming it are "
            "refused rather than served without it"
        )
    if RESULTS_KEY in xargs and not results_route:
        return 400, NO_RESULTS_ERROR
    return None


def _error_response(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}
    ).encode()


class XargsCheck:
    """Pure ASGI middleware: 413 past ``max_body_bytes``, 400 for bad tllm vllm_xargs."""

    def __init__(self, app: Any, server: EngineConsumers, max_body_bytes: int = 32 * MIB):
        self.app = app
        self.server = server
        self.max_body_bytes = max_body_bytes

    async def refuse(self, receive, send, more: bool) -> None:
        """413, after dropping the rest of the body (a client still sending sees a reset)."""
        budget = DRAIN_FACTOR * self.max_body_bytes
        while more and budget > 0:
            msg = await receive()
            if msg["type"] != "http.request":
                break
            budget -= len(msg.get("body", b""))
            more = msg.get("more_body", False)
        message = (
            f"tllm: request body is larger than this server's limit of {self.max_body_bytes} "
            "bytes (server setting max_body_bytes)"
        )
        await send_json(send, 413, _error_response(413, message, "RequestEntityTooLarge"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope.get("headers") or ()}
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            more = int(declared) <= DRAIN_FACTOR * self.max_body_bytes
            return await self.refuse(receive, send, more=more)
        # The body's bytes, not its messages: a body sent a byte at a time comes as one message
        # per byte, each a dict many times its byte.
        read, more, last = bytearray(), False, None  # last: a message after the body
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                last = msg
                break
            read.extend(msg.get("body", b""))
            more = msg.get("more_body", False)
            if len(read) > self.max_body_bytes:
                return await self.refuse(receive, send, more=more)
            if not more:
                break
        body = bytes(read)  # parsed and replayed; the buffer freed before the app runs
        del read
        # Every POST body is counted against the limit; only the OpenAI routes' are parsed.
        xargs, error = (None, None)
        if scope["path"].endswith(CHECKED_PATHS):
            xargs, error = parse_xargs(body)
        if xargs is not None:
            error = check_xargs(xargs, self.server, scope["path"].endswith(RESULTS_PATHS))
        if error is not None:
            status, message = error
            kind = "BadRequestError" if status == 400 else "ServiceUnavailableError"
            payload = _error_response(status, message, kind, "vllm_xargs")
            return await send_json(send, status, payload)

        messages = deque([{"type": "http.request", "body": body, "more_body": more}])
        if last is not None:
            messages.append(last)

        async def replay():
            return messages.popleft() if messages else await receive()

        with bound(XARGS_CHECKED, xargs is not None):
            await self.app(scope, replay, send)


class RpcBound:
    """On a multi-node engine's client (``init_state``): the engine core's wait for its workers'
    answers to every tllm call, in s. A hung node's ranks never answer; a core left waiting
    for them runs no step and cannot stop, so its workers are killed before they close their
    consumers. The calls go one at a time (the responses' results reads and cut-short marks
    batched, ``request_marks.IdBatches``): each queued in the core behind a call waiting for a
    hung node would hold it as long again, past vLLM's stop. Past the
    bound, ``on_timeout(reason)`` stops the server and no later call is sent: a late answer
    would be taken as the next call's."""

    def __init__(self, seconds: float, on_timeout: Callable[[str], None]) -> None:
        self.seconds = seconds
        self.on_timeout = on_timeout
        self.lost: str | None = None  # why the engine stopped answering
        self.one_at_a_time = asyncio.Lock()


RPC_BOUND_ATTR = "_tllm_rpc_bound"


async def rpc_all(
    engine_client: Any, method: str, *args: Any, timeout: float | None = None
) -> list[Any]:
    """``collective_rpc`` on every worker of every engine core (the client's: the first only);
    an error answer raises :class:`EngineCallFailed`. ``timeout``: the engine core's own wait
    for its workers' answers (None: the engine's :class:`RpcBound` if set, else vLLM's,
    unbounded)."""
    bound = getattr(engine_client, RPC_BOUND_ATTR, None)
    if bound is None:
        return await _rpc_all(engine_client, method, args, timeout)
    turn = bound.one_at_a_time
    await turn.acquire()  # bounded: each holder's call is (the engine core's timeout)
    if bound.lost is not None:
        turn.release()
        raise EngineLost(f"{method!r} not sent: {bound.lost}")
    timeout = bound.seconds if timeout is None else timeout
    call = asyncio.ensure_future(_rpc_all(engine_client, method, args, timeout))

    def ended(call: asyncio.Future) -> None:  # also when its caller gave up waiting
        turn.release()  # the core is done with it: the next call may go
        e = None if call.cancelled() else call.exception()
        if e is None:
            return
        if f"RPC call to {method} timed out" in str(e) and bound.lost is None:
            bound.lost = f"a rank did not answer {method!r} within {timeout:g} s"
            bound.on_timeout(bound.lost)
        elif method == nodes.NODE_CHECK:  # a lost node, which the node watch tells
            bound.lost = bound.lost or f"the node check failed ({str(e):.200})"

    call.add_done_callback(ended)
    return await asyncio.shield(call)  # bounded: the engine core's timeout


async def _rpc_all(
    engine_client: Any, method: str, args: tuple[Any, ...], timeout: float | None
) -> list[Any]:
    core = getattr(engine_client, "engine_core", None)
    call_all = getattr(core, "call_utility_all_async", None)
    try:
        if call_all is not None and len(getattr(core, "core_engines", ()) or ()) > 1:
            # bounded: every caller bounds rpc_all (ask, answered, wait_for)
            per_engine = await call_all("collective_rpc", method, timeout, args, None)
            answers = [r for rs in per_engine for r in rs]
        else:
            kw = {} if timeout is None else {"timeout": timeout}
            # bounded: as above
            answers = list(await engine_client.collective_rpc(method, args=args, **kw))
    except Exception as e:  # vLLM raises the failed call's text as a plain Exception
        raise EngineCallFailed(str(e)) from e
    return checked(answers)


async def answered(timeout: float, engine_client: Any, method: str, *args: Any) -> list[Any]:
    """:func:`rpc_all`, or :class:`EngineNoAnswer` past ``timeout`` s."""
    try:
        return await asyncio.wait_for(rpc_all(engine_client, method, *args), timeout)
    except asyncio.TimeoutError:
        raise EngineNoAnswer(f"the engine did not answer {method!r} in {timeout:g} s") from None


class HungHealth:
    """ASGI middleware: ``GET /health`` is 503 naming the consumer while a callback hangs."""

    def __init__(self, app: Any, fault_file: str | None):
        self.app = app
        self.fault_file = fault_file

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path") == HEALTH_PATH and self.fault_file:
            hung = read_note(self.fault_file)
            if hung is not None:
                # No path: /health answers without the API key.
                body = json.dumps({"error": f"tllm: {hung.message()}"}).encode()
                return await send_json(send, 503, body)
        await self.app(scope, receive, send)


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": message}, status)


def api_tokens(args: Any) -> list[str]:
    """The API keys vLLM's server guards ``/v1`` with: ``--api-key``, else ``VLLM_API_KEY``."""
    from vllm import envs

    given = getattr(args, "api_key", None)
    if isinstance(given, str):
        given = [given]
    return [k for k in (given or [envs.VLLM_API_KEY]) if k]


def attach_routes(
    app: Any,
    server: EngineConsumers,
    settings: ServerSettings | None = None,
    fault_file: str | None = None,
    results_wait_s: float = 30.0,
) -> None:
    """tllm's routes and middleware on vLLM's app (``fault_file``: :class:`HungHealth`;
    ``results_wait_s``: :class:`ResultReturn`)."""
    settings = settings or ServerSettings()

    def ask(method: str, *args: Any, call: Any = None) -> Any:  # call: that RPC, already sent
        if call is None:
            call = rpc_all(app.state.tllm_engine_client, method, *args)
        return until_server_stops(app, call, repr(method), settings.engine_answer_s)

    def ask_workers():  # None while the engine is not up
        return ask if getattr(app.state, "tllm_engine_client", None) is not None else None

    # Not aborted by caller id (vLLM aborted them by engine id): another client may share it.
    discard = functools.partial(ask, "tllm_discard_results")
    app.add_middleware(
        ResultReturn, paths=RESULTS_PATHS, ask=ask_workers, wait_s=results_wait_s, discard=discard
    )
    app.add_middleware(FailureMarks, paths=CHECKED_PATHS, ask=ask_workers)
    app.add_middleware(XargsCheck, server=server, max_body_bytes=settings.max_body_bytes)
    app.state.tllm_secret = secrets.token_bytes(32)
    app.add_middleware(ClientScope, secret=app.state.tllm_secret)
    app.add_middleware(HungHealth, fault_file=fault_file)
    # Added last, so it runs first: an unauthorised /tllm request gets 401 before anything.
    tokens = api_tokens(getattr(app.state, "args", None))
    app.add_middleware(BearerGuard, tokens=tokens)
    router = APIRouter()
    control_lock = asyncio.Lock()  # the front end's configs and the engine's change in step
    # Control actions (consumer -> action) the engine did not answer in time: still waited
    # for, and given up on (the front end's config may then differ from the engine's).
    pending: dict[str, str] = {}
    unconfirmed: dict[str, str] = {}
    late_tasks: set[asyncio.Task] = set()

    def late_controls() -> dict[str, Any]:
        return {"controls_pending": dict(pending), "controls_unconfirmed": dict(unconfirmed)}

    async def adopt_late(call: Any, name: str, action: str, new: Any) -> None:
        """Adopt the engine's late answer to a control call, holding the control lock till then."""
        try:
            what = f"'tllm_control' ({name} {action}, after its 504)"
            out = await until_server_stops(
                app, call, what, LATE_CONTROL_FACTOR * settings.engine_answer_s
            )
            refused = [o["error"] for o in out if "error" in o]
            if refused:
                log.warning(
                    "tllm: the engine refused %s %s after its 504: %s", name, action, refused
                )
            else:
                server.control_applied(name, new)
        except Exception as e:  # the server stops, or the engine never answered
            unconfirmed[name] = action
            log.warning(
                "tllm: %s's config in the front end may differ from the engine's: %s", name, e
            )
        finally:
            pending.pop(name, None)
            control_lock.release()

    def shown(body: Any) -> Any:
        body = json_safe(body)
        return body if settings.show_paths else hide_paths(body)

    async def guarded(answer: Any, unanswered: str = "") -> Any:
        """``await answer()``; 503 with no engine, at the server's stop or when the engine's
        answer is an error (a rank's, a lost node's: JSON, not a 500); 504 + ``unanswered``."""
        if getattr(app.state, "tllm_engine_client", None) is None:
            return _error("tllm is not initialised in this server", 503)
        try:
            return await answer()
        except ServerStopping:
            return _error("the server is stopping", 503)
        except EngineLost as e:
            return _error(str(e), 503)
        except EngineNoAnswer as e:
            return _error(f"{e}{unanswered}", 504)
        except EngineCallFailed as e:  # told, and the server serves on
            log.warning("tllm: the engine failed a /tllm call: %s", e)
            return _error(shown(f"the engine failed this call: {e}"), 503)

    async def _read_counters() -> Any:
        report = merge_reports(await ask("tllm_collect"))
        server.note_report(report)  # failed consumers: requests naming them get 503
        return shown(report)

    counters = Throttle(_read_counters, settings.counters_interval_s)

    @router.get(COUNTERS_PATH)
    async def tllm_counters(request: Request):
        got = await guarded(counters.get)  # bounded: until_server_stops, shared
        return got if isinstance(got, JSONResponse) else JSONResponse(got)

    @router.get(STATUS_PATH)
    async def tllm_status(request: Request):
        hung = read_note(fault_file)
        if hung is not None:  # the engine is stuck in it: no RPC would answer
            body = {
                **server.describe(),
                "hung": {
                    "consumer": hung.consumer,
                    "callback": hung.callback,
                    "seconds": round(hung.seconds, 1),
                    "deadline_s": hung.deadline_s,
                    "where": hung.where(),
                    "error": f"tllm: {hung.message()}; the engine stops itself",
                },
                **late_controls(),
            }
            return JSONResponse(shown(body), 503)

        async def status() -> JSONResponse:
            out = await ask("tllm_status")
            await counters.get()  # bounded: as above; learns which consumers failed
            leader = next((s for s in out if s.get("rank", {}).get("leader", True)), out[0])
            body = {"worker": leader, **server.describe()}
            body["failed_consumers"] = sorted(server.failed)
            body["controls"] = server.control_state()
            if len(out) > 1:
                body["ranks"] = out
            return JSONResponse(shown(body))

        got = await guarded(status)  # the late controls: front-end state, read with no engine too
        return JSONResponse({**json.loads(got.body), **late_controls()}, got.status_code)

    @router.post(CONTROL_PATH)
    async def tllm_control(name: str, request: Request):
        got = await control(name, request)
        if name in unconfirmed:  # the answer rests on a config the engine may not share
            warning = f"an earlier {unconfirmed[name]!r} request to {name!r} was never answered by "
            warning += "the engine: its config here may differ from the engine's until a restart"
            return JSONResponse({**json.loads(got.body), "warning": warning}, got.status_code)
        return got

    async def control(name: str, request: Request) -> JSONResponse:
        if not tokens:
            return _error(
                "control requests change the server for every client: start it with an API "
                "key (--api-key or VLLM_API_KEY)",
                403,
            )
        cls = server.classes.get(name)
        if cls is None:
            known = ", ".join(sorted(server.classes)) or "(none)"
            return _error(f"no consumer {short_repr(name)}; this server's: {known}", 404)
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError) as e:  # RecursionError: nested past the parser
            return _error(f"the body is not JSON: {e}", 400)
        if not isinstance(body, dict) or not isinstance(body.get("action"), str):
            return _error('the body must be a JSON object with a string "action"', 400)
        action = body.pop("action")
        if read_note(fault_file) is not None:  # the engine is stuck: no RPC would answer
            return _error("a consumer callback is hung (see /tllm/status)", 503)
        if pending:  # the engine's config is not known until it answers
            waiting = ", ".join(f"{n} {a}" for n, a in pending.items())
            return _error(
                f"an earlier control request ({waiting}) still waits for the engine's answer "
                "(see /tllm/status)",
                503,
            )
        try:  # bounded: the holder waits for the engine engine_answer_s at most
            await asyncio.wait_for(control_lock.acquire(), settings.engine_answer_s)
        except asyncio.TimeoutError:
            return _error("another control request still waits for the engine's answer", 503)
        handed_over = False  # to adopt_late, which releases the lock
        try:
            config = server.configs[name]
            try:
                new, reply = cls.check_control(action, body, config)
            except ControlError as e:
                return _error(str(e), e.status)
            if new is not config:
                sent: list[Any] = []

                def send() -> Any:
                    rpc = rpc_all(app.state.tllm_engine_client, "tllm_control", name, action, body)
                    sent.append(asyncio.ensure_future(rpc))
                    return ask("tllm_control", call=asyncio.shield(sent[0]))

                late = "; the engine may still apply it, and then so does the server (see /tllm/status)"
                out: Any = None
                try:
                    out = await guarded(send, late)
                finally:
                    # Sent but not answered here (504, the server stopping, the route
                    # cancelled): the engine may still apply it, so its answer is adopted.
                    if sent and not isinstance(out, list):
                        pending[name] = action
                        task = asyncio.ensure_future(adopt_late(sent[0], name, action, new))
                        late_tasks.add(task)
                        task.add_done_callback(late_tasks.discard)
                        handed_over = True
                if isinstance(out, JSONResponse):
                    return out
                failed = next((o for o in out if "error" in o), None)
                if failed is not None:
                    return _error(failed["error"], failed.get("status", 400))
                server.control_applied(name, new)
        finally:
            if not handed_over:
                control_lock.release()
        return JSONResponse(shown({"consumer": name, "action": action, "reply": reply}))

    app.include_router(router)


def install_request_checks(
    input_processor: Any,
    server: EngineConsumers,
    secret: bytes | None = None,
    max_result_bytes: int | None = None,
    hidden_size: int = 0,
) -> None:
    """Wrap this server's input processor: checks, cache salts (keyed by ``secret``), groups;
    requests whose results a consumer bounds past ``max_result_bytes`` are refused."""
    from vllm.exceptions import VLLMValidationError

    require_attrs(input_processor, ("assign_request_id",), "input processor")
    salt_key = secret if secret is not None else secrets.token_bytes(32)
    assign_orig = input_processor.assign_request_id

    def assign_request_id(request: Any) -> None:
        params = getattr(request, "sampling_params", None)
        extra = getattr(params, "extra_args", None)
        # XargsCheck's checks again (the keys unless it checked them): a body it cannot read
        # (UTF-16, another route) skipped them. ASKED: bound on routes with results.
        results_route, checked = ASKED.get() is not None, XARGS_CHECKED.get()
        if extra and (error := check_xargs(extra, server, results_route, not checked)):
            raise VLLMValidationError(error[1], parameter="vllm_xargs")
        if extra and RESULTS_KEY in extra:
            refused, held = REFUSED.get(), HELD.get()
            why = (refused[0] if refused else None) or id_in_use(request)
            if why is None and max_result_bytes is not None:
                why = check_bounds(request, extra, server, max_result_bytes, hidden_size, held)
            if why is not None:  # its other prompts are aborted or refused: no results to wait for
                (ASKED.get() or {}).clear()
                if refused == []:
                    refused.append(why)
                raise VLLMValidationError(why, parameter="vllm_xargs")
        assign_orig(request)
        note_request(request, extra)
        salt = request_salt(extra, salt_key, server=server)
        if salt is not None:
            old = request.cache_salt
            request.cache_salt = f"{old}|{salt}" if old else salt
        if params is not None:  # before the n fan-out: the samples share the group and know n
            group = scoped_group(extra or {}, CLIENT.get(), request.request_id)
            params.extra_args = {**(extra or {}), GROUP_KEY: group, SAMPLES_KEY: params.n}

    input_processor.assign_request_id = assign_request_id


MAX_FAN_OUTS = 4096  # fan-outs being routed (least recently routed dropped: aborted ones)


def group_engine(group: str, engines: int) -> int:
    """The engine of a client's ``tllm_group`` (``"client-{digest}/{name}"``): rendezvous
    hashing of ``name`` alone, so nothing is remembered (any number of groups), every API
    server process and a restarted server agree, and a change in the number of engines moves
    only the groups of the engines added or removed."""
    name = group.partition("/")[2].encode("utf-8", "surrogatepass")

    def score(engine: int) -> bytes:
        return hashlib.blake2b(name, digest_size=8, salt=engine.to_bytes(8, "little")).digest()

    return max(range(engines), key=score)


def install_group_affinity(engine_client: Any) -> None:
    """Data parallel: the requests of one group go to one engine (vLLM balances each request
    and each of its ``n`` samples alone), so a group (ESamp: one distiller) lives in one
    engine (CONTRACT.md): a request's own samples follow the first, which vLLM balances; a
    client's ``tllm_group`` goes to the engine :func:`group_engine` names."""
    core = engine_client.engine_core
    engines = getattr(core, "core_engines", None)
    if engine_client.vllm_config.parallel_config.data_parallel_size < 2 or (
        engines is not None and len(engines) < 2
    ):
        return  # one engine here (no DP, or an external balancer in front)
    require_attrs(core, ("core_engines", "get_core_engine_for_request"), "data-parallel client")
    route = core.get_core_engine_for_request
    # a request's own group -> [engine index, samples left to route]
    placed: OrderedDict[str, list] = OrderedDict()

    def to_engine(request: Any, index: int) -> Any:
        # vLLM's own path for a set rank: its in-flight books (aborts, load) stay right.
        request.data_parallel_rank = index
        try:
            return route(request)
        finally:
            request.data_parallel_rank = None

    def get_core_engine_for_request(request: Any) -> Any:
        extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
        group, n = extra.get(GROUP_KEY), int(extra.get(SAMPLES_KEY) or 1)
        own = isinstance(group, str) and group.startswith(OWN_GROUP)
        if not isinstance(group, str) or (own and n < 2) or request.data_parallel_rank is not None:
            return route(request)
        if not own:
            return to_engine(request, group_engine(group, len(core.core_engines)))
        seen = placed.get(group)
        if seen is None or seen[0] >= len(core.core_engines):  # new, or its engine removed
            engine = route(request)
            placed[group] = [core.core_engines.index(engine), n - 1]
            placed.move_to_end(group)
            while len(placed) > MAX_FAN_OUTS:
                placed.popitem(last=False)
            return engine
        seen[1] -= 1
        if seen[1] <= 0:  # a request's samples are all routed
            del placed[group]
        return to_engine(request, seen[0])

    get_core_engine_for_request.placed = placed  # type: ignore[attr-defined] # for tests
    core.get_core_engine_for_request = get_core_engine_for_request


async def init_state(
    engine_client: Any, state: Any, server: EngineConsumers, watch: nodes.NodeWatch
) -> None:
    leader = tllm_settings(engine_client.vllm_config.additional_config)
    mine = RuntimeSettings.model_validate(leader or {})
    install_request_checks(
        engine_client.input_processor,
        server,
        getattr(state, "tllm_secret", None),
        max_result_bytes=mine.max_result_bytes,
        hidden_size=int(engine_client.vllm_config.model_config.get_hidden_size()),
    )
    # A multi-node leader checks every engine and rank; a lost node stops this server.
    parallel = engine_client.vllm_config.parallel_config
    nnodes = nodes.node_count(parallel)
    interval = nodes.check_interval()
    watching_nodes = nnodes > 1 and interval != 0
    stop = nodes.stop_self("the server")
    # Ranks across nodes (TP, PP) answer through one engine core; a remote DP engine's core
    # is on its own node, and hangs with it: a bound on its wait would buy nothing.
    ranks_across_nodes = int(getattr(parallel, "nnodes", 1) or 1) > 1
    bound: RpcBound | None = None

    def lost(reason: str) -> None:  # once the server stops, no more calls to the engine
        if bound is not None:
            bound.lost = bound.lost or reason
        stop(reason)

    if watching_nodes and ranks_across_nodes:
        seconds = nodes.check_bound(mine.callback_deadline_s) + nodes.NODE_RPC_MARGIN_S

        def on_timeout(why: str) -> None:
            watch.report(nodes.node_lost(nnodes, why), lost)

        bound = RpcBound(seconds, on_timeout)
        setattr(engine_client, RPC_BOUND_ATTR, bound)
    ask_engine = functools.partial(answered, mine.server.engine_answer_s)
    install_abort_marks(engine_client, lambda method, ids: ask_engine(engine_client, method, ids))
    install_group_affinity(engine_client)
    state.tllm_engine_client = engine_client
    state.tllm_http_close = asyncio.get_running_loop().create_task(bound_http_close(state))
    await nodes.check_followers(engine_client, ask_engine, leader, watch)
    status = await ask_engine(engine_client, "tllm_status")
    if not status or not all(s.get("installed") for s in status):
        raise RuntimeError(
            f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] is set but the tllm runtime is not "
            f"installed in the model runner (worker status: {status})"
        )
    if watching_nodes:
        ask = functools.partial(nodes.ask_node_check, rpc_all, engine_client)
        watching = watch.watch_nodes(ask, nnodes, interval, lost, mine.callback_deadline_s)
        state.tllm_node_watch = asyncio.get_running_loop().create_task(watching)
    log.info(
        "tllm: serving with consumers %s (per request: %s) on vLLM's %s; counters at GET %s",
        sorted(server.per_request),
        sorted(n for n, p in server.per_request.items() if p),
        status[0].get("runner", "?"),
        COUNTERS_PATH,
    )


async def bound_http_close(state: Any, wait_s: float = 60.0) -> None:
    """Bound the HTTP server's wait for open requests at shutdown (``close_http_soon``), once
    vLLM's server appears in ``state.server`` (after ``init_state``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while loop.time() < deadline:
        server = getattr(state, "server", None)
        if server is not None:
            close_http_soon(getattr(server, "handle_exit", None))
            return
        await asyncio.sleep(0.1)

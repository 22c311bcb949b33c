"""The server's guards at the ASGI level, without an engine (issue 26): body size limit and
linear reading, the API key on ``/tllm/*``, hidden paths, unforgeable cache salts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import traceback
import uuid
import weakref

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.requests import Request

from tllm_core.api.rows import RequestInfo
from tllm_core.runtime.settings import RuntimeSettings, ServerSettings
from tllm_core.serving import EngineConsumers, request_salt
from tllm_core.serving.guard import HIDDEN, BearerGuard, hide_paths
from tllm_core.vllm_bridge.serving import XargsCheck, api_tokens


@pytest.fixture(scope="module")
def engine() -> EngineConsumers:
    return EngineConsumers.from_settings({"consumers": [{"name": "esamp", "per_request": True}]})


class FakeApp:
    """The app behind the middleware: reads the whole body through ``receive``, answers 200."""

    def __init__(self):
        self.calls = 0
        self.body = b""

    async def __call__(self, scope, receive, send):
        self.calls += 1
        parts = []
        while True:
            msg = await receive()
            parts.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        self.body = b"".join(parts)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


class Message(dict):
    """An ASGI message that can be watched (weakref) for how long it is kept."""

    __slots__ = ("__weakref__",)
    __hash__ = object.__hash__  # by identity, for a WeakSet


class Chunks:
    """A fake ``receive``: the body in the given pieces, counting the calls and the most
    messages it gave that were still alive at once."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = list(pieces)
        self.calls = 0
        self.alive: weakref.WeakSet = weakref.WeakSet()
        self.most_alive = 0

    async def __call__(self):
        self.calls += 1
        assert self.calls <= len(self.pieces), "receive called past the end of the body"
        i = self.calls - 1
        msg = Message(type="http.request", body=self.pieces[i], more_body=i + 1 < len(self.pieces))
        self.alive.add(msg)
        self.most_alive = max(self.most_alive, len(self.alive))
        return msg


@contextlib.contextmanager
def _records(name: str):
    """The records logger ``name`` emits meanwhile, whether or not it propagates (vLLM's
    logging config stops "vllm.*" propagating once vLLM is imported in the process)."""
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


def _call(middleware, receive, path="/v1/completions", method="POST", headers=()):
    sent: list[dict] = []

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": method, "path": path, "headers": list(headers)}
    asyncio.run(middleware(scope, receive, send))
    status = sent[0]["status"]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return status, body


class Piece(bytes):
    """A body chunk that counts how often it is appended with ``+``: ``body += chunk`` copies
    the body so far each time (quadratic in the number of chunks); a join copies once."""

    appended = 0

    def __radd__(self, other: bytes) -> bytes:
        Piece.appended += 1
        return bytes(other) + bytes(self)


def _pieces(body: bytes, size: int) -> list[bytes]:
    return [Piece(body[i : i + size]) for i in range(0, len(body), size)]


def test_body_past_the_limit_is_413_before_the_app(engine):
    app = FakeApp()
    mw = XargsCheck(app, engine, max_body_bytes=4096)
    status, body = _call(mw, Chunks([b"x" * 1000] * 5))  # 5000 bytes, no Content-Length
    assert status == 413 and app.calls == 0
    assert "4096 bytes" in json.loads(body)["error"]["message"]
    # A declared Content-Length past the limit is refused on any POST route, the body read
    # and dropped (the client can then read the 413), or, past 4 times the limit, not read.
    receive = Chunks([b"x" * 1000] * 5)
    status, _ = _call(mw, receive, path="/v1/embeddings", headers=[(b"content-length", b"5000")])
    assert status == 413 and receive.calls == 5 and app.calls == 0
    receive = Chunks([b"x" * 1000] * 5)
    huge = [(b"content-length", b"1000000000")]
    status, _ = _call(mw, receive, path="/v1/embeddings", headers=huge)
    assert status == 413 and receive.calls == 0 and app.calls == 0
    # Past the limit without a Content-Length: the rest is drained up to 4 times the limit.
    receive = Chunks([b"x" * 1000] * 40)
    status, _ = _call(mw, receive)
    assert status == 413 and receive.calls == 5 + 17 and app.calls == 0
    # Any POST route is counted, not only the checked ones.
    status, _ = _call(mw, Chunks([b"x" * 1000] * 5), path="/v1/audio/transcriptions")
    assert status == 413 and app.calls == 0
    # At the limit it passes, whole.
    status, _ = _call(mw, Chunks([b"x" * 1024] * 4))
    assert status == 200 and app.body == b"x" * 4096


def test_many_tiny_chunks_are_read_once_and_replayed_whole(engine):
    # 200,000 one-byte chunks: with `body += chunk` this copies ~20 GB (minutes); joined once,
    # a blink. The test does not time it: the CI timeout catches the quadratic version.
    good = json.dumps(
        {
            "prompt": "hi " * 66_000,
            "vllm_xargs": {"tllm_consumers": "esamp", "tllm_esamp_beta": 0.5},
        }
    ).encode()
    assert len(good) > 190_000
    app = FakeApp()
    mw = XargsCheck(app, engine, max_body_bytes=ServerSettings().max_body_bytes)
    receive = Chunks(_pieces(good, 1))
    Piece.appended = 0
    status, _ = _call(mw, receive)
    assert status == 200 and app.body == good and receive.calls == len(good)
    assert Piece.appended == 0  # joined once, never grown chunk by chunk
    # Its messages are not kept: each is a dict many times its byte (~200 bytes per byte).
    assert receive.most_alive <= 2, receive.most_alive
    bad = good.replace(b'"tllm_esamp_beta": 0.5', b'"tllm_esamp_beta": 1e39')
    status, body = _call(XargsCheck(FakeApp(), engine), Chunks(_pieces(bad, 1)))
    assert status == 400 and "float32" in json.loads(body)["error"]["message"]


def test_results_asked_on_the_responses_route_are_refused(engine):
    """/v1/responses has no choices to carry per-request results: asking there is a 400
    naming the routes that do, before vLLM sees the request (esamp makes results)."""
    body = json.dumps(
        {"input": "hi", "vllm_xargs": {"tllm_consumers": "esamp", "tllm_results": "esamp"}}
    ).encode()
    app = FakeApp()
    status, out = _call(XargsCheck(app, engine), Chunks([body]), path="/v1/responses")
    message = json.loads(out)["error"]["message"]
    assert status == 400 and app.calls == 0 and "/v1/chat/completions" in message
    status, _ = _call(XargsCheck(FakeApp(), engine), Chunks([body]), path="/v1/completions")
    assert status == 200


def test_body_limit_is_a_server_setting():
    assert ServerSettings().max_body_bytes == 32 * 1024 * 1024
    s = RuntimeSettings.model_validate({"server": {"max_body_bytes": 1 << 20}})
    assert s.server.max_body_bytes == 1 << 20
    with pytest.raises(ValueError, match="max_body_bytes"):
        RuntimeSettings.model_validate({"server": {"max_body_bytes": 0}})


def test_tllm_routes_need_the_api_key():
    app = FakeApp()
    guard = BearerGuard(app, tokens=["s3cret", "other"])
    for path in ("/tllm/counters", "/tllm/status"):
        status, _ = _call(guard, Chunks([b""]), path=path, method="GET")
        assert status == 401
        wrong = [(b"authorization", b"Bearer nope")]
        assert _call(guard, Chunks([b""]), path=path, method="GET", headers=wrong)[0] == 401
        for key in (b"s3cret", b"other"):
            ok = [(b"authorization", b"Bearer " + key)]
            assert _call(guard, Chunks([b""]), path=path, method="GET", headers=ok)[0] == 200
    # Other routes are vLLM's business; no key configured: nothing is guarded.
    assert _call(guard, Chunks([b""]), path="/health", method="GET")[0] == 200
    assert _call(guard, Chunks([b""]), path="/tllmx", method="GET")[0] == 200
    open_guard = BearerGuard(FakeApp(), tokens=[])
    assert _call(open_guard, Chunks([b""]), path="/tllm/counters", method="GET")[0] == 200


def test_api_tokens_follow_vllms_rule(monkeypatch):
    from types import SimpleNamespace

    import vllm.envs

    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    if hasattr(vllm.envs, "cache_clear"):
        vllm.envs.cache_clear()  # vLLM may cache environment reads
    assert api_tokens(SimpleNamespace(api_key=["a", "b"])) == ["a", "b"]
    assert api_tokens(SimpleNamespace(api_key=None)) == ["from-env"]
    monkeypatch.delenv("VLLM_API_KEY")
    if hasattr(vllm.envs, "cache_clear"):
        vllm.envs.cache_clear()
    assert api_tokens(SimpleNamespace(api_key=None)) == []


def test_paths_are_hidden_from_responses():
    report = {
        "results": {
            "export": {"out": "/srv/data/run1", "rows": 3},
            "sae": {"path": "saes/layer3", "site": "3"},
        },
        "errors": [{"message": 'File "/home/op/tllm/x.py", line 3: boom; top-k/top-p 1/0'}],
        "keys": {"tllm_x": "e.g. true/false"},
    }
    shown = hide_paths(report)
    assert shown["results"]["export"] == {"out": HIDDEN, "rows": 3}
    assert shown["results"]["sae"] == {"path": HIDDEN, "site": "3"}
    assert shown["errors"][0]["message"] == f'File "{HIDDEN}", line 3: boom; top-k/top-p 1/0'
    assert shown["keys"] == report["keys"]
    assert "/srv" not in json.dumps(shown) and "/home" not in json.dumps(shown)


def test_client_cache_salt_cannot_equal_tllms():
    steered = {"tllm_consumers": "steer", "tllm_steer_scale": 8}
    key_a, key_b = b"a" * 32, b"b" * 32
    # The salt is keyed by the server's secret: what a client can compute (no key, or a
    # guessed one) is not it; the same settings on one server still share the cache.
    assert request_salt(steered, key_a) == request_salt(dict(steered), key_a)
    assert request_salt(steered, key_a) != request_salt(steered)
    assert request_salt(steered, key_a) != request_salt(steered, key_b)
    assert request_salt(steered, key_a) != request_salt(
        {"tllm_consumers": "steer", "tllm_steer_scale": 4}, key_a
    )
    assert request_salt({"x": 1}, key_a) is None


def _admit(engine):
    """``admit(extra, cache_salt, request_id)``: a request through the input-processor
    wrappers of a server (a fake processor whose own ``assign_request_id`` adds a suffix)."""
    from types import SimpleNamespace

    from tllm_core.vllm_bridge.serving import install_request_checks

    def assign(request):
        request.request_id = f"{request.request_id}-rand{next(ids)}"

    ids = iter(range(10**6))
    processor = SimpleNamespace(
        validate_logits_processors_params=lambda params: None, assign_request_id=assign
    )
    install_request_checks(processor, engine)

    def admit(extra, cache_salt=None, request_id="r", n=1):
        params = SimpleNamespace(extra_args=extra, n=n)
        request = SimpleNamespace(
            sampling_params=params, cache_salt=cache_salt, request_id=request_id
        )
        processor.assign_request_id(request)
        return request

    return admit


def test_server_salts_requests_with_its_secret(engine):
    admit = _admit(engine)
    steered = {"tllm_consumers": "esamp", "tllm_esamp_beta": 0.5}
    mine = admit(steered).cache_salt
    assert mine.startswith("tllm-") and mine == admit(dict(steered)).cache_salt
    # A plain request whose client salt is the one anyone can compute does not share its KV.
    assert admit({}, cache_salt=request_salt(steered)).cache_salt != mine
    assert admit({}, cache_salt="x").cache_salt == "x"
    assert admit(steered, cache_salt="x").cache_salt == f"x|{mine}"


def test_groups_are_scoped_to_a_client(engine):
    from tllm_core.serving.guard import CLIENT, ClientScope

    admit = _admit(engine)

    def group(extra, client="anon", request_id="r"):
        token = CLIENT.set(client)
        try:
            return admit(extra, request_id=request_id).sampling_params.extra_args["tllm_group"]
        finally:
            CLIENT.reset(token)

    named = {"tllm_consumers": "esamp", "tllm_group": "g"}
    assert group(named, "alice") == group(dict(named), "alice")  # one client: one group
    assert group(named, "alice") != group(named, "mallory")  # another cannot join it
    # Default group: the request's own; the same X-Request-Id does not make two share one.
    assert group({}, request_id="x") != group({}, request_id="x")
    assert group(None, request_id="x").startswith("request/x-rand")
    # The samples of a request know how many they are; a client's group may pool prompts.
    own, pooled = (admit(e, n=3).sampling_params.extra_args for e in ({}, dict(named)))
    info = lambda extra: RequestInfo("0_r-rand9", "r", 0, 0, 1, extra_args=extra)  # noqa: E731
    assert own["tllm_n"] == 3 and info(own).group_size == 3
    assert info(pooled).num_samples == 3 and info(pooled).group_size is None
    # The middleware names the client by its Authorization header, keyed by the secret.
    seen = []

    async def app(scope, receive, send):
        seen.append(CLIENT.get())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    mw = ClientScope(app, secret=b"s" * 32)
    for auth in (b"Bearer a", b"Bearer a", b"Bearer b"):
        _call(mw, Chunks([b""]), headers=[(b"authorization", auth)])
    _call(mw, Chunks([b""]))
    assert seen[0] == seen[1] != seen[2] and seen[3] == "anon" and len(seen[0]) == 12
    assert CLIENT.get() == "anon"  # reset after the request


def _app(engine, api_key, settings=None, errors=None, hung=False, fails=None):
    """A FastAPI app with tllm's routes and middlewares as the plugin attaches them, and a
    fake engine client whose report shows server paths (``hung``: it never answers one;
    ``fails``: it raises that for every call)."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from tllm_core.vllm_bridge.request_marks import note_request
    from tllm_core.vllm_bridge.serving import attach_routes

    failed: list[str] = []  # engine ids of the requests a consumer failed on

    def run(body):
        """What vLLM's assign_request_id (wrapped) does per caller id in ``body["run"]``: a
        unique engine id. A request fails when its caller id starts with "bad", or is in
        ``body["fail"]``."""
        for rid in body.get("run", []):
            engine_id, n = f"{rid}-{uuid.uuid4().hex[:8]}", body.get("n", 1)
            params = SimpleNamespace(n=n)
            note_request(
                SimpleNamespace(request_id=engine_id, external_req_id=rid, sampling_params=params),
                None,
            )
            if rid in body.get("fail", [r for r in body["run"] if r.startswith("bad")]):
                failed.append(engine_id)

    class FakeEngineClient:
        failure_reads = 0

        async def collective_rpc(self, method, args=()):
            if fails is not None:
                raise fails
            if method == "tllm_status":
                return [{"installed": True, "rank": {"leader": True}}]
            if method == "tllm_failed_requests":  # a failing esamp met these (run)
                assert args == (None,)  # every failure the workers remember
                FakeEngineClient.failure_reads += 1
                await asyncio.sleep(0.05)  # a round trip to the engine
                return [{r: ["esamp"] for r in failed}]
            if hung:
                await asyncio.Event().wait()
            return [
                {
                    "runtime": {"steps": 1},
                    "consumers": {"export": {"rows_written": 3, "mean": float("nan")}},
                    "results": {"export": {"out": "/srv/secret/run", "rows": 3}},
                    "errors": errors
                    or [{"message": "OSError: [Errno 28] /srv/secret/run/shard.npy"}],
                }
            ]

    app = FastAPI()
    app.state.args = SimpleNamespace(api_key=api_key)
    attach_routes(app, engine, settings)
    app.state.tllm_engine_client = FakeEngineClient()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if body.get("stream"):  # vLLM's stream: headers first, requests admitted afterwards
            from fastapi.responses import StreamingResponse

            async def events():
                yield b'data: {"text": "a"}\n\n'
                run(body)
                yield b'data: {"text": "b"}\n\ndata: [DONE]\n\n'

            return StreamingResponse(events(), media_type="text/event-stream")
        run(body)
        return {"ok": True}

    return TestClient(app)


def test_app_routes_ask_the_servers_api_key_and_hide_paths(engine):
    client = _app(engine, ["k1"])
    assert client.get("/tllm/counters").status_code == 401
    assert client.get("/tllm/status", headers={"Authorization": "Bearer no"}).status_code == 401
    ok = {"Authorization": "Bearer k1"}
    counters = client.get("/tllm/counters", headers=ok)
    assert counters.status_code == 200
    assert "/srv" not in counters.text and counters.json()["results"]["export"]["out"] == HIDDEN
    assert counters.json()["consumers"]["export"]["mean"] == "NaN"  # strict JSON, still served
    assert client.get("/tllm/status", headers=ok).status_code == 200
    # The request checks and body limit are wired in too.
    bad = {"prompt": "x", "vllm_xargs": {"tllm_consumers": "esamp", "tllm_esamp_beta": 1e39}}
    assert client.post("/v1/completions", json=bad).status_code == 400
    assert client.post("/v1/completions", json={"prompt": "x"}).json() == {"ok": True}
    # No key on the server: open, as /v1 is; the operator may show paths.
    shown = _app(engine, None, ServerSettings(show_paths=True)).get("/tllm/counters")
    assert (
        shown.status_code == 200 and shown.json()["results"]["export"]["out"] == "/srv/secret/run"
    )
    small = _app(engine, None, ServerSettings(max_body_bytes=2048))
    assert small.post("/v1/completions", content=b"x" * 4096).status_code == 413


def test_an_engine_that_never_answers_gets_504_naming_the_call(engine):
    client = _app(engine, None, ServerSettings(engine_answer_s=0.5), hung=True)
    got = client.get("/tllm/counters")
    assert got.status_code == 504
    assert got.json()["error"] == "the engine did not answer 'tllm_collect' in 0.5 s"


def test_an_engine_that_fails_a_call_gets_503_naming_its_error_not_a_500(engine):
    """A rank's error, or a call timed out on a lost node: each /tllm route answers JSON
    naming it (paths hidden), as for any other engine failure, not a 500 with a traceback."""
    failed = Exception("Call failed: RPC call to tllm_collect timed out. (/srv/secret/x.py)")
    client = _app(engine, None, fails=failed)
    for path in ("/tllm/counters", "/tllm/status"):
        got = client.get(path)
        assert got.status_code == 503, (path, got.text)
        message = "the engine failed this call: Call failed: RPC call to tllm_collect timed out."
        assert got.json()["error"] == f"{message} (<hidden>)", got.text


def test_a_refused_prompt_has_the_results_of_the_prompts_admitted_before_dropped(engine):
    """A completion request one of whose prompts is refused (its results past the store)
    fails as a whole: vLLM aborts its other prompts by their engine ids; once its response is
    out the engine drops what they made (one may have ended before that abort). Nothing is
    aborted by caller id: another client's request may use the same id."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from fastapi.testclient import TestClient

    from tllm_core.vllm_bridge.request_marks import ADMITTED, HELD, REFUSED
    from tllm_core.vllm_bridge.serving import attach_routes

    calls: list[tuple] = []

    class Client:
        async def abort(self, request_ids):
            calls.append(("abort", list(request_ids)))

        async def collective_rpc(self, method, args=()):
            if method != "tllm_failed_requests":  # each response's read of its failure marks
                calls.append((method, *args))
            return [None]

    app = FastAPI()
    app.state.args = SimpleNamespace(api_key=None)
    attach_routes(app, engine)
    app.state.tllm_engine_client = Client()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        HELD.get().update(dict.fromkeys(body["admitted"], 1))  # as check_bounds admits
        ADMITTED.get().extend(f"{r}-x" for r in body["admitted"])  # and vLLM's engine ids
        if body.get("refused"):  # as the input processor's wrapper refuses the next prompt
            REFUSED.get().append("past the store")
            return JSONResponse({"error": {"message": "past the store"}}, 400)
        return {"ok": True}

    client = TestClient(app)
    assert client.post("/v1/completions", json={"admitted": ["c-0", "c-1"]}).status_code == 200
    assert calls == []  # nothing refused: the response takes what they made
    ids = ["d-0", "d-1"]
    got = client.post("/v1/completions", json={"admitted": ids, "refused": True})
    assert got.status_code == 400
    # With their engine ids: the engine may first see one after the discard (no retry).
    assert calls == [("tllm_discard_results", ids, ["d-0-x", "d-1-x"])]


def test_a_failed_read_fails_every_request_that_waited_for_it():
    from tllm_core.serving.throttle import Throttle

    async def scenario():
        calls = []

        async def fetch():
            calls.append(1)
            await asyncio.sleep(0.05)
            raise TimeoutError("no answer")

        t = Throttle(fetch)
        first = asyncio.ensure_future(t.get())
        await asyncio.sleep(0.01)  # the read is in flight: these wait for it
        waited = await asyncio.gather(*(t.get() for _ in range(5)), return_exceptions=True)
        with pytest.raises(TimeoutError):
            await first
        with pytest.raises(TimeoutError):
            await t.get()  # a later request reads again
        return waited, len(calls)

    waited, reads = asyncio.run(scenario())
    assert all(isinstance(w, TimeoutError) for w in waited)
    assert reads == 2  # one for the six that waited together, one for the later one
    # Each waiter raises its own copy: one shared exception's traceback would grow by every
    # waiter's frames, and each logs it (hundreds of waiters: a log quadratic in them).
    assert len({id(w) for w in waited}) == 5 and all(
        w.__cause__ is waited[0].__cause__ for w in waited
    )
    assert len({len(traceback.extract_tb(w.__traceback__)) for w in waited}) == 1


def test_counters_reads_are_shared_and_never_older_than_the_request():
    from tllm_core.serving.throttle import Throttle

    async def scenario(min_interval_s):
        calls = []

        async def fetch():
            calls.append(len(calls))
            await asyncio.sleep(0.05)
            return len(calls)

        t = Throttle(fetch, min_interval_s)
        first = asyncio.ensure_future(t.get())
        await asyncio.sleep(0.01)  # the first read is in flight
        rest = await asyncio.gather(*(t.get() for _ in range(9)))
        assert await first == 1
        after = await t.get()  # arrives after every read so far: needs a new one
        return rest, after, t.reads

    rest, after, reads = asyncio.run(scenario(0.0))
    # Ten requests, two reads: the nine waiting share the read that began after they came.
    assert rest == [2] * 9 and after == 3 and reads == 3
    rest, after, reads = asyncio.run(scenario(60.0))
    assert rest == [1] * 9 and after == 1 and reads == 1  # an operator's interval: reused


json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10),
    st.sampled_from(["esamp", "tllm_esamp_beta", "Infinity", "1e39"]),
)
json_any = st.recursive(
    json_leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
xargs = st.dictionaries(
    st.sampled_from(["tllm_consumers", "tllm_esamp_beta", "tllm_group", "tllm_x", "other"]),
    json_any,
    max_size=4,
)


def _nested(depth: int) -> bytes:
    return b'{"vllm_xargs": ' + b"[" * depth + b'"tllm_"' + b"]" * depth + b"}"


bodies = st.one_of(
    st.builds(lambda x: json.dumps({"prompt": "p", "vllm_xargs": x}).encode(), xargs),
    st.builds(lambda x: json.dumps(x).encode(), json_any),
    st.binary(max_size=60).map(lambda b: b + b"tllm_"),
    st.integers(1, 2000).map(_nested),
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies, piece=st.integers(1, 64))
def test_any_body_is_passed_on_or_refused_cleanly(engine, body, piece):
    app = FakeApp()
    status, answer = _call(
        XargsCheck(app, engine, max_body_bytes=4096), Chunks(_pieces(body, piece))
    )
    if len(body) > 4096:
        assert status == 413
    elif status == 200:
        assert app.calls == 1 and app.body == body  # passed on whole
    else:
        assert status == 400 and app.calls == 0
        assert json.loads(answer)["error"]["message"].startswith("tllm: ")


def test_deeply_nested_body_is_a_400_not_a_crash(engine):
    app = FakeApp()
    status, answer = _call(XargsCheck(app, engine), Chunks([_nested(1500)]))
    assert status == 400 and b"nested too deeply" in answer and app.calls == 0


def test_requests_naming_a_failed_consumer_get_503():
    from tllm_core.serving import EngineConsumers

    engine = EngineConsumers.from_settings(
        {"consumers": [{"name": "esamp", "per_request": True}, {"name": "stats"}]}
    )
    failed = [{"consumer": "esamp", "where": "on_bundle", "error": "consumer 'esamp' raised"}]
    client = _app(engine, None, errors=failed)
    named = {"prompt": "x", "vllm_xargs": {"tllm_consumers": "esamp"}}
    assert client.post("/v1/completions", json=named).status_code == 200  # not known yet
    status = client.get("/tllm/status")  # a status (or counters) read learns of the failure
    assert status.status_code == 200 and status.json()["failed_consumers"] == ["esamp"]
    refused = client.post("/v1/completions", json=named)
    assert refused.status_code == 503 and "'esamp' failed" in refused.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    # A body the middleware cannot read (UTF-16 JSON, another route): refused at admission.
    from vllm.exceptions import VLLMValidationError

    admit = _admit(engine)
    with pytest.raises(VLLMValidationError, match="'esamp' failed on this server"):
        admit({"tllm_consumers": "esamp"})
    assert admit({"tllm_consumers": "stats"}).request_id.startswith("r-rand")


def test_aborted_requests_are_marked_cut_short_before_the_abort():
    """A client that disconnects: vLLM aborts its request; the workers hear which requests
    are cut short before the engine core gets the abort (so no finish notice overtakes it),
    and the abort happens even when the mark cannot be sent. The output handler's aborts of
    requests ended on a stop string (straight to the engine core) are not marked."""
    from types import SimpleNamespace

    from tllm_core.vllm_bridge.request_marks import EngineNoAnswer, install_abort_marks

    calls = []
    broken = []

    async def core_abort(ids):
        calls.append(("abort", list(ids)))

    async def abort(request_id, internal=False):  # AsyncLLM.abort: the engine-core ids
        await client.engine_core.abort_requests_async([f"{i}_{request_id}" for i in range(2)])

    async def ask(method, ids):  # serving's rpc_all on every worker
        if broken:
            raise broken[-1]
        calls.append((method, ids))
        return [None]

    client = SimpleNamespace(engine_core=SimpleNamespace(abort_requests_async=core_abort))
    client.abort = abort
    install_abort_marks(client, ask)
    asyncio.run(client.abort("r-abcdefgh", internal=True))
    assert calls == [
        ("tllm_mark_cut_short", ["0_r-abcdefgh", "1_r-abcdefgh"]),
        ("abort", ["0_r-abcdefgh", "1_r-abcdefgh"]),
    ]
    calls.clear()
    asyncio.run(client.engine_core.abort_requests_async(["s-abcdefgh"]))  # a stop string
    assert calls == [("abort", ["s-abcdefgh"])]
    calls.clear()
    broken.append(RuntimeError("engine core gone"))
    asyncio.run(client.abort("x-abcdefgh"))
    assert calls == [("abort", ["0_x-abcdefgh", "1_x-abcdefgh"])]
    # An engine that does not answer (stopping, or stuck): one line, the abort still sent.
    calls.clear()
    broken.append(EngineNoAnswer("the engine did not answer 'tllm_mark_cut_short' in 1 s"))
    with _records("vllm.tllm") as records:
        asyncio.run(client.abort("y-abcdefgh"))
    assert calls == [("abort", ["0_y-abcdefgh", "1_y-abcdefgh"])]
    (rec,) = [r for r in records if "not marked cut short" in r.getMessage()]
    assert rec.levelname == "WARNING" and rec.exc_info is None and "in 1 s" in rec.getMessage()


def test_many_aborts_at_once_share_their_mark_rpcs_and_each_is_marked_before_its_abort():
    """Fifty clients gone at once: the aborts made before a mark RPC is sent, or while one is
    in flight, share it or the next (here one RPC, not fifty), each request is marked before
    its own abort, and a mark that fails reaches every abort of its batch (each still
    aborts)."""
    from types import SimpleNamespace

    from tllm_core.vllm_bridge.request_marks import install_abort_marks

    marked: set[str] = set()
    rpcs: list[list[str]] = []
    aborted: list[str] = []
    late: list[str] = []
    failing: list[Exception] = []

    async def ask(method, ids):
        assert method == "tllm_mark_cut_short"
        rpcs.append(list(ids))
        await asyncio.sleep(0.05)  # the workers answer after a while
        if failing:
            raise failing[0]
        marked.update(ids)

    async def core_abort(ids):
        aborted.extend(ids)
        late.extend(i for i in ids if i not in marked)

    async def abort(request_id, internal=False):
        await client.engine_core.abort_requests_async([request_id])

    async def gone(n: int, prefix: str) -> None:
        await asyncio.gather(*(client.abort(f"{prefix}{i}") for i in range(n)))

    client = SimpleNamespace(engine_core=SimpleNamespace(abort_requests_async=core_abort))
    client.abort = abort
    install_abort_marks(client, ask)
    asyncio.run(gone(50, "r"))
    assert sorted(aborted) == sorted(f"r{i}" for i in range(50)) and late == []
    assert len(rpcs) == 1 and sorted(sum(rpcs, [])) == sorted(aborted), rpcs
    rpcs.clear()
    aborted.clear()
    failing.append(RuntimeError("engine core gone"))
    with _records("vllm.tllm") as records:
        asyncio.run(gone(5, "x"))
    assert sorted(aborted) == [f"x{i}" for i in range(5)] and len(rpcs) == 1
    said = [r for r in records if "could not mark aborted requests" in r.getMessage()]
    assert len(said) == 5, [r.getMessage() for r in records]


async def _batch_behind_one_in_flight(joining: str):
    """An IdBatches with ``["a"]`` in flight (its RPC 0.05 s), ``["b"]`` opening the next batch
    and one caller per letter of ``joining`` joined to it: (sent ids per RPC, batches, the
    tasks in flight, opener, joiners). Each RPC answers the ids it carried."""
    from tllm_core.vllm_bridge.request_marks import IdBatches

    sent: list[list[str]] = []

    async def ask(method, ids):
        sent.append(list(ids))
        await asyncio.sleep(0.05)
        return [{i: method for i in ids}]

    batches = IdBatches(ask, "tllm_mark_cut_short")
    first = asyncio.ensure_future(batches.call(["a"]))  # in flight
    await asyncio.sleep(0)
    opener = asyncio.ensure_future(batches.call(["b"]))  # opens the next batch, waits
    await asyncio.sleep(0)
    joiners = [asyncio.ensure_future(batches.call([x])) for x in joining]  # join it
    await asyncio.sleep(0)
    return sent, batches, first, opener, joiners


def test_a_batch_whose_opener_is_cancelled_is_still_sent_for_the_others():
    """The caller that opened the next batch is cancelled while it waits for the RPC in
    flight (its client gone): the batch is still sent, with its ids, and the callers that
    joined it get its answer; later ones get a batch of their own."""

    async def main():
        sent, batches, first, opener, (joiner,) = await _batch_behind_one_in_flight("c")
        opener.cancel()
        answer = [{"b": "tllm_mark_cut_short", "c": "tllm_mark_cut_short"}]
        assert await asyncio.wait_for(joiner, 5) == answer
        await asyncio.wait_for(first, 5)
        await asyncio.wait_for(batches.call(["d"]), 5)
        assert opener.cancelled()
        return sent

    assert asyncio.run(main()) == [["a"], ["b", "c"], ["d"]]


def test_a_cancelled_joiner_of_a_batch_leaves_the_batch_to_the_others():
    """A caller that joined the next batch is cancelled (a server stopping): the batch is
    still sent, with its ids, and every other caller of it returns once it is answered."""

    async def main():
        sent, _, first, opener, joiners = await _batch_behind_one_in_flight("cd")
        joiners[0].cancel()
        await asyncio.wait_for(asyncio.gather(first, opener, joiners[1]), 5)
        assert joiners[0].cancelled()
        return sent

    assert asyncio.run(main()) == [["a"], ["b", "c", "d"]]


def test_a_failed_batch_tells_every_caller_and_the_next_batch_is_sent():
    """An RPC that fails (the engine's error) raises in every caller of its batch; the batch
    opened meanwhile still goes, and no error is left unretrieved."""
    from tllm_core.vllm_bridge.request_marks import IdBatches

    sent: list[list[str]] = []

    async def ask(method, ids):
        sent.append(list(ids))
        await asyncio.sleep(0.02)
        if "a" in ids:
            raise RuntimeError("the engine failed")
        return ids

    async def main():
        batches = IdBatches(ask, "tllm_take_results")
        calls = [asyncio.ensure_future(batches.call(["a"]))]
        await asyncio.sleep(0)
        calls += [asyncio.ensure_future(batches.call([x])) for x in "bc"]
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5)

    got = asyncio.run(main())
    assert isinstance(got[0], RuntimeError) and got[1:] == [["b", "c"], ["b", "c"]]
    assert sent == [["a"], ["b", "c"]]


def test_an_abort_happens_though_its_caller_is_cancelled_at_every_await():
    """A streamed response whose client went away: anyio cancels the handler task again at
    each await until its scope exits, also inside vLLM's ``generate`` abort; the mark must not
    make the engine-core abort skippable (the request would run on to max_tokens)."""
    from types import SimpleNamespace

    from tllm_core.vllm_bridge.request_marks import install_abort_marks

    calls = []

    async def core_abort(ids):
        calls.append(("abort", list(ids)))

    async def abort(request_id, internal=False):  # AsyncLLM.abort
        await client.engine_core.abort_requests_async([request_id])

    async def ask(method, ids):  # the RPC to the workers takes a while
        await asyncio.sleep(0.05)
        calls.append((method, ids))

    async def generate():  # AsyncLLM.generate: its task cancelled, it aborts, then re-raises
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await client.abort("r-abcdefgh", internal=True)
            raise

    async def main():
        task = asyncio.ensure_future(generate())
        await asyncio.sleep(0.01)
        deadline = asyncio.get_running_loop().time() + 5
        while not task.done():  # anyio's cancel scope: a cancel at every await
            assert asyncio.get_running_loop().time() < deadline
            task.cancel()
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.2)  # the shielded mark and abort run on

    client = SimpleNamespace(engine_core=SimpleNamespace(abort_requests_async=core_abort))
    client.abort = abort
    install_abort_marks(client, ask)
    asyncio.run(main())
    assert calls == [("tllm_mark_cut_short", ["r-abcdefgh"]), ("abort", ["r-abcdefgh"])]

    # The engine-core abort fails after its caller was cancelled: said in one error line
    # (no caller is left to raise it to), not as asyncio's "never retrieved" at collection.
    async def failing_abort(ids):
        raise RuntimeError("engine core gone")

    client = SimpleNamespace(engine_core=SimpleNamespace(abort_requests_async=failing_abort))
    client.abort = abort
    install_abort_marks(client, ask)
    with _records("vllm.tllm") as records:
        asyncio.run(main())
    said = [r.getMessage() for r in records if r.levelname == "ERROR"]
    assert said == [
        "tllm: aborting requests ['r-abcdefgh'] failed: RuntimeError('engine core gone')"
    ]


def test_a_response_names_the_consumers_that_failed_on_its_requests(engine):
    client = _app(engine, None)
    marked = client.post("/v1/completions", json={"prompt": "x", "run": ["ok-1", "bad-2"]})
    assert marked.status_code == 200 and marked.headers["x-tllm-failed"] == "esamp"
    clean = client.post("/v1/completions", json={"prompt": "x", "run": ["ok-3"]})
    assert clean.status_code == 200 and "x-tllm-failed" not in clean.headers
    assert "x-tllm-failed" not in client.post("/v1/completions", json={"prompt": "x"}).headers
    # A stream: its headers left before its requests ran; an SSE comment before [DONE].
    streamed = client.post(
        "/v1/completions", json={"prompt": "x", "stream": True, "run": ["bad-4"]}
    )
    assert "x-tllm-failed" not in streamed.headers
    assert streamed.text.endswith('"b"}\n\n: tllm-failed esamp\n\ndata: [DONE]\n\n'), streamed.text
    clean = client.post("/v1/completions", json={"prompt": "x", "stream": True, "run": ["ok-5"]})
    assert "tllm-failed" not in clean.text and clean.text.endswith("data: [DONE]\n\n")
    # A caller id used again is a new request: its failed namesake does not mark it.
    again = client.post("/v1/completions", json={"prompt": "x", "run": ["bad-2"], "fail": []})
    assert again.status_code == 200 and "x-tllm-failed" not in again.headers


def test_responses_completing_together_share_one_read_of_the_failures(engine):
    """16 answers at once: the workers are asked once at a time, not once per response,
    and each response is still marked from a read that began after it was complete."""
    import httpx

    client = _app(engine, None)
    fake = type(client.app.state.tllm_engine_client)

    async def burst():
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            bodies = [
                {"prompt": "x", "run": [f"{'bad' if i % 4 == 0 else 'ok'}-{i}"]} for i in range(16)
            ]
            return await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))

    answers = asyncio.run(burst())
    marked = [i for i, r in enumerate(answers) if r.headers.get("x-tllm-failed") == "esamp"]
    assert marked == [0, 4, 8, 12]
    assert 1 <= fake.failure_reads < 16, fake.failure_reads


def test_a_served_requests_keys_are_validated_once_in_the_api_server(engine, monkeypatch):
    """XargsCheck validates the body of the OpenAI routes; the input processor's check (which
    vLLM runs in the same request) then skips them, and checks only what the body check did
    not see (another route), refusing a bad value there."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.exceptions import VLLMValidationError

    from tllm_core.vllm_bridge import serving

    calls = []
    real = serving.validate_extra_args
    monkeypatch.setattr(
        serving, "validate_extra_args", lambda x, s: (calls.append(dict(x)), real(x, s))
    )
    processor = SimpleNamespace(assign_request_id=lambda request: None)
    serving.install_request_checks(processor, engine, b"k" * 32)
    app = FastAPI()
    app.add_middleware(serving.XargsCheck, server=engine)

    def admit(body):  # what vLLM's add_request does with the request's vllm_xargs
        params = SimpleNamespace(extra_args=dict(body["vllm_xargs"]), n=1)
        request = SimpleNamespace(sampling_params=params, cache_salt=None, request_id="r")
        try:
            processor.assign_request_id(request)
        except VLLMValidationError as e:
            return {"error": str(e)}
        return {"ok": True}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return admit(await request.json())

    @app.post("/v1/other")
    async def other(request: Request):
        return admit(await request.json())

    client = TestClient(app)
    good = {"prompt": "x", "vllm_xargs": {"tllm_consumers": "esamp", "tllm_esamp_beta": 0.5}}
    assert client.post("/v1/completions", json=good).json() == {"ok": True}
    assert len(calls) == 1  # the body check's; the input processor skipped it
    assert client.post("/v1/other", json=good).json() == {"ok": True}
    assert len(calls) == 2  # not a checked route: the input processor's
    bad = {"prompt": "x", "vllm_xargs": {"tllm_consumers": "esamp", "tllm_esamp_beta": "x"}}
    assert "tllm_esamp_beta" in client.post("/v1/other", json=bad).json()["error"]
    assert client.post("/v1/completions", json=bad).status_code == 400


def test_server_start_waits_for_the_engine_a_bounded_time_naming_the_call(engine):
    """At start the server asks every engine for tllm's status: an engine that never answers
    stops the start after engine_answer_s with the call's name, instead of hanging it."""
    from types import SimpleNamespace

    from tllm_core.vllm_bridge import nodes
    from tllm_core.vllm_bridge.request_marks import EngineNoAnswer
    from tllm_core.vllm_bridge.serving import init_state

    class Silent:
        vllm_config = SimpleNamespace(
            additional_config={"tllm": {"server": {"engine_answer_s": 0.2}}},
            model_config=SimpleNamespace(get_hidden_size=lambda: 8),
            parallel_config=SimpleNamespace(data_parallel_size=1),
        )
        input_processor = SimpleNamespace(assign_request_id=lambda request: None)
        engine_core = SimpleNamespace(abort_requests_async=None)
        abort = None

        async def collective_rpc(self, method, args=()):
            await asyncio.Event().wait()  # bounded: the start's timeout cancels it

    async def start():
        state = SimpleNamespace()
        try:
            await init_state(Silent(), state, engine, nodes.NodeWatch())
        finally:
            state.tllm_http_close.cancel()

    with pytest.raises(EngineNoAnswer, match=r"did not answer 'tllm_status' in 0.2 s"):
        asyncio.run(asyncio.wait_for(start(), 60))  # 60 s: the test's own bound


@pytest.mark.parametrize(
    ("nnodes", "dp_local", "check_s", "bound"),
    [(1, 2, "5", None), (2, 2, "5", 30.0 + 7.0 + 5.0), (2, 2, "0", None), (1, 1, "5", None)],
)
def test_tllm_calls_to_an_engine_across_nodes_are_bounded_in_the_engine(
    engine, monkeypatch, nnodes, dp_local, check_s, bound
):
    """TP/PP across nodes, node check on: every tllm call carries the engine core's own bound
    (the check's barrier bound + 5 s), so a hung node's rank cannot hold the core; a one-node
    engine, one whose node check is off, or data-parallel engines on other nodes (each core
    on its own node: hung with it) keep vLLM's unbounded wait."""
    from types import SimpleNamespace

    from tllm_core.vllm_bridge import nodes, serving
    from tllm_core.vllm_bridge.request_marks import EngineNoAnswer

    monkeypatch.setenv(nodes.NODE_CHECK_ENV, check_s)
    timeouts = []

    class Client:
        vllm_config = SimpleNamespace(
            additional_config={
                "tllm": {"callback_deadline_s": 7.0, "server": {"engine_answer_s": 0.2}}
            },
            model_config=SimpleNamespace(get_hidden_size=lambda: 8),
            parallel_config=SimpleNamespace(
                data_parallel_size=2, data_parallel_size_local=dp_local, nnodes=nnodes
            ),
        )
        input_processor = SimpleNamespace(assign_request_id=lambda request: None)
        abort = None

        class engine_core:  # a data-parallel client: two engine cores
            abort_requests_async = None
            core_engines = [b"e0", b"e1"]

            def get_core_engine_for_request(self, request):
                return b"e0"

            async def call_utility_all_async(self, method, rpc, timeout, args, kwargs):
                timeouts.append(timeout)
                await asyncio.Event().wait()  # bounded: the start's timeout cancels it

        engine_core = engine_core()

    async def start():
        state = SimpleNamespace()
        try:
            await serving.init_state(Client(), state, engine, nodes.NodeWatch())
        finally:
            state.tllm_http_close.cancel()

    # The first call: tllm_join_leader to engines on other nodes, else tllm_status.
    with pytest.raises(EngineNoAnswer, match="tllm_join_leader" if dp_local < 2 else "tllm_status"):
        asyncio.run(asyncio.wait_for(start(), 60))  # 60 s: the test's own bound
    assert timeouts == [bound]


@pytest.fixture(scope="module")
def steer_engine() -> EngineConsumers:
    return EngineConsumers.from_settings(
        {
            "consumers": [
                {"name": "esamp", "per_request": True},
                {"name": "steer", "per_request": True, "config": {"open_layers": [1]}},
            ]
        }
    )


def test_hostile_control_bodies_get_a_short_4xx_and_the_server_serves_on(steer_engine):
    """A control body nested past the parser was a 500 (RecursionError escaped the route);
    huge names and actions were echoed whole. Each gets a 4xx naming what is allowed, in a
    message of bounded size, and the routes keep answering."""
    client = _app(steer_engine, ["k"])
    auth = {"Authorization": "Bearer k"}
    route = "/tllm/consumers/steer/control"

    def post(body: bytes, path: str = route):
        return client.post(path, content=body, headers=auth)

    nested = post(b"[" * 100_000 + b"]" * 100_000)
    assert nested.status_code == 400 and "not JSON" in nested.json()["error"], nested.text
    inner = post(b'{"action": "add", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    assert inner.status_code == 400, inner.text
    huge = "x" * 100_000
    for got, status, allowed in [
        (post(b'{"action": "list"}', f"/tllm/consumers/{huge[:5000]}/control"), 404, "steer"),
        (post(json.dumps({"action": huge}).encode()), 400, "list, add, remove"),
        (post(json.dumps({"action": "remove", "name": huge}).encode()), 404, "no steering"),
    ]:
        message = got.json()["error"]
        assert got.status_code == status and allowed in message and len(message) < 400, message
    assert post(b'{"action": "list"}').status_code == 200
    assert client.get("/tllm/status", headers=auth).status_code == 200


def test_escaped_tllm_keys_are_checked_in_the_body(steer_engine):
    """A key written with a JSON escape ("\\u0074llm_consumers") is the same key to vLLM's
    parser: it was let through unchecked (a stream then got a 200 with an error event, a
    request naming a failed consumer was served without it)."""
    body = json.dumps({"prompt": "p", "stream": True, "vllm_xargs": {"tllm_consumers": "nope"}})
    body = body.replace("tllm_consumers", "\\u0074llm_consumers").encode()
    assert b"tllm_" not in body
    app = FakeApp()
    status, answer = _call(XargsCheck(app, steer_engine), Chunks([body]))
    message = json.loads(answer)["error"]["message"]
    assert status == 400 and app.calls == 0 and "unknown consumer 'nope'" in message, message
    # A request naming a huge unknown steering vector: the name is quoted short.
    named = {"tllm_consumers": "steer", "tllm_steer_vectors": "v" * 60_000}
    status, answer = _call(XargsCheck(FakeApp(), steer_engine), Chunks([_json(named)]))
    message = json.loads(answer)["error"]["message"]
    assert status == 400 and "no steering vector named" in message and len(message) < 400


def _json(xargs: dict) -> bytes:
    return json.dumps({"prompt": "p", "vllm_xargs": xargs}).encode()


def test_a_huge_value_is_refused_before_its_consumer_parses_it(steer_engine):
    """A 32 MiB ``tllm_steer_vectors`` of distinct names was split into a dict of millions of
    entries before its 256-entry bound refused it: seconds of the server's event loop (every
    client waits) and most of a GiB. Every tllm value is bounded by its length first."""
    from tllm_core.serving import validate_extra_args
    from tllm_core.serving.keys import MAX_VALUE_CHARS

    names = ",".join(f"v{i}" for i in range(MAX_VALUE_CHARS // 4))
    assert len(names) > MAX_VALUE_CHARS
    with pytest.raises(
        ValueError,
        match=rf"tllm_steer_vectors'\] has \d+ characters; allowed: at most {MAX_VALUE_CHARS}",
    ):
        validate_extra_args({"tllm_consumers": "steer", "tllm_steer_vectors": names}, steer_engine)
    short = {"tllm_consumers": "steer", "tllm_steer_vectors": names[:4000]}
    with pytest.raises(ValueError, match="at most 256 entries"):  # the entry bound still holds
        validate_extra_args(short, steer_engine)

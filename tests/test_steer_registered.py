"""Vectors registered on a running server (issue 45 item 4): ``POST
/tllm/consumers/steer/control`` with ``add`` / ``remove`` / ``list``, authenticated, checked as
config vectors are, bounded in count and bytes, listed in ``/tllm/status``, usable by name at
once (and only by requests that name them), kept across a restart with ``keep_dir``. The
routes run on FastAPI's test client; the engine's side is a real ``SteerConsumer`` behind a
fake engine client (``tests/test_steer_unit.py``'s model context)."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import threading
import time
import tracemalloc
from typing import Any

import numpy as np
import pytest
import torch
from test_steer_unit import H, context, make_rows, request

from consumers.steer.consumer import SteerConfig, SteerConsumer
from tllm_core.api.consumer_spec import ConsumerSpec
from tllm_core.api.edits import EditPlan
from tllm_core.plugins.registry import Registry
from tllm_core.serving.keys import EngineConsumers, request_salt, validate_extra_args

KEY = "sekret"
URL = "/tllm/consumers/steer/control"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _server(
    cfg: dict,
    api_key: str | None = KEY,
    fault_file: str | None = None,
    settings: Any = None,
    control_wait: Any = None,
):
    """``control_wait``: awaited by the engine before it applies each control call."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from tllm_core.vllm_bridge.serving import attach_routes

    reg = Registry()
    spec = ConsumerSpec(name="steer", config=cfg, per_request=True)
    engine = EngineConsumers.of([spec], reg.check([spec]), reg)
    consumer = SteerConsumer(engine.configs["steer"], context(per_request=True))

    class Engine:  # the workers' side of tllm_control, on the real consumer
        async def collective_rpc(self, method, args=()):
            if method == "tllm_status":
                return [{"installed": True, "rank": {"leader": True}}]
            if method == "tllm_collect":
                return [{"runtime": {}, "consumers": {}, "results": {}, "errors": []}]
            assert method == "tllm_control", method
            if control_wait is not None:
                await control_wait()
            from tllm_core.api.consumer import ControlError

            name, action, payload = args
            try:
                return [{"reply": consumer.control(action, payload)}]
            except ControlError as e:
                return [{"error": str(e), "status": e.status}]

    app = FastAPI()
    app.state.args = SimpleNamespace(api_key=api_key)
    attach_routes(app, engine, settings, fault_file=fault_file)
    app.state.tllm_engine_client = Engine()
    return TestClient(app), engine, consumer


def _steered(consumer: SteerConsumer, **extra) -> dict:
    """What the consumer plans for one request's 2 decode rows: {layer: add vector}."""
    req = request(0, 3, tllm_consumers="steer", **extra)
    rows = make_rows([(req, [3, 4])])
    plan = EditPlan(rows, {"layer.1": "residual.1"}, H)
    consumer.edit(rows, plan)
    consumer.on_request_finished(req)  # each call is a new request
    return plan.ops


def test_a_registered_vector_is_used_by_the_next_request_that_names_it():
    client, engine, consumer = _server({"vectors": [], "open_layers": [1]})
    v = torch.randn(H).tolist()
    r = client.post(
        URL, json={"action": "add", "name": "calm", "layer": 1, "vector": v}, headers=AUTH
    )
    assert r.status_code == 200 and r.json()["reply"] == {"added": "calm"}, r.text
    listed = client.get("/tllm/status", headers=AUTH).json()["controls"]["steer"]
    assert [(x["name"], x["registered"]) for x in listed] == [("calm", True)]
    # the front end now accepts the name, and the engine steers the rows that name it
    validate_extra_args({"tllm_consumers": "steer", "tllm_steer_vectors": "calm=2"}, engine)
    ops = _steered(consumer, tllm_steer_vectors="calm=2")
    (rows, kind, value) = ops["layer.1"][0]
    assert kind == "add" and rows.tolist() == [0, 1]
    torch.testing.assert_close(value, 2 * torch.tensor(v))
    assert _steered(consumer) == {}  # a request that does not name it is not steered
    with pytest.raises(ValueError, match="no steering vector named 'happy'.*calm") as said:
        validate_extra_args({"tllm_consumers": "steer", "tllm_steer_vectors": "happy"}, engine)
    assert "Value error" not in str(said.value)  # the validator's words, not pydantic's
    with pytest.raises(ValueError, match=r"got 'big' \(allowed: 'NAME\[=SCALE\],\.\.\.'"):
        validate_extra_args({"tllm_consumers": "steer", "tllm_steer_vectors": "calm=big"}, engine)
    named = {"tllm_consumers": "steer", "tllm_steer_vectors": "calm=2"}
    salt = request_salt(named, b"k" * 32, server=engine)
    r = client.post(URL, json={"action": "remove", "name": "calm"}, headers=AUTH)
    assert r.status_code == 200 and r.json()["reply"] == {"removed": "calm"}
    with pytest.raises(ValueError, match="no steering vector named 'calm'"):
        validate_extra_args({"tllm_consumers": "steer", "tllm_steer_vectors": "calm"}, engine)
    assert _steered(consumer, tllm_steer_vectors="") == {}
    # Another "calm": the prefix cache of requests that named the first one is not theirs.
    w = torch.randn(H).tolist()
    body = {"action": "add", "name": "calm", "layer": 1, "vector": w}
    assert client.post(URL, json=body, headers=AUTH).status_code == 200
    assert request_salt(named, b"k" * 32, server=engine) != salt
    other = {"tllm_esamp_beta": 0.5}  # no key of a consumer whose config changed
    assert request_salt(other, b"k" * 32, server=engine) == request_salt(other, b"k" * 32)
    # steer on every request (not per-request): a control changes what it does to requests
    # without keys too; each change gives them a new salt (a new prefix-cache namespace).
    engine.per_request["steer"] = False
    plain = request_salt({}, b"k" * 32, server=engine)
    assert plain is not None and request_salt({}, b"k" * 32) is None
    assert request_salt({"x": 1}, b"k" * 32, server=engine) == plain  # not a tllm key
    engine.control_applied("steer", engine.configs["steer"])
    assert request_salt({}, b"k" * 32, server=engine) not in (None, plain)


def test_a_request_admitted_before_its_vector_was_removed_is_only_itself_unsteered():
    """A request that named a vector, admitted, then the vector removed before its first
    step: that request runs unsteered (counted), the batch's others steered, steer stays on."""
    client, engine, consumer = _server({"vectors": [], "open_layers": [1]})
    for name in ("calm", "keep"):
        body = {"action": "add", "name": name, "layer": 1, "vector": [1.0] * H}
        assert client.post(URL, json=body, headers=AUTH).status_code == 200
    gone = request(0, 3, tllm_consumers="steer", tllm_steer_vectors="calm")
    kept = request(1, 3, tllm_consumers="steer", tllm_steer_vectors="keep")
    assert client.post(URL, json={"action": "remove", "name": "calm"}, headers=AUTH).is_success
    rows = make_rows([(gone, [3]), (kept, [3])])
    plan = EditPlan(rows, {"layer.1": "residual.1"}, H)
    consumer.edit(rows, plan)  # raised before: every request of the step lost its steering
    assert [r.tolist() for r, _, _ in plan.ops["layer.1"]] == [[1]]
    assert consumer.counters.get("invalid_request_settings") == 1


def test_registration_is_refused_when_unauthenticated_malformed_or_too_large():
    cfg = {"vectors": [{"name": "base", "layer": 1, "vector": [1.0] * H}], "max_registered": 2}
    client, engine, consumer = _server({**cfg, "max_registered_mib": 0.0001})
    good = {"action": "add", "name": "a", "layer": 1, "vector": [0.5] * H}
    assert client.post(URL, json=good).status_code == 401
    assert client.post(URL, json=good, headers={"Authorization": "Bearer nope"}).status_code == 401
    open_client, *_ = _server(cfg, api_key=None)
    r = open_client.post(URL, json=good)
    assert r.status_code == 403 and "--api-key" in r.json()["error"]
    cases = [
        (b"{not json", 400, "not JSON"),
        (b"[1, 2]", 400, '"action"'),
        ({"action": "fly"}, 400, "unknown action 'fly'"),
        (b'{"action": "add", "name": "a", "layer": 1, "vector": [NaN]}', 400, "finite"),
        ({**good, "vector": [1.0] * (H + 1)}, 400, "size 8"),
        ({**good, "layer": 2}, 400, "layer 2 is not open.*1"),
        ({**good, "mode": "clamp"}, 400, "'add' or 'ablate'"),
        ({**good, "name": "base"}, 409, "exists"),
        ({**good, "name": "bad name!"}, 400, "invalid vector"),
        ({**good, "colour": 1}, 400, "unknown field"),
        ({"action": "remove", "name": "base"}, 409, "configured at start"),
        ({"action": "remove", "name": "zzz"}, 404, "no steering vector"),
        ({**good, "vector": [0.5] * 40}, 413, "MiB"),
    ]
    for body, status, text in cases:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = client.post(URL, headers=AUTH, **kw)
        assert r.status_code == status, (body, r.text)
        assert re.search(text, r.json()["error"]), (body, r.text)
    assert [v.entry.name for v in consumer.vectors] == ["base"]  # nothing half-registered
    assert [v.name for v in engine.configs["steer"].vectors] == ["base"]
    client2, _, _ = _server({**cfg, "max_registered": 1})
    assert client2.post(URL, json=good, headers=AUTH).status_code == 200
    r = client2.post(URL, json={**good, "name": "b"}, headers=AUTH)
    assert r.status_code == 413 and "at most 1" in r.json()["error"]


def test_memory_stays_bounded_over_many_add_remove_cycles():
    client, engine, consumer = _server({"vectors": [], "open_layers": [1]})
    body = {"action": "add", "name": "v", "layer": 1, "vector": np.ones(H).tolist()}

    def cycle(k: int) -> None:
        for _ in range(k):
            assert client.post(URL, json=body, headers=AUTH).status_code == 200
            _steered(consumer, tllm_steer_vectors="v")
            rm = client.post(URL, json={"action": "remove", "name": "v"}, headers=AUTH)
            assert rm.status_code == 200

    cycle(50)  # warm caches
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    cycle(300)
    gc.collect()
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    assert consumer.vectors == [] and engine.configs["steer"].vectors == []
    # ~30 KiB here whatever the count (caches): a leak of 170+ bytes a cycle is past it.
    assert grown < 80 * 1024, f"{grown} bytes more after 300 cycles"


def test_kept_vectors_come_back_after_a_restart(tmp_path):
    cfg = {"vectors": [], "open_layers": [1], "keep_dir": str(tmp_path / "kept")}
    client, _, _ = _server(cfg)
    v = torch.randn(H).tolist()
    body = {"action": "add", "name": "calm", "layer": 1, "vector": v, "scale": 3.0}
    assert client.post(URL, json=body, headers=AUTH).status_code == 200
    config = SteerConfig(**cfg)  # a restart validates the same config: the folder's vectors
    assert [(x.name, x.layer, x.scale, x.registered) for x in config.vectors] == [
        ("calm", 1, 3.0, True)
    ]
    again = SteerConsumer(config, context(per_request=True))
    torch.testing.assert_close(again.vectors[0].vector, torch.tensor(v))
    client2, _, _ = _server(cfg)
    assert (
        client2.post(URL, json={"action": "remove", "name": "calm"}, headers=AUTH).status_code
        == 200
    )
    assert SteerConfig(**cfg).vectors == []
    assert SteerConfig(**{**cfg, "keep_dir": None}).vectors == []  # without it: forgotten


def test_a_control_request_is_refused_at_once_while_a_callback_hangs(tmp_path):
    """The engine is stuck in a consumer callback: no RPC would answer, so the route says so
    (503) instead of waiting for the engine to stop itself."""
    import json

    note = tmp_path / "fault.json"
    client, _, consumer = _server({"vectors": [], "open_layers": [1]}, fault_file=str(note))
    body = {"action": "add", "name": "calm", "layer": 1, "vector": [1.0] * H}
    hung = {"consumer": "x", "callback": "guide", "kind": "step", "deadline_s": 1.0}
    note.write_text(json.dumps({**hung, "seconds": 2.0, "thread": "t", "stack": ""}))
    r = client.post(URL, json=body, headers=AUTH)
    assert r.status_code == 503 and "hung" in r.json()["error"], r.text
    assert consumer.vectors == []
    note.write_text("")
    assert client.post(URL, json=body, headers=AUTH).status_code == 200


def _add(name: str) -> dict:
    return {"action": "add", "name": name, "layer": 1, "vector": [1.0] * H}


def _until(answer: threading.Event) -> Any:
    """The fake engine's wait before it applies a control call: until the test sets ``answer``."""

    async def wait() -> None:
        for _ in range(3000):  # bounded: 30 s
            if answer.is_set():
                return
            await asyncio.sleep(0.01)
        raise TimeoutError("the test never let the engine answer")

    return wait


def _late_controls(client) -> dict:
    body = client.get("/tllm/status", headers=AUTH).json()
    return {k: body[k] for k in ("controls_pending", "controls_unconfirmed")}


def test_a_control_answered_after_its_504_is_adopted_before_the_next_one(monkeypatch):
    """The engine applies a control call after the route gave up (504): the front end adopts
    its config when the answer comes, and refuses later control calls until then (503), so
    that it never checks requests against a config the engine no longer has."""
    from tllm_core.runtime.settings import ServerSettings
    from tllm_core.vllm_bridge import serving

    # The late answer is waited for 30 s: a loaded machine does not end the wait mid-test.
    monkeypatch.setattr(serving, "LATE_CONTROL_FACTOR", 100)
    answer = threading.Event()  # set by the test: the engine may answer
    until_answer = _until(answer)
    client, engine, consumer = _server(
        {"vectors": [], "open_layers": [1]},
        settings=ServerSettings(engine_answer_s=0.3),
        control_wait=until_answer,
    )
    with client:  # one event loop for all requests: the late answer arrives between them
        r = client.post(URL, json=_add("calm"), headers=AUTH)
        assert r.status_code == 504 and "then so does the server" in r.json()["error"], r.text
        assert _late_controls(client) == {
            "controls_pending": {"steer": "add"},
            "controls_unconfirmed": {},
        }
        r = client.post(URL, json=_add("happy"), headers=AUTH)
        assert r.status_code == 503 and "(steer add) still waits" in r.json()["error"], r.text
        answer.set()
        deadline = time.monotonic() + 10
        while _late_controls(client)["controls_pending"]:
            assert time.monotonic() < deadline, "the late control answer was never adopted"
            time.sleep(0.05)
        assert [v.entry.name for v in consumer.vectors] == ["calm"]  # the engine applied it
        validate_extra_args({"tllm_consumers": "steer", "tllm_steer_vectors": "calm"}, engine)
        added = client.post(URL, json=_add("happy"), headers=AUTH)
        assert added.status_code == 200 and "warning" not in added.json()  # confirmed: no doubt
        listed = client.get("/tllm/status", headers=AUTH).json()["controls"]["steer"]
        assert [x["name"] for x in listed] == ["calm", "happy"]
        assert _late_controls(client)["controls_unconfirmed"] == {}


def test_a_control_the_engine_never_answers_is_shown_unconfirmed_and_frees_the_route():
    """A control call never answered is listed unconfirmed and frees the route; every later
    control answer about that consumer warns, naming the action (it was a plain 200 before,
    from a front-end config that may differ from the engine's)."""
    from tllm_core.runtime.settings import ServerSettings

    async def never():  # until the route's late wait cancels it
        await asyncio.wait_for(asyncio.Event().wait(), 60)
        raise TimeoutError("the route never gave up on a control call the engine did not answer")

    client, engine, consumer = _server(
        {"vectors": [], "open_layers": [1]},
        settings=ServerSettings(engine_answer_s=0.05),
        control_wait=never,
    )
    with client:
        assert client.post(URL, json=_add("calm"), headers=AUTH).status_code == 504
        deadline = time.monotonic() + 10
        while _late_controls(client)["controls_pending"]:
            assert time.monotonic() < deadline, "the late wait never ended"
            time.sleep(0.05)
        assert _late_controls(client)["controls_unconfirmed"] == {"steer": "add"}
        # Later answers about steer rest on a config the engine may not share: each says so.
        listed = client.post(URL, json={"action": "list"}, headers=AUTH)
        assert listed.status_code == 200 and listed.json()["reply"] == []
        assert "earlier 'add' request to 'steer' was never answered" in listed.json()["warning"]
        refused = client.post(URL, json={"action": "fly"}, headers=AUTH)
        assert refused.status_code == 400 and "never answered" in refused.json()["warning"]
        # the lock is free again: the next call reaches the engine (and times out in turn)
        timed_out = client.post(URL, json=_add("happy"), headers=AUTH)
        assert timed_out.status_code == 504 and "never answered" in timed_out.json()["warning"]
        while _late_controls(client)["controls_pending"]:  # its late wait ends before the loop
            assert time.monotonic() < deadline + 10, "the second late wait never ended"
            time.sleep(0.05)
    with pytest.raises(ValueError, match="no steering vector named 'calm'"):
        validate_extra_args({"tllm_consumers": "steer", "tllm_steer_vectors": "calm"}, engine)


def test_a_control_route_cancelled_after_sending_still_adopts_the_engines_answer():
    """The route's task is cancelled (a middleware, the server's shutdown) after the call went
    to the engine: the engine may still apply it, so the front end waits for its answer too."""
    from fastapi import Request

    from tllm_core.runtime.settings import ServerSettings

    answer = threading.Event()
    until_answer = _until(answer)
    client, engine, consumer = _server(
        {"vectors": [], "open_layers": [1]},
        settings=ServerSettings(engine_answer_s=30),
        control_wait=until_answer,
    )
    from tllm_core.vllm_bridge.serving import CONTROL_PATH

    route = next(r for r in client.app.routes if getattr(r, "path", "") == CONTROL_PATH)

    async def scenario():
        body = json.dumps(_add("calm")).encode()

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {"type": "http", "method": "POST", "path": URL, "headers": [], "app": client.app}
        call = asyncio.ensure_future(route.endpoint("steer", Request(scope, receive)))
        await asyncio.sleep(0.3)  # the call has reached the engine
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert engine.configs["steer"].vectors == []
        answer.set()
        for _ in range(600):  # bounded: 30 s
            if [v.name for v in engine.configs["steer"].vectors] == ["calm"]:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the cancelled route's call was never adopted")

    asyncio.run(scenario())
    assert [v.entry.name for v in consumer.vectors] == ["calm"]

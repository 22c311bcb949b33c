"""A consumer callback has a deadline (issue 46, item 2): the watchdog names the consumer, the
callback and its stack; the engine stops for a hung engine-thread, close or result callback
(the front end reads why from the note), and a hung background consumer is switched off, its
queue dropped, while the engine goes on. Runs the engine's runtime through the consumer kit on
a tiny model (no vLLM); the process exit is a fake that records the status and ends the hang."""

from __future__ import annotations

import threading
import time

import pytest
from tllm_test_recorder import Hang

from tllm_core.runtime.watchdog import (
    HUNG_EXIT_CODE,
    STEP,
    EngineStop,
    Hung,
    Watchdog,
    read_note,
)
from tllm_core.testing import ConsumerKit

DEADLINE_S = 1.0
BOUND_S = 30.0  # a hang the watchdog missed would exceed it


def test_watchdog_reports_a_late_callback_once_with_its_stack():
    seen: list[Hung] = []
    dog = Watchdog({STEP: 0.2}, seen.append)
    gate = threading.Event()

    def slow_callback() -> None:
        gate.wait(BOUND_S)

    def run() -> None:
        with dog.watching("sleepy", "on_bundle", STEP):
            slow_callback()

    t = threading.Thread(target=run, name="engine-thread")
    t.start()
    deadline = time.monotonic() + BOUND_S
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # more checks: still one report
    gate.set()
    t.join(BOUND_S)
    dog.close()
    assert len(seen) == 1, seen
    h = seen[0]
    assert (h.consumer, h.callback, h.kind, h.thread) == (
        "sleepy",
        "on_bundle",
        STEP,
        "engine-thread",
    )
    assert "slow_callback" in h.stack and h.seconds > 0.2
    assert "consumer 'sleepy' is stuck in on_bundle" in h.message()
    assert not dog._calls  # returned: no longer watched


class _Exit:
    """Stands in for os._exit: records the status and ends the hang (as a dead process would
    end it)."""

    def __init__(self, kit: ConsumerKit):
        self.kit = kit
        self.codes: list[int] = []
        self.called = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.called.set()
        self.kit.consumer("hang").release.set()


def _kit(tiny_model, tmp_path, **config) -> tuple[ConsumerKit, _Exit]:
    settings = {
        "callback_deadline_s": DEADLINE_S,
        "background_deadline_s": DEADLINE_S,
        "close_deadline_s": DEADLINE_S,
        "fault_file": str(tmp_path / "fault.json"),
    }
    kit = ConsumerKit(
        tiny_model,
        [(Hang, {"after": 1, "seconds": 8.0, **config})],
        settings=settings,
        raise_on_disabled=False,
    )
    stop = _Exit(kit)
    kit.runtime._engine_stop = EngineStop(0.0, exit=stop)
    return kit, stop


@pytest.mark.parametrize(
    "callback", ["edit", "guide", "on_bundle", "on_request_finished", "close", "result"]
)
def test_a_hung_callback_is_named_and_stops_the_engine(tiny_model, tmp_path, callback):
    kit, stop = _kit(tiny_model, tmp_path, callback=callback)
    t0 = time.monotonic()
    kit.generate(["a b c"], max_tokens=3)
    if callback == "result":
        kit.collect()
    kit.close()
    assert stop.codes == [HUNG_EXIT_CODE], f"the engine was not stopped ({callback})"
    assert time.monotonic() - t0 < BOUND_S
    hung = read_note(str(tmp_path / "fault.json"))
    assert hung is not None, "no note for the front end"
    assert (hung.consumer, hung.callback) == ("hang", callback)
    assert "_maybe_hang" in hung.stack  # where it is stuck
    report = kit.runtime.close()
    assert any(e["consumer"] == "hang" and e["where"] == callback for e in report["errors"])
    assert report["runtime"]["callbacks_hung.hang"] == 1


def test_a_hung_background_consumer_is_switched_off_and_the_engine_goes_on(tiny_model, tmp_path):
    kit, stop = _kit(tiny_model, tmp_path, callback="on_bundle", background=True)
    t0 = time.monotonic()
    kit.generate(["a b c", "d e"], max_tokens=4)
    deadline = time.monotonic() + BOUND_S
    while not kit.runtime.bus.abandoned("hang") and time.monotonic() < deadline:
        time.sleep(0.05)
    kit.generate(["f g"], max_tokens=3)  # the engine goes on without it
    report = kit.close()
    assert time.monotonic() - t0 < BOUND_S
    assert not stop.codes, "a background hang must not stop the engine"
    rt = report["runtime"]
    assert rt["consumers_abandoned"] == 1
    assert rt["bundles_abandoned.hang"] >= 1  # the queue, dropped and counted
    err = next(e for e in report["errors"] if e["where"] == "watchdog")
    assert err["disabled"] and "dropped" in err["error"] and "_maybe_hang" in err["error"]
    assert rt.get("flush_timeouts", 0) == 0 and rt.get("close_timeouts", 0) == 0
    kit.consumer("hang").release.set()


def test_engine_stop_waits_its_delay(tmp_path):
    codes: list[int] = []
    stop = EngineStop(0.3, exit=codes.append)
    stop.schedule(Hung("c", "guide", STEP, 1.0, 2.0, "t", ""))
    time.sleep(0.1)
    assert codes == []  # a server drains first
    deadline = time.monotonic() + BOUND_S
    while not codes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert codes == [HUNG_EXIT_CODE]


# -- the server: /health fails, /tllm/status names it -------------------------------------------
def test_health_fails_and_status_names_a_hung_consumer(tmp_path):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from tllm_core.runtime.watchdog import write_note
    from tllm_core.serving import EngineConsumers
    from tllm_core.vllm_bridge.serving import attach_routes

    note = tmp_path / "fault.json"
    note.write_text("")
    engine = EngineConsumers.from_settings({"consumers": [{"name": "stats"}]})
    app = FastAPI()
    attach_routes(app, engine, None, str(note))

    @app.get("/health")
    async def health():  # vLLM's own route
        return {}

    client = TestClient(app)
    assert client.get("/health").status_code == 200
    stack = '  File "/srv/plugins/hang.py", line 9, in on_bundle\n    time.sleep(600)\n'
    write_note(str(note), Hung("hang", "on_bundle", STEP, 120.0, 130.0, "MainThread", stack))
    r = client.get("/health")
    assert r.status_code == 503
    assert "consumer 'hang' is stuck in on_bundle" in r.json()["error"]
    assert "/srv" not in r.text  # /health answers strangers: no server path
    s = client.get("/tllm/status")
    assert s.status_code == 503
    hung = s.json()["hung"]
    assert (hung["consumer"], hung["callback"]) == ("hang", "on_bundle")
    # what the front end knows without the engine: control actions still unanswered
    assert s.json()["controls_pending"] == {} and s.json()["controls_unconfirmed"] == {}
    assert "/srv" not in s.text and hung["where"].endswith(":9 in on_bundle")  # path hidden

"""The bus never leaves the engine thread waiting without bound (issue 26): finish notices
never wait on a full queue, a background thread survives any error, flush and close time
out, and a failed consumer is still closed."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tllm_core import Bundle, Consumer, ConsumerConfig
from tllm_core.api.counters import Counters
from tllm_core.api.ports import Delivery
from tllm_core.api.rows import RequestInfo, RowInfo
from tllm_core.runtime.bus import Bus
from tllm_core.runtime.settings import RuntimeSettings

# Generous bounds for "returned at all" on a busy machine; a hang would exceed them.
HANG_S = 20


def _rows(n: int) -> RowInfo:
    req = RequestInfo("0-abcdefgh", "0", 0, 0, 4)
    return RowInfo(
        row=np.arange(n),
        requests=[req] * n,
        position=np.arange(n),
        is_decode=np.zeros(n, bool),
        recomputed=np.zeros(n, bool),
        token_ids=torch.arange(n),
    )


class Gated(Consumer):
    """A background consumer that handles nothing until its gate opens."""

    name = "gated"
    delivery = Delivery.BACKGROUND

    def __init__(self):
        super().__init__(ConsumerConfig(), None)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.got: list[object] = []

    def on_bundle(self, bundle):
        self.entered.set()
        self.gate.wait(HANG_S)
        self.got.append(bundle.step)

    def on_request_finished(self, request):
        self.got.append(request.engine_id)

    def on_bundle_dropped(self, step, requests):
        self.got.append(f"dropped {step}")


def _returns(fn, *args) -> bool:
    """Whether ``fn(*args)`` returns within HANG_S seconds (run on a side thread)."""
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    t.join(HANG_S)
    return not t.is_alive()


@pytest.mark.parametrize("overflow", ["drop", "block"])
def test_finish_notices_never_wait_on_a_full_queue(overflow):
    counters = Counters()
    bus = Bus(counters, RuntimeSettings(queue_size=1, overflow=overflow))
    c = Gated()
    bus.publish(c, Bundle(0, _rows(1)))
    assert c.entered.wait(HANG_S)  # taken by the thread, which waits at the gate
    bus.publish(c, Bundle(1, _rows(1)))  # fills the one slot
    done = [RequestInfo(f"r{i}-abcdefgh", f"r{i}", 0, 0, 4) for i in range(3)]
    assert _returns(lambda: [bus.finished(c, r) for r in done])  # the engine is not held
    c.gate.set()
    assert bus.flush(HANG_S)
    bus.close()
    # In order: the request's bundles first, then its notices; nothing dropped.
    assert c.got == [0, 1, *(r.engine_id for r in done)]
    assert counters.get("bundles_dropped") == 0


def test_a_result_whose_rows_a_dropped_bundle_held_is_an_error_not_a_hole():
    """Overflow "drop": a request asking for a background consumer's result, some of whose
    rows were in a dropped bundle, gets an error (the consumer's request_result still runs, to
    free what it kept; its own failure wins); a request whose rows all arrived gets its
    result."""
    from tllm_core.runtime.request_results import ResultStore

    class Returning(Gated):
        def request_result(self, request):
            if request.request_id == "b":
                raise RuntimeError("no result for b")
            return {"steps": [s for s in self.got if isinstance(s, int)]}

    counters = Counters()
    results = ResultStore(counters, max_result_bytes=1 << 20)
    bus = Bus(counters, RuntimeSettings(queue_size=1, overflow="drop"), results=results)
    c = Returning()
    asking = {"tllm_results": "gated"}
    hit, kept, bad = (RequestInfo(f"{r}-abcdefgh", r, 0, 0, 4, dict(asking)) for r in "hkb")

    def rows(*requests):
        n = len(requests)
        return RowInfo(np.arange(n), list(requests), np.arange(n), np.zeros(n, bool),
                       np.zeros(n, bool), torch.arange(n))  # fmt: skip

    bus.publish(c, Bundle(0, rows(hit, kept, bad)))
    assert c.entered.wait(HANG_S)  # taken by the thread, which waits at the gate
    bus.publish(c, Bundle(1, rows(hit, kept, bad)))  # fills the one slot
    bus.publish(c, Bundle(2, rows(hit, bad)))  # dropped: hit's and bad's rows have a hole
    for r in (hit, kept, bad):
        bus.finished(c, r)
    c.gate.set()
    assert bus.flush(HANG_S)
    bus.close()
    got = results.take(["h", "k", "b"])
    assert got["h"][0]["gated"] == {
        "error": 'gated: rows of this request were dropped (its queue was full with overflow "drop", '
        "or it still lagged when the run closed); its result would have holes"
    }
    assert got["k"][0]["gated"] == {"steps": [0, 1]}
    # A result the consumer failed to make says so, not that rows were dropped.
    assert "raised while making this result" in got["b"][0]["gated"]["error"]
    assert c.got.count("h-abcdefgh") == 1  # its finish notice still came
    assert counters.get("bundles_dropped.gated") == 1


def test_an_error_whose_message_raises_is_still_isolated():
    """A consumer's exception whose ``__str__`` raises: counted and reported like any other,
    nothing escapes into the engine's step."""

    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no words")

    class Raises(Consumer):
        name = "raises"

        def on_bundle(self, bundle):
            raise Unprintable()

    counters = Counters()
    bus = Bus(counters)
    assert (
        bus.call(Raises(ConsumerConfig(), None), "on_bundle", Raises.on_bundle, None, None) is False
    )
    assert counters.get("consumer_errors.raises") == 1
    assert bus.errors[0]["error"].endswith("Unprintable (its message could not be read)")


def test_background_thread_survives_any_error():
    counters = Counters()
    bus = Bus(counters, RuntimeSettings(queue_size=1))

    class Exits(Consumer):
        name = "exits"
        delivery = Delivery.BACKGROUND

        def on_bundle(self, bundle):
            raise SystemExit("bye")

    c = Exits(ConsumerConfig(), None)
    bus.publish(c, Bundle(0, _rows(1)))
    # The thread is alive and draining: these puts (queue size 1) do not block.
    assert _returns(lambda: [bus.publish(c, Bundle(i, _rows(1))) for i in range(1, 4)])
    assert bus.flush(HANG_S)
    assert not bus.active(c) and counters.get("consumer_errors.exits") == 1
    assert "SystemExit: bye" in bus.errors[0]["error"]
    bus.close(HANG_S)
    assert counters.get("close_timeouts") == 0


def test_flush_and_close_time_out():
    counters = Counters()
    bus = Bus(counters, RuntimeSettings(queue_size=4, wait_timeout_s=0.2))
    c = Gated()
    bus.publish(c, Bundle(0, _rows(1)))
    assert bus.flush() is False and counters.get("flush_timeouts") == 1
    assert _returns(bus.close)
    assert counters.get("close_timeouts") == 1
    c.gate.set()


def test_a_consumer_that_lags_at_close_hears_its_queue_as_dropped_then_stops():
    """Flush gave up on a slow background consumer: closing the bus stops its thread once
    the callback it is in returns, the bundles still queued told as dropped (in order, with
    the finish notices), so nothing reaches the consumer after the runtime closes it."""
    counters = Counters()
    bus = Bus(counters, RuntimeSettings(queue_size=4, wait_timeout_s=0.1))
    c = Gated()
    for step in range(3):
        bus.publish(c, Bundle(step, _rows(1)))
    assert c.entered.wait(HANG_S)
    bus.finished(c, RequestInfo("0-abcdefgh", "0", 0, 0, 4))
    assert bus.flush() is False
    threading.Timer(0.3, c.gate.set).start()  # the slow callback returns during the close
    assert bus.close(HANG_S) == set()
    assert c.got == [0, "dropped 1", "dropped 2", "0-abcdefgh"]
    assert counters.get("bundles_dropped.gated") == 2 and counters.get("close_timeouts") == 0


def test_a_failed_consumer_is_still_closed():
    counters = Counters()
    bus = Bus(counters, RuntimeSettings(max_consecutive_failures=1))  # off at the first error
    closed = []

    class Fails(Consumer):
        name = "fails"

        def on_bundle(self, bundle):
            raise RuntimeError("boom")

        def close(self):
            closed.append(True)

    c = Fails(ConsumerConfig(), None)
    bus.publish(c, Bundle(0, _rows(1)))
    assert not bus.active(c)
    assert bus.call(c, "on_bundle", c.on_bundle, Bundle(1, _rows(1))) is False  # still off
    assert bus.call(c, "close", c.close, even_if_disabled=True) and closed == [True]


def test_runtime_closes_a_failed_consumer():
    from tllm_core import ConsumerContext, HiddenStates, ModelInfo, hookimpl
    from tllm_core.plugins.registry import Registry
    from tllm_core.runtime.runtime import Runtime
    from tllm_core.runtime.settings import RuntimeSettings

    closed = []

    class Holder(Consumer):
        name = "holder"

        def __init__(self, config, context: ConsumerContext):
            super().__init__(config, context)

        def reads(self):
            return [HiddenStates(0)]

        def close(self):
            closed.append(self.name)

    class Plugin:
        @hookimpl
        def tllm_consumers(self):
            return [Holder]

    reg = Registry()
    reg.register(Plugin(), name="test-holder")
    model = ModelInfo(4, 2, 10, torch.float32, torch.device("cpu"), lambda h: h, None)
    rt = Runtime(RuntimeSettings.model_validate({"consumers": [{"name": "holder"}]}), model, reg)
    (slot,) = rt.slots
    rt.bus.fail(slot.consumer, "on_bundle", RuntimeError("boom"))  # as a failed callback does
    rt.close()
    assert closed == ["holder"]


def test_failed_requests_name_their_consumers_and_stay_bounded(monkeypatch):
    """A consumer that raises on a bundle is noted against the requests of that bundle (the
    server marks their responses) by engine id, so that a caller id used again is not; the
    record keeps the newest requests only."""
    import tllm_core.runtime.bus as bus_mod

    monkeypatch.setattr(bus_mod, "MAX_FAILED_REQUESTS", 3)
    bus = Bus(Counters(), RuntimeSettings(max_consecutive_failures=100))

    class Picky(Consumer):
        name = "picky"

        def on_bundle(self, bundle):
            if bundle.step % 2:
                raise ValueError("odd step")

    c = Picky(ConsumerConfig(), None)
    for step in range(10):
        req = RequestInfo(f"r{step}-abcdefgh", f"r{step}", 0, 0, 4)
        rows = _rows(2)
        rows.requests = [req, req]
        bus.publish(c, Bundle(step, rows))
    asked = [f"r{i}-abcdefgh" for i in (1, 2, 5, 7, 9)]
    assert bus.failures_of(asked) == {f"r{i}-abcdefgh": ["picky"] for i in (5, 7, 9)}
    again = RequestInfo("r9-zyxwvuts", "r9", 0, 0, 4)  # the caller's id, a new admission
    rows = _rows(1)
    rows.requests = [again]
    bus.publish(c, Bundle(10, rows))
    assert bus.failures_of(["r9-zyxwvuts"]) == {}
    sample = RequestInfo("1_s-abcdefgh", "s", 0, 1, 4, parent_id="s-abcdefgh")  # n > 1
    rows.requests = [sample]
    bus.publish(c, Bundle(11, rows))
    assert bus.failures_of(["s-abcdefgh"]) == {"s-abcdefgh": ["picky"]}


def test_a_failed_close_is_not_said_to_go_on(caplog):
    """A consumer whose close raises: logged as failing at the run's end, not with the
    failures-in-a-row rule of its step callbacks (no call of it comes after close)."""

    class Leaky(Consumer):
        name = "leaky"

        def close(self):
            raise OSError("disk full")

    bus, c = Bus(Counters(), RuntimeSettings()), Leaky(ConsumerConfig(), None)
    assert not bus.call(c, "close", c.close)
    assert "raised in close: OSError: disk full (in its close, at the run's end)" in caplog.text
    assert "goes on" not in caplog.text

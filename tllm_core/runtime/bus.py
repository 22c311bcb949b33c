"""Delivery of bundles to consumers, on the engine thread or a background thread; every
consumer call goes through :meth:`Bus.call`, which isolates and counts failures."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from time import perf_counter
from typing import Any, NamedTuple

import torch

from tllm_core.api.bundles import Bundle, not_captured
from tllm_core.api.consumer import Consumer
from tllm_core.api.counters import Counters
from tllm_core.api.port_names import parse_port_name
from tllm_core.api.ports import Delivery, Logits, SampledTokens
from tllm_core.api.results import rows_dropped
from tllm_core.api.rows import RequestInfo
from tllm_core.runtime.request_results import ResultStore
from tllm_core.runtime.settings import RuntimeSettings
from tllm_core.runtime.watchdog import BACKGROUND, STEP, Watchdog

log = logging.getLogger("tllm")

# Requests whose consumers failed, kept for the server's response marks (newest kept).
MAX_FAILED_REQUESTS = 1024
_STOP = object()


def bundle_requests(bundle: Bundle) -> Iterator[RequestInfo]:
    """The requests with rows or sampled tokens in ``bundle``, each once."""
    seen: set[str] = set()
    for rows in (bundle.rows, bundle.sampled_rows):
        for r in rows.requests if rows is not None else ():
            if r.engine_id not in seen:
                seen.add(r.engine_id)
                yield r


class _Dropped(NamedTuple):  # queued in place of a dropped bundle
    step: int
    requests: list[RequestInfo]


class _BackgroundChannel:
    """A background consumer's queue and daemon thread. Bundles take one of ``queue_size``
    slots (when full: block or drop, per ``overflow``); finish notices take none (never wait,
    never dropped) and come after the request's bundles."""

    def __init__(self, bus: Bus, consumer: Consumer):
        self.bus = bus
        self.consumer = consumer
        self.queue: queue.Queue = queue.Queue()  # unbounded: bundles are bounded by the slots
        self.abandoned = False  # stuck in a callback past its deadline: nothing waits for it
        self.shedding = False  # closing: bundles still queued are told as dropped, not run
        self.slots = threading.BoundedSemaphore(bus.settings.queue_size)
        self._pending = 0  # bundles queued, for queue_depth_max
        # Requests asking for a result whose rows a dropped bundle held (drain thread only).
        self.holes: set[str] = set()
        self._lock = threading.Lock()
        self.thread = threading.Thread(
            target=self._drain, name=f"tllm-{consumer.name}", daemon=True
        )
        self.thread.start()

    def put(self, bundle: Bundle) -> None:
        if not self.slots.acquire(blocking=False):
            if self.bus.settings.overflow == "drop":
                self.bus.counters.add("bundles_dropped", of=self.consumer.name)
                # Takes no slot, like finish notices.
                self.queue.put(_Dropped(bundle.step, list(bundle_requests(bundle))))
                return
            self.bus.counters.add("queue_full_waits")
            # bounded: the watchdog abandons a callback past its deadline, freeing the slots
            self.slots.acquire()
        with self._lock:
            self._pending += 1
            self.bus.counters.max("queue_depth_max", self._pending)
        self.queue.put(bundle)

    def abandon(self) -> int:
        """Give up on the stuck thread: drop what is queued; how many bundles were dropped."""
        self.abandoned = True
        dropped = 0
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                with self.queue.all_tasks_done:  # a flush waiting on it goes on
                    self.queue.all_tasks_done.notify_all()
                return dropped
            dropped += isinstance(item, Bundle)
            self._taken(item)
            self.queue.task_done()

    def _taken(self, item: Any) -> None:
        """An item left the queue: a bundle's slot is free again."""
        if isinstance(item, Bundle):
            with self._lock:
                self._pending -= 1
            self.slots.release()

    def _drain(self) -> None:
        # Intra-op threads are per thread (OpenMP). torch._C's binding: vLLM's CPU worker
        # replaces torch.set_num_threads with a no-op.
        try:
            torch._C.set_num_threads(self.bus.settings.background_threads)
        except Exception:  # noqa: BLE001 - the consumer still runs, with torch's default
            log.exception("tllm: could not set the threads of %s", self.thread.name)
        self.bus.counters.max("background_threads", torch.get_num_threads())
        while True:
            # bounded: an idle drain thread; flush and close wait for it with a timeout
            item = self.queue.get()
            self._taken(item)
            try:
                if item is _STOP:
                    return
                c = self.consumer
                if isinstance(item, RequestInfo):
                    self.bus.request_done(c, item, BACKGROUND, self.holes)
                elif self.shedding and isinstance(item, Bundle):  # a lagging consumer's close
                    self.bus.counters.add("bundles_dropped", of=c.name)
                    item = _Dropped(item.step, list(bundle_requests(item)))
                if isinstance(item, _Dropped):
                    self.holes.update(r.engine_id for r in item.requests if r.wants_result(c.name))
                    self.bus.call(
                        c, "on_bundle_dropped", c.on_bundle_dropped, *item, kind=BACKGROUND
                    )
                elif isinstance(item, Bundle):
                    self.bus.deliver_now(c, item, kind=BACKGROUND)
            except BaseException as e:  # noqa: BLE001 - a dead drain thread would block put
                # SystemExit & co.: the consumer goes off, the thread goes on draining.
                self.bus.fail(self.consumer, "the background thread", e, disable=True)
            finally:
                self.queue.task_done()

    def join(self, timeout: float) -> bool:
        q = self.queue
        with q.all_tasks_done:
            return q.all_tasks_done.wait_for(
                lambda: q.unfinished_tasks == 0 or self.abandoned, timeout
            )

    def close(self, timeout: float) -> bool:
        """Stop the thread once it has told the consumer what is queued (bundles as dropped:
        a consumer that lags at the end is not run past it); False if still running."""
        if self.abandoned:
            return False  # a daemon thread stuck in the consumer: never joined
        self.shedding = True
        self.queue.put(_STOP)
        self.thread.join(timeout)
        return not self.thread.is_alive()


class Bus:
    def __init__(
        self,
        counters: Counters,
        settings: RuntimeSettings | None = None,
        watchdog: Watchdog | None = None,
        results: ResultStore | None = None,
    ) -> None:
        self.counters = counters
        self.settings = settings or RuntimeSettings()
        self.results = results
        self.watchdog = watchdog
        self.errors: list[dict[str, str]] = []
        self.disabled: set[str] = set()
        # (consumer, callback) -> its failures in a row; a call that returns resets it.
        self._failures: dict[tuple[str, str], int] = {}
        self._reported: set[str] = set()  # consumers whose first error was logged
        self._fail_lock = threading.Lock()  # engine thread and background threads fail
        self._channels: dict[str, _BackgroundChannel] = {}
        # vLLM's id of a request (its samples': the parent's) -> consumers that failed while
        # acting on it (bounded, oldest out): unique per admission; a caller's id may be reused.
        self.failed_requests: OrderedDict[str, set[str]] = OrderedDict()

    def active(self, consumer: Consumer) -> bool:
        return consumer.name not in self.disabled

    def call(
        self,
        consumer: Consumer,
        what: str,
        fn: Callable[..., Any],
        *args: Any,
        even_if_disabled: bool = False,
        requests: Iterable[RequestInfo] = (),
        kind: str = STEP,
    ) -> bool:
        """Run one consumer callback; True if it succeeded (else :meth:`fail`). ``requests``:
        those it acted on; ``kind``: the watchdog's deadline."""
        if consumer.name in self.disabled and not even_if_disabled:
            return False
        # Counted before the call: a callback that never returns was still called.
        self.counters.add(f"consumer_calls.{consumer.name}")
        watch = self.watchdog
        try:
            with watch.watching(consumer.name, what, kind) if watch else contextlib.nullcontext():
                fn(*args)
        except Exception as e:  # noqa: BLE001 - isolation is the point
            self.fail(consumer, what, e, requests, hint=_missing_port(e, args))
            return False
        if self._failures:  # a call that returns ends its callback's run of failures
            self._failures.pop((consumer.name, what), None)
        return True

    def fail(
        self,
        consumer: Consumer,
        what: str,
        e: BaseException,
        requests: Iterable[RequestInfo] = (),
        disable: bool = False,
        hint: str = "",
    ) -> None:
        """Count ``e``; report the consumer's first error (``hint``: what may explain it);
        switch it off after ``max_consecutive_failures`` in a row, or when ``disable``; note
        ``requests``."""
        name = consumer.name
        self.counters.add("consumer_errors", of=name)
        msg = f"consumer {name!r} raised in {what}: {_words(e)}{hint}"
        limit = self.settings.max_consecutive_failures
        with self._fail_lock:
            n = self._failures[(name, what)] = self._failures.get((name, what), 0) + 1
            off = (disable or n >= limit) and name not in self.disabled
            first = name not in self._reported
            self._reported.add(name)
            if off:
                self.disabled.add(name)
            for r in requests:
                self.failed_requests.setdefault(r.parent_id, set()).add(name)
                self.failed_requests.move_to_end(r.parent_id)
            while len(self.failed_requests) > MAX_FAILED_REQUESTS:
                self.failed_requests.popitem(last=False)
        if off:
            self.counters.add("consumers_disabled")
        if off or first:
            if what == "close":
                why = "in its close, at the run's end"
            elif off:
                why = "consumer disabled for the rest of the run: " + (
                    "failed in a background thread" if disable else f"{n} failures in a row"
                )
            else:
                why = (
                    f"the consumer goes on; it is disabled after {limit} failures in a row of one "
                    f"callback; its later errors are counted in consumer_errors.{name}, not logged"
                )
            log.error("%s (%s)\n%s", msg, why, "".join(traceback.format_exception(e)))
            self.errors.append({"consumer": name, "where": what, "error": msg, "disabled": off})

    def failures_of(self, engine_ids: Iterable[str] | None = None) -> dict[str, list[str]]:
        """The consumers that failed while acting on each of ``engine_ids`` (the requests'
        :attr:`RequestInfo.parent_id`; None: all kept)."""
        with self._fail_lock:
            known = self.failed_requests
            ids = known if engine_ids is None else [r for r in engine_ids if r in known]
            return {r: sorted(known[r]) for r in ids}

    def publish(self, consumer: Consumer, bundle: Bundle) -> None:
        if consumer.name in self.disabled:
            return
        if consumer.delivery is Delivery.BACKGROUND:
            ch = self._channels.get(consumer.name)
            if ch is None:
                ch = self._channels[consumer.name] = _BackgroundChannel(self, consumer)
            t = perf_counter()
            host = _to_host(bundle)
            self.counters.add("host_s.to_host", perf_counter() - t)
            ch.put(host)
        else:
            self.deliver_now(consumer, bundle)

    def finished(self, consumer: Consumer, request: RequestInfo) -> None:
        ch = self._channels.get(consumer.name)
        if ch is not None and ch.abandoned:
            if self.results is not None and request.wants_result(consumer.name):
                why = f"consumer {consumer.name!r} was switched off: a callback passed its deadline"
                self.results.put(request, consumer.name, {"error": why})
        elif ch is not None:
            ch.queue.put(request)  # takes no slot: never dropped, never waits (no tensors)
        else:
            self.request_done(consumer, request, STEP)

    def request_done(
        self, consumer: Consumer, request: RequestInfo, kind: str, holes: set[str] | None = None
    ) -> None:
        """``on_request_finished``, then the result if asked (an error when the consumer failed,
        or when ``request`` is in ``holes``, its background channel's requests with rows
        dropped)."""
        c, name, acted = consumer, consumer.name, (request,)
        self.call(
            c, "on_request_finished", c.on_request_finished, request, requests=acted, kind=kind
        )
        if self.results is None or not request.wants_result(name):
            return
        made: list[Any] = []

        def make() -> None:
            made.append(c.request_result(request))

        lost = holes is not None and request.engine_id in holes
        if lost:
            holes.discard(request.engine_id)
        if not self.call(c, "request_result", make, requests=acted, kind=kind):
            what = "is switched off" if name in self.disabled else "raised while making this result"
            made.append({"error": f"consumer {name!r} {what} (see the run's errors)"})
        elif lost:  # made all the same, so that the consumer lets go of what it kept
            made[0] = {"error": rows_dropped(name)}
        self.results.put(request, name, made[0])

    def deliver_now(self, consumer: Consumer, bundle: Bundle, kind: str = STEP) -> None:
        acted = bundle_requests(bundle)
        if self.call(consumer, "on_bundle", consumer.on_bundle, bundle, requests=acted, kind=kind):
            self.counters.add("bundles_delivered", of=consumer.name)

    def abandon(self, name: str, why: str) -> None:
        """Switch off the background consumer ``name``, stuck in a callback; drop its queue."""
        self.disabled.add(name)
        ch = self._channels.get(name)
        dropped = ch.abandon() if ch is not None else 0
        self.counters.add("consumers_abandoned")
        self.counters.add("bundles_abandoned", dropped, of=name)
        msg = f"{why}; switched off, {dropped} queued bundle(s) dropped"
        log.error("tllm: %s", msg)
        with self._fail_lock:
            self.errors.append(
                {"consumer": name, "where": "watchdog", "error": msg, "disabled": True}
            )

    def abandoned(self, name: str) -> bool:
        ch = self._channels.get(name)
        return ch is not None and ch.abandoned

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued bundle has been handled, at most ``timeout`` seconds (else
        ``wait_timeout_s``) per consumer; False (counted, logged) when one has not caught up."""
        timeout = self.settings.wait_timeout_s if timeout is None else timeout
        ok = True
        for name, ch in self._channels.items():
            if not ch.join(timeout):
                ok = False
                self.counters.add("flush_timeouts")
                log.error(
                    "tllm: consumer %r has not handled its queued bundles after %.0f s "
                    "(%d still queued); going on without waiting",
                    name,
                    timeout,
                    ch.queue.unfinished_tasks,
                )
        return ok

    def close(self, timeout: float | None = None) -> set[str]:
        """Stop the background threads, each within ``timeout`` (else ``wait_timeout_s``);
        returns the consumers whose thread is still inside them (abandoned, or late): not to
        be closed, which would race it."""
        timeout = self.settings.wait_timeout_s if timeout is None else timeout
        busy = set()
        for name, ch in self._channels.items():
            if not ch.close(timeout):
                busy.add(name)
                if not ch.abandoned:
                    self.counters.add("close_timeouts")
                    log.error(
                        "tllm: the thread of consumer %r did not stop in %.0f s; the consumer "
                        "is not closed",
                        name,
                        timeout,
                    )
        self._channels.clear()
        return busy


def _words(e: BaseException) -> str:
    """``Type: message``, also for an exception whose ``__str__`` raises (it must not escape
    into the engine's step from the failure path)."""
    try:
        return f"{type(e).__name__}: {e}"
    except Exception:  # noqa: BLE001
        return f"{type(e).__name__} (its message could not be read)"


def _is_port_key(key: object) -> bool:
    """Whether ``key`` is written as a bundle key: a layer port's name as the port names it
    (``'layer.2'``, ``'attn.-1'``, ``'final'``) or a built-in sample port's."""
    if not isinstance(key, str):
        return False
    if key in (Logits().key, SampledTokens().key):
        return True
    try:
        return str(parse_port_name(key)) == key
    except ValueError:
        return False


def _missing_port(e: Exception, args: tuple) -> str:
    """For a ``KeyError`` of a port key that the bundle handed over lacks: which it holds."""
    key = e.args[0] if isinstance(e, KeyError) and e.args else None
    bundle = args[0] if args and isinstance(args[0], Bundle) else None
    if bundle is None or not _is_port_key(key) or key in bundle.hidden or key in bundle.per_sample:
        return ""
    return f" ({not_captured(key, [*bundle.hidden, *bundle.per_sample])})"


def _to_host(bundle: Bundle) -> Bundle:
    """Host copies (on CPU too): the step's buffers are reused next step."""
    return Bundle(
        step=bundle.step,
        rows=bundle.rows.to_host(),
        hidden={k: v.to("cpu", copy=True) for k, v in bundle.hidden.items()},
        sampled_rows=bundle.sampled_rows.to_host() if bundle.sampled_rows is not None else None,
        per_sample={k: v.to("cpu", copy=True) for k, v in bundle.per_sample.items()},
    )

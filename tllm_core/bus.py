"""Delivery of bundles to consumers: on the engine thread, or on a background thread.

Every consumer call goes through :meth:`Bus.call`, which isolates failures: a consumer
that raises is reported with its name, counted, and switched off for the rest of the
run, so it cannot corrupt later steps or other consumers.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections.abc import Callable
from typing import Any, Literal

import torch

from tllm_core.bundles import Bundle
from tllm_core.consumer import Consumer
from tllm_core.counters import Counters
from tllm_core.ports import Delivery
from tllm_core.rows import RequestInfo

log = logging.getLogger("tllm")

Overflow = Literal["block", "drop"]
_STOP = object()


class _BackgroundChannel:
    """A bounded queue drained by one daemon thread per background consumer."""

    def __init__(self, bus: Bus, consumer: Consumer, maxsize: int, overflow: Overflow):
        self.bus = bus
        self.consumer = consumer
        self.overflow = overflow
        self.queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.thread = threading.Thread(
            target=self._drain, name=f"tllm-{consumer.name}", daemon=True
        )
        self.thread.start()

    def put(self, bundle: Bundle) -> None:
        if self.overflow == "drop":
            try:
                self.queue.put_nowait(bundle)
            except queue.Full:
                self.bus.counters.add("bundles_dropped")
                self.bus.counters.add(f"bundles_dropped.{self.consumer.name}")
                return
        else:
            if self.queue.full():
                self.bus.counters.add("queue_full_waits")
            self.queue.put(bundle)
        self.bus.counters.max("queue_depth_max", self.queue.qsize())

    def _drain(self) -> None:
        # Intra-op threads are a per-thread setting (OpenMP): the engine's threads keep
        # theirs. torch._C's binding: vLLM's CPU worker replaces torch.set_num_threads with
        # a no-op once it has bound its threads.
        try:
            torch._C.set_num_threads(self.bus.background_threads)
        except Exception:  # noqa: BLE001 - the consumer still runs, with torch's default
            log.exception("tllm: could not set the threads of %s", self.thread.name)
        self.bus.counters.max("background_threads", torch.get_num_threads())
        while True:
            item = self.queue.get()
            try:
                if item is _STOP:
                    return
                if isinstance(item, RequestInfo):
                    c = self.consumer
                    self.bus.call(c, "on_request_finished", c.on_request_finished, item)
                else:
                    self.bus.deliver_now(self.consumer, item)
            finally:
                self.queue.task_done()

    def close(self) -> None:
        self.queue.put(_STOP)
        self.thread.join()


class Bus:
    def __init__(
        self,
        counters: Counters,
        queue_size: int = 64,
        overflow: Overflow = "block",
        background_threads: int = 1,
    ) -> None:
        self.counters = counters
        self.queue_size = queue_size
        self.overflow = overflow
        self.background_threads = background_threads
        self.errors: list[dict[str, str]] = []
        self.disabled: set[str] = set()
        self._channels: dict[str, _BackgroundChannel] = {}

    def active(self, consumer: Consumer) -> bool:
        return consumer.name not in self.disabled

    def call(self, consumer: Consumer, what: str, fn: Callable[..., Any], *args: Any) -> bool:
        """Run one consumer callback; on error report, count, disable. True if it succeeded."""
        if consumer.name in self.disabled:
            return False
        try:
            fn(*args)
            return True
        except Exception as e:  # noqa: BLE001 - isolation is the point
            self.disabled.add(consumer.name)
            self.counters.add("consumer_errors")
            self.counters.add(f"consumer_errors.{consumer.name}")
            msg = f"consumer {consumer.name!r} raised in {what}: {type(e).__name__}: {e}"
            log.error(
                "%s (consumer disabled for the rest of the run)\n%s", msg, traceback.format_exc()
            )
            self.errors.append({"consumer": consumer.name, "where": what, "error": msg})
            return False

    def publish(self, consumer: Consumer, bundle: Bundle) -> None:
        if consumer.name in self.disabled:
            return
        if consumer.delivery is Delivery.BACKGROUND:
            ch = self._channels.get(consumer.name)
            if ch is None:
                ch = self._channels[consumer.name] = _BackgroundChannel(
                    self, consumer, self.queue_size, self.overflow
                )
            ch.put(_to_host(bundle))
        else:
            self.deliver_now(consumer, bundle)

    def finished(self, consumer: Consumer, request: RequestInfo) -> None:
        """A request finished; background consumers hear it after its queued bundles."""
        ch = self._channels.get(consumer.name)
        if ch is not None:
            ch.queue.put(request)  # never dropped: it carries no tensors
        else:
            self.call(consumer, "on_request_finished", consumer.on_request_finished, request)

    def deliver_now(self, consumer: Consumer, bundle: Bundle) -> None:
        if self.call(consumer, "on_bundle", consumer.on_bundle, bundle):
            self.counters.add("bundles_delivered")
            self.counters.add(f"bundles_delivered.{consumer.name}")

    def flush(self) -> None:
        """Wait until every queued bundle has been handled."""
        for ch in self._channels.values():
            ch.queue.join()

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()


def _to_host(bundle: Bundle) -> Bundle:
    """Host copies: capture buffers are reused next step, so background bundles own their data."""

    def host(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        # .to("cpu") already copies from a device; on CPU the step buffers are reused.
        return t.to("cpu", copy=True)

    return Bundle(
        step=bundle.step,
        rows=bundle.rows.to_host(),
        hidden={k: host(v) for k, v in bundle.hidden.items()},
        sampled_rows=bundle.sampled_rows.to_host() if bundle.sampled_rows is not None else None,
        per_sample={k: host(v) for k, v in bundle.per_sample.items()},
    )

"""The stand-ins :class:`~tllm_core.testing.fake_cuda.FakeCuda` (``fc``) installs for
``torch.cuda`` and the ``Tensor`` methods a CPU-only build cannot run on the fake device;
each reports host waits, captures and stream ordering to ``fc``."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

REHEARSAL_EVENT_MS = 1.0  # not 0: scripts divide by the times they read


class _Waitable:
    """``query`` (the fake's answer: done) and ``synchronize`` (a host wait); either way the
    host is then after the work it covers."""

    _fc: Any

    def _host_joins(self) -> None:
        raise NotImplementedError

    def query(self) -> bool:
        if self._fc.order is not None:
            self._host_joins()
        return True

    def synchronize(self) -> None:
        what = type(self).__name__.removeprefix("Fake")
        self._fc._host_wait(f"{what}.synchronize()", joins_current=False)
        if self._fc.order is not None:
            self._host_joins()


class FakeStream(_Waitable):
    """``torch.cuda.Stream``: ordering calls only tell the stream order; ``synchronize`` is a
    host wait."""

    def __init__(self, fc: Any, device: Any = None, priority: int = 0, **_: Any) -> None:
        self._fc = fc
        self.device = fc.device
        self.priority = priority
        self.stream_id = fc.new_stream_id()

    def wait_stream(self, stream: FakeStream) -> None:
        if self._fc.order is not None:
            self._fc.order.wait_stream(self, stream)

    def wait_event(self, event: FakeEvent) -> None:
        if self._fc.order is not None:
            self._fc.order.wait_event(self, event)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent(self._fc)
        event.record(self)
        return event

    def _host_joins(self) -> None:
        self._fc.order.host_joins_stream(self)

    def __repr__(self) -> str:
        return f"<FakeStream {self.stream_id}>"


class FakeEvent(_Waitable):
    """``torch.cuda.Event``: ``record``/``wait``/``query`` never wait; ``synchronize`` does."""

    def __init__(self, fc: Any, enable_timing: bool = False, **_: Any) -> None:
        self._fc = fc
        self.enable_timing = enable_timing

    def record(self, stream: FakeStream | None = None) -> None:
        if self._fc.order is not None:
            self._fc.order.record(self, stream or torch.cuda.current_stream())

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or torch.cuda.current_stream()).wait_event(self)

    def _host_joins(self) -> None:
        self._fc.order.host_joins_event(self)

    def elapsed_time(self, end: FakeEvent) -> float:
        return REHEARSAL_EVENT_MS if self._fc.rehearsal else 0.0


class FakeGraph:
    """``torch.cuda.CUDAGraph``: capture records the operations run under it (launches and
    bytes, replayed by :meth:`replay`); what they allocate is the graph's pool."""

    def __init__(self, fc: Any, *_: Any, **__: Any) -> None:
        self._fc = fc
        self.by_op: dict[str, list[int]] = {}  # operation -> [launches, bytes] captured
        self.pool_bytes = 0
        self.captured = False
        self.order_accesses: list[Any] = []  # with order=True: what a replay accesses
        self.ops: list[tuple] = []  # on a computing device: what a replay runs again

    @property
    def launches(self) -> int:
        return sum(n for n, _ in self.by_op.values())

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.by_op.values())

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        self._fc._begin_capture(self)

    def capture_end(self) -> None:
        self._fc._end_capture(self)
        self.captured = True

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("FakeCuda: replay() of a CUDAGraph that was never captured")
        self._fc._replay(self)

    def reset(self) -> None:
        self.by_op, self.pool_bytes, self.captured = {}, 0, False
        self.order_accesses, self.ops = [], []

    def pool(self) -> object:
        return object()


def cuda_stubs(fc: Any) -> dict[str, Any]:
    """The ``torch.cuda`` attributes to install while ``fc`` is active."""
    local = threading.local()  # the current stream is per thread, as in CUDA

    def current_stream(device: Any = None) -> FakeStream:
        return getattr(local, "stream", fc.default_stream)

    def set_stream(stream: FakeStream | None) -> None:
        if stream is not None:
            local.stream = stream

    @contextlib.contextmanager
    def stream(s: FakeStream | None) -> Iterator[None]:
        if s is None:
            yield
            return
        prev = current_stream()
        local.stream = s
        try:
            yield
        finally:
            local.stream = prev

    @contextlib.contextmanager
    def graph(
        cuda_graph: FakeGraph,
        pool: Any = None,
        stream: FakeStream | None = None,
        capture_error_mode: str = "global",
    ) -> Iterator[FakeGraph]:
        # The real context manager synchronizes the device before capturing.
        fc._host_wait("torch.cuda.graph() (synchronizes the device before capture)", False)
        if fc.order is not None:
            fc.order.host_joins_all()
        prev = current_stream()
        local.stream = stream or FakeStream(fc)
        cuda_graph.capture_begin(pool, capture_error_mode)
        try:
            yield cuda_graph
        finally:
            cuda_graph.capture_end()
            local.stream = prev

    def synchronize(device: Any = None) -> None:
        fc._host_wait("torch.cuda.synchronize()", joins_current=False)
        if fc.order is not None:
            fc.order.host_joins_all()

    props = SimpleNamespace(
        name=fc.device_name,
        total_memory=fc.total_memory,
        major=9,
        minor=0,
        multi_processor_count=132,
    )
    return {
        "Stream": lambda *a, **k: FakeStream(fc, *a, **k),
        "Event": lambda *a, **k: FakeEvent(fc, *a, **k),
        "CUDAGraph": lambda *a, **k: FakeGraph(fc, *a, **k),
        "graph": graph,
        "graph_pool_handle": lambda: object(),
        "stream": stream,
        "current_stream": current_stream,
        "default_stream": lambda device=None: fc.default_stream,
        "set_stream": set_stream,
        # A bound method: the process-wide patch names its FakeCuda (fake_cuda.active).
        "is_available": fc.is_available,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "synchronize": synchronize,
        "mem_get_info": lambda device=None: (fc.total_memory, fc.total_memory),
        "get_device_name": lambda device=None: fc.device_name,
        "get_device_capability": lambda device=None: (props.major, props.minor),
        "get_device_properties": lambda device=None: props,
        "set_sync_debug_mode": fc.set_sync_debug_mode,
        "get_sync_debug_mode": lambda: fc.sync_debug_mode,
        "empty_cache": lambda: None,
    } | (
        {  # frees are not seen: a script's memory readings are 0 in a rehearsal
            "memory_allocated": lambda device=None: 0,
            "max_memory_allocated": lambda device=None: 0,
            "reset_peak_memory_stats": lambda device=None: None,
        }
        if fc.rehearsal
        else {}
    )


_NUMBERS = (bool, int, float, complex)


def tensor_stubs(fc: Any) -> dict[str, Any]:
    """The ``torch.Tensor`` methods to install while ``fc`` is active."""
    setitem = torch.Tensor.__setitem__
    tolist = torch.Tensor.tolist
    make = torch.tensor

    def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        if self.device.type != "cpu":
            raise RuntimeError(f"cannot pin a {self.device} tensor: only CPU tensors can be pinned")
        if fc.is_pinned(self):
            return self
        out = self.clone()
        fc.mark_pinned(out)
        return out

    def is_pinned(self: torch.Tensor, device: Any = None) -> bool:
        return fc.is_pinned(self)

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        pass

    def numpy(self: torch.Tensor, *, force: bool = False) -> np.ndarray:
        if fc.is_fake(self):
            fc._host_wait("Tensor.numpy()")
            return np.ones(tuple(self.shape), dtype=torch.empty(0, dtype=self.dtype).numpy().dtype)
        if fc.order is not None:  # the array shares the memory: the host may read or fill it
            fc.order.host_access(self, written=True)
        return torch._C.TensorBase.numpy(self, force=force)

    def to_list(self: torch.Tensor) -> Any:
        # A host tensor's values are read in C++, out of the dispatch mode's sight.
        if fc.order is not None and not fc.is_fake(self):
            fc.order.host_access(self, written=False)
        return tolist(self)

    def set_item(self: torch.Tensor, index: Any, value: Any) -> None:
        # On CUDA, setitem turns a Python number into a CPU tensor, which an advanced index
        # then copies from pageable memory: do as CUDA does so the checker sees it.
        if isinstance(value, _NUMBERS) and fc.is_fake(self) and not self.dtype.is_complex:
            value = make(value, dtype=self.dtype)
        setitem(self, index, value)

    return {
        "pin_memory": pin_memory,
        "is_pinned": is_pinned,
        "record_stream": record_stream,
        "numpy": numpy,
        "tolist": to_list,
        "__setitem__": set_item,
    }


def factory_stubs(fc: Any) -> dict[str, Any]:
    """``torch.tensor`` / ``as_tensor`` / ``asarray`` to the fake device (they copy in C++,
    out of a dispatch mode's sight)."""

    def wrap(name: str) -> Any:
        orig = getattr(torch, name)

        def factory(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            dev = kwargs.get("device")
            on_device = isinstance(data, torch.Tensor) and fc.is_fake(data)
            if dev is not None and torch.device(dev) == fc.device and not on_device:
                with fc.quiet():  # some inputs (numpy) dispatch part of it: count it once
                    out = orig(data, *args, **kwargs)
                fc._factory_copy(f"torch.{name}(..., device=)", out)
                return out
            return orig(data, *args, **kwargs)

        return factory

    return {name: wrap(name) for name in ("tensor", "as_tensor", "asarray")}


def rehearsal_stubs(fc: Any) -> dict[str, Any]:
    """For a script that measures: a CPU ``torch.Generator`` for the fake device (meta has
    none), and ``torch.compile`` returning the module uncompiled."""
    real = torch.Generator

    class Generator(real):  # type: ignore[misc, valid-type]
        def __new__(cls, device: Any = "cpu") -> torch.Generator:
            dev = torch.device(device)
            return real.__new__(cls, "cpu" if dev == fc.device else dev)

        def __init__(self, *_: Any, **__: Any) -> None:
            pass

    return {"Generator": Generator, "compile": lambda model, *a, **k: model}

"""Run CUDA-path code on a fake device (``torch.device("meta")``: 7B shapes cost nothing) and
flag what would make the host wait, copy from pageable memory, allocate, first use cuBLAS on a
stream, or race between streams during the steps: docs/fake-cuda.md."""

from __future__ import annotations

import contextlib
import itertools
import linecache
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from types import CodeType, MappingProxyType, SimpleNamespace
from typing import Any, NamedTuple
from unittest import mock

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

# -- the rule table ----------------------------------------------------------------------------
WAIT, NO_DATA, SCALAR, MATMUL, COPY = "wait", "no_data", "scalar", "matmul", "copy"
ELEMENTS, SLICES = "elements", "slices"  # a gather/scatter: moves only what it indexes


class Rule(NamedTuple):
    does: str
    kind: str = ""  # a host wait's kind, when not the operation's name
    when: Callable[[Any, tuple, dict], bool] | None = None  # only when this holds


def _bool_mask(func: Any, args: tuple, kwargs: dict) -> bool:
    return (
        len(args) > 1
        and isinstance(args[1], (list, tuple))
        and any(_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    )


def _rules(does: str, names: str, **kw: Any) -> dict[str, Rule]:
    return {name: Rule(does, **kw) for name in names.split()}


# What each aten operation is on CUDA, for the fake device and the counters (by name):
# WAIT: its result needs the device's values on the host (a Python value, or an output size
# that depends on them); NO_DATA: allocates or describes shapes, moves no data; SCALAR: a
# 0-dim host tensor is a kernel argument (no copy); MATMUL: runs on cuBLAS; ELEMENTS/SLICES:
# touches the indexed elements (or slices) of argument 0, indices in argument 2; COPY:
# between host and device by :func:`copy_rule`.
RULES: Mapping[str, Rule] = MappingProxyType(
    {
        **_rules(WAIT, "nonzero masked_select equal bincount _local_scalar_dense"),
        **_rules(
            WAIT,
            "_unique _unique2 unique_consecutive unique_dim unique_dim_consecutive",
            kind="unique",
        ),
        # Tensor repeats: the output size is their sum, unless given.
        **_rules(
            WAIT,
            "repeat_interleave",
            when=lambda f, a, k: f._overloadname != "self_int" and k.get("output_size") is None,
        ),
        **_rules(
            WAIT, "index index_put index_put_ _index_put_impl_", kind="bool_index", when=_bool_mask
        ),
        **_rules(NO_DATA, "empty empty_like empty_strided new_empty new_empty_strided lift_fresh"),
        **_rules(NO_DATA, "_unsafe_view"),
        **_rules(SCALAR, "fill fill_ masked_fill masked_fill_"),
        **_rules(MATMUL, "mm bmm addmm addmv mv addbmm baddbmm dot vdot linear matmul"),
        **_rules(MATMUL, "_addmm_activation _scaled_mm _int_mm _grouped_mm"),
        **_rules(ELEMENTS, "gather scatter scatter_ scatter_add scatter_add_"),
        **_rules(SLICES, "index_select index_copy index_copy_ index_add_ index_fill_"),
        **_rules(COPY, "_to_copy copy_"),
    }
)
NONE = Rule("")


def _tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor)


def _name(func: Any) -> str:
    return func._schema.name.split("::")[-1]


def tensor_bytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if _tensor(t))


def host_wait_kind(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Why ``func`` makes the host wait for a CUDA device (a WAIT rule), or None."""
    rule = RULES.get(_name(func), NONE)
    if rule.does == WAIT and (rule.when is None or rule.when(func, args, kwargs)):
        return rule.kind or _name(func)
    return None


def copy_rule(to_device: bool, non_blocking: bool, host_pinned: bool) -> tuple[bool, bool]:
    """``(host waits, pageable)``: only a non-blocking copy from pinned memory (or to the device:
    staged) leaves the host free; one to the device from unpinned memory is pageable."""
    return not (non_blocking and (host_pinned or to_device)), to_device and not host_pinned


def moves_data(func: Any) -> bool:
    """A launch: neither a view nor a NO_DATA operation."""
    return not func.is_view and RULES.get(_name(func), NONE).does != NO_DATA


def fresh_outputs(func: Any, out: Any) -> list[Any]:
    """Outputs that alias no input (new storage)."""
    if func.is_view:
        return []
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o for r, o in zip(func._schema.returns, outs, strict=False) if r.alias_info is None]


def _arg(func: Any, args: tuple, kwargs: dict, i: int) -> Any:
    return args[i] if i < len(args) else kwargs.get(func._schema.arguments[i].name)


def op_bytes(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Bytes a launch (:func:`moves_data`) reads and writes: arguments read (but ``out=``),
    written ones and new outputs written; gathers and scatters the elements they index; an
    overload with ``tllm_bytes(*args, **kwargs)`` what that returns; another op 0."""
    if not moves_data(func):  # a public helper: a view or NO_DATA op moves nothing
        return 0
    stated = getattr(func, "tllm_bytes", None)
    if stated is not None:  # an operator that states its own traffic (see docs/fake-cuda.md)
        return int(stated(*args, **kwargs))
    does = RULES.get(_name(func), NONE).does
    sparse = does in (ELEMENTS, SLICES) and _tensor(args[0])
    n = tensor_bytes(fresh_outputs(func, out))
    for i, arg in enumerate(func._schema.arguments):
        written = arg.alias_info is not None and arg.alias_info.is_write
        if sparse and i == 0:  # the elements indexed: read, and written in place
            big, rows = args[0], args[2].numel()
            if does == SLICES:
                dim = args[1] if len(args) > 1 and isinstance(args[1], int) else 0
                rows = rows * (big.numel() // max(1, big.shape[dim])) if big.dim() else 1
            n += rows * big.element_size() * (1 + written)
        else:
            n += tensor_bytes(_arg(func, args, kwargs, i)) * ((not arg.is_out) + written)
    return n


# -- findings ----------------------------------------------------------------------------------
KINDS = ("host_wait", "pageable_copy", "allocation", "first_cublas", "race")
_SYNC_KINDS = ("host_wait", "pageable_copy")  # what set_sync_debug_mode("error") raises at
PHASES = ("construction", "steps", "teardown")
REHEARSAL_EVENT_MS = 1.0  # not 0: scripts divide by the times they read
# Frames never named in a finding: torch, this package, and contextlib (stub context managers).
_SKIP = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules[__name__]))
_SKIP += (contextlib.__file__,)
Site = tuple[CodeType, int] | None  # formatted only when reported


def _site() -> Site:
    """The (code, line) of the first frame outside torch and this package."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_SKIP):
        f = f.f_back
    return None if f is None else (f.f_code, f.f_lineno)


def _where(site: Site) -> str:
    return ":".join(map(str, site_parts(site)))


def site_parts(site: Site) -> tuple[str, int, str]:
    """``(file, line, function)``, the file relative to the working directory if under it."""
    if site is None:
        return ("?", 0, "?")
    code, line = site
    path = code.co_filename
    rel = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
    return (rel, line, code.co_name)


@dataclass(eq=False)  # hashed by identity: one per kind, what, line and phase
class Finding:
    kind: str
    what: str
    file: str
    line: int
    function: str
    code: str
    phase: str
    in_capture: bool
    count: int = 1

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}:{self.function}"


def _stats() -> dict[str, Any]:
    return dict.fromkeys(("launches", "bytes", "allocated_bytes", "graph_replays", *KINDS), 0)


def active() -> FakeCuda | None:
    """The active ``FakeCuda``, found through its bound ``torch.cuda.is_available`` patch."""
    owner = getattr(torch.cuda.is_available, "__self__", None)
    return owner if isinstance(owner, FakeCuda) else None


def is_cuda(device: torch.device | str) -> bool:
    """Whether to take the CUDA branch on ``device``: a CUDA device or the active fake one."""
    dev = torch.device(device)
    fc = active()
    return dev.type == "cuda" or (fc is not None and dev == fc.device)


# -- stream ordering ---------------------------------------------------------------------------
HOST = -1  # the host's context; a stream's is its stream_id
_HISTORY = 256  # accesses kept per storage (a step touches each buffer a few times)


class _Access(NamedTuple):
    ctx: int
    tick: int
    write: bool
    lo: int
    hi: int
    site: Site
    captured: Site  # a replayed access: where the capture made it


def _merge(into: dict[int, int], other: dict[int, int] | None) -> None:
    for ctx, t in (other or {}).items():
        into[ctx] = max(into.get(ctx, 0), t)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage ``t`` may touch, a strided view's gaps included."""
    size, lo = t.element_size(), t.storage_offset() * t.element_size()
    if t.numel() == 0:
        return lo, lo
    extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    return lo, lo + extent * size


class _Off:
    """The stream order when ``order=False``: every call does nothing."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *a, **k: None


class StreamOrder:
    """``order=True``: a vector clock per context (the host, each stream); two overlapping
    accesses from different contexts, one a write, neither ordered before the other, are a
    race, reported once per pair of lines."""

    def __init__(self, fc: FakeCuda) -> None:
        self.fc = fc
        self.clocks: dict[int, dict[int, int]] = {HOST: {HOST: 0}}
        self.history: dict[tuple[str, int], list[_Access]] = {}
        self.accesses = 0

    def name(self, ctx: int) -> str:
        if ctx == HOST:
            return "the host"
        return "the default stream" if ctx == self.fc.default_stream.stream_id else f"stream {ctx}"

    def clock(self, ctx: int) -> dict[int, int]:
        return self.clocks.setdefault(ctx, {ctx: 0})

    def enqueued(self, ctx: int) -> dict[int, int]:
        """``ctx``'s clock for work queued now: after all the host has done so far."""
        clock = self.clock(ctx)
        if ctx != HOST:
            _merge(clock, self.clocks[HOST])
        return clock

    def wait(self, stream: FakeStream, clock: dict[int, int] | None) -> None:
        """Later work on ``stream`` after ``clock`` (ignored inside a capture)."""
        if self.fc._capture is None:
            _merge(self.enqueued(stream.stream_id), clock)

    def record(self, event: FakeEvent, stream: FakeStream) -> None:
        if self.fc._capture is None:
            event.clock = dict(self.enqueued(stream.stream_id))

    def host_joins(self, clock: dict[int, int] | None) -> None:
        """The host waited for the work ``clock`` covers."""
        _merge(self.clocks[HOST], clock)

    def host_joins_all(self) -> None:
        for clock in list(self.clocks.values()):
            self.host_joins(clock)

    def _key(self, t: torch.Tensor) -> tuple[str, int] | None:
        if t.device.type == "meta":
            return ("device", t.untyped_storage()._cdata)
        if t.device.type == "cpu" and self.fc.is_pinned(t):
            return ("pinned", t.untyped_storage().data_ptr())
        return None

    def fresh(self, t: torch.Tensor) -> None:
        """``t`` is new storage: what was at its address before is forgotten (inside a
        capture: the graph's pool, not followed)."""
        key, g = self._key(t), self.fc._capture
        if key is not None and g is not None:
            g.fresh.add(key)
        elif key is not None:
            self.history.pop(key, None)

    def operation(self, on_device: bool, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """An aten operation on the current stream (else the host): its tensor arguments are
        read (written where the schema says so), its new outputs written (NO_DATA: only new)."""
        if func.is_view:
            return
        touched = []
        for i, arg in enumerate(func._schema.arguments):
            written = arg.alias_info is not None and arg.alias_info.is_write
            touched += [
                (t, written) for t in tree_leaves(_arg(func, args, kwargs, i)) if _tensor(t)
            ]
        for o in fresh_outputs(func, out):
            if _tensor(o):
                self.fresh(o)
                if moves_data(func):
                    touched.append((o, True))
        self.tensors(on_device, touched)

    def tensors(self, on_device: bool, touched: list[tuple[torch.Tensor, bool]]) -> None:
        """Accesses ``(tensor, written)`` made now by the current stream or the host."""
        site: Site = None
        ctx = torch.cuda.current_stream().stream_id if on_device else HOST
        g = self.fc._capture if on_device else None
        for t, written in touched:
            key = self._key(t)
            if key is None or (g is not None and key in g.fresh):
                continue
            site = site or _site()
            if g is None:
                self._access(ctx, key, *_span(t), written, site)
            else:
                g.order_accesses.append((key, *_span(t), written, site))

    def _describe(self, a: _Access, at: bool = True) -> str:
        what = f"{'write' if a.write else 'read'} on {self.name(a.ctx)}"
        what += f" at {_where(a.site)}" if at else ""
        return what + (f" (graph replay of {_where(a.captured)})" if a.captured else "")

    def _access(
        self, ctx: int, key: tuple, lo: int, hi: int, write: bool, site: Site, captured: Site = None
    ) -> None:
        self.accesses += 1
        clock = self.enqueued(ctx)
        clock[ctx] += 1
        new = _Access(ctx, clock[ctx], write, lo, hi, site, captured)
        kept = []
        for old in self.history.get(key, []):
            if old.lo < hi and lo < old.hi and (write or old.write) and old.ctx != ctx:
                if clock.get(old.ctx, 0) < old.tick:  # the finding's line is the new access's
                    what = f"{self._describe(new, at=False)} unordered with the earlier "
                    self.fc._flag("race", what + self._describe(old), site)
            # An earlier access of this context that this one covers finds no race the new
            # one would not (anything unordered after it is unordered after this one too).
            if not (old.ctx == ctx and lo <= old.lo and old.hi <= hi and (write or not old.write)):
                kept.append(old)
        kept.append(new)
        self.history[key] = kept[-_HISTORY:]

    def replay(self, graph: FakeGraph) -> None:
        """The captured accesses, made again on the current stream."""
        ctx, site = torch.cuda.current_stream().stream_id, _site()
        for key, lo, hi, written, captured in graph.order_accesses:
            self._access(ctx, key, lo, hi, written, site, captured)


# -- the torch.cuda stand-ins ------------------------------------------------------------------
class FakeStream:
    """``torch.cuda.Stream``: ordering calls only tell the stream order; ``synchronize`` is a
    host wait, ``query`` is True (done)."""

    def __init__(self, fc: FakeCuda, device: Any = None, priority: int = 0, **_: Any) -> None:
        self._fc, self.device, self.priority = fc, fc.device, priority
        self.stream_id = next(fc._stream_ids)

    def wait_stream(self, stream: FakeStream) -> None:
        self._fc._order.wait(self, self._fc._order.clock(stream.stream_id))

    def wait_event(self, event: FakeEvent) -> None:
        self._fc._order.wait(self, event.clock)  # never recorded: orders nothing, as in CUDA

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent(self._fc)
        event.record(self)
        return event

    def _covered(self) -> dict[int, int] | None:
        return self._fc._order.clock(self.stream_id)

    def query(self) -> bool:
        self._fc._order.host_joins(self._covered())
        return True

    def synchronize(self) -> None:
        self._fc._host_wait(f"{type(self).__name__.removeprefix('Fake')}.synchronize()", False)
        self._fc._order.host_joins(self._covered())

    def __repr__(self) -> str:
        return f"<FakeStream {self.stream_id}>"


class FakeEvent:
    """``torch.cuda.Event``: ``record``/``wait``/``query`` never wait; ``synchronize`` does."""

    def __init__(self, fc: FakeCuda, enable_timing: bool = False, **_: Any) -> None:
        self._fc, self.enable_timing = fc, enable_timing
        self.clock: dict[int, int] | None = None  # with order=True: what it covers

    def record(self, stream: FakeStream | None = None) -> None:
        self._fc._order.record(self, stream or torch.cuda.current_stream())

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or torch.cuda.current_stream()).wait_event(self)

    def _covered(self) -> dict[int, int] | None:
        return self.clock

    query, synchronize = FakeStream.query, FakeStream.synchronize

    def elapsed_time(self, end: FakeEvent) -> float:
        return REHEARSAL_EVENT_MS if self._fc.rehearsal else 0.0


class FakeGraph:
    """``torch.cuda.CUDAGraph``: capture records the operations run under it (launches and
    bytes, replayed by :meth:`replay`); what they allocate is the graph's pool."""

    def __init__(self, fc: FakeCuda, *_: Any, **__: Any) -> None:
        self._fc = fc
        self.reset()

    @property
    def launches(self) -> int:
        return sum(n for n, _ in self.by_op.values())

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.by_op.values())

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if self._fc._capture is not None:
            raise RuntimeError("FakeCuda: a graph capture is already in progress")
        self._fc._capture, self.order_accesses, self.fresh = self, [], set()

    def capture_end(self) -> None:
        self._fc._capture, self.captured = None, True

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("FakeCuda: replay() of a CUDAGraph that was never captured")
        self._fc._replay(self)

    def reset(self) -> None:
        self.by_op: dict[str, list[int]] = {}  # operation -> [launches, bytes] captured
        self.captured = False
        self.order_accesses: list[tuple] = []  # with order=True: what a replay accesses
        self.fresh: set[tuple[str, int]] = set()  # storage of the graph's pool: not followed
        self.ops: list[tuple] = []  # on a computing device: what a replay runs again

    def pool(self) -> object:
        return object()


def _cuda_stubs(fc: FakeCuda) -> dict[str, Any]:
    """The ``torch.cuda`` attributes to install while ``fc`` is active."""
    local = threading.local()  # the current stream is per thread, as in CUDA

    def current_stream(device: Any = None) -> FakeStream:
        return getattr(local, "stream", fc.default_stream)

    def set_stream(stream: FakeStream | None) -> None:
        if stream is not None:
            local.stream = stream

    @contextlib.contextmanager
    def on_stream(s: FakeStream | None) -> Iterator[None]:
        prev = current_stream()
        local.stream = s or prev
        try:
            yield
        finally:
            if s is not None:
                local.stream = prev

    def synchronize(device: Any = None, what: str = "torch.cuda.synchronize()") -> None:
        fc._host_wait(what, joins_current=False)
        fc._order.host_joins_all()

    @contextlib.contextmanager
    def graph(
        cuda_graph: FakeGraph, pool: Any = None, stream: FakeStream | None = None, **_: Any
    ) -> Iterator[FakeGraph]:
        synchronize(what="torch.cuda.graph() (synchronizes the device before capture)")
        with on_stream(stream or FakeStream(fc)):
            cuda_graph.capture_begin()
            try:
                yield cuda_graph
            finally:
                cuda_graph.capture_end()

    props = SimpleNamespace(name=fc.device_name, total_memory=fc.total_memory, major=9, minor=0)
    props.multi_processor_count = 132
    stubs = {
        "Stream": lambda *a, **k: FakeStream(fc, *a, **k),
        "Event": lambda *a, **k: FakeEvent(fc, *a, **k),
        "CUDAGraph": lambda *a, **k: FakeGraph(fc, *a, **k),
        "graph": graph,
        "graph_pool_handle": lambda: object(),
        "stream": on_stream,
        "current_stream": current_stream,
        "default_stream": lambda device=None: fc.default_stream,
        "set_stream": set_stream,
        # A bound method: the process-wide patch names its FakeCuda (fake_cuda.active).
        "is_available": fc.is_available,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: synchronize(),
        "mem_get_info": lambda device=None: (fc.total_memory, fc.total_memory),
        "get_device_name": lambda device=None: fc.device_name,
        "get_device_capability": lambda device=None: (props.major, props.minor),
        "get_device_properties": lambda device=None: props,
        "set_sync_debug_mode": fc.set_sync_debug_mode,
        "get_sync_debug_mode": lambda: fc.sync_debug_mode,
        "empty_cache": lambda: None,
    }
    if fc.rehearsal:  # frees are not seen: a script's memory readings are 0 in a rehearsal
        stubs["memory_allocated"] = stubs["max_memory_allocated"] = lambda device=None: 0
        stubs["reset_peak_memory_stats"] = lambda device=None: None
    return stubs


def _tensor_stubs(fc: FakeCuda) -> dict[str, Any]:
    """The ``torch.Tensor`` methods to install while ``fc`` is active."""
    setitem, tolist, make = torch.Tensor.__setitem__, torch.Tensor.tolist, torch.tensor

    def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        if self.device.type != "cpu":
            raise RuntimeError(f"cannot pin a {self.device} tensor: only CPU tensors can be pinned")
        if fc.is_pinned(self):
            return self
        out = self.clone()
        fc.mark_pinned(out)
        return out

    def numpy(self: torch.Tensor, *, force: bool = False) -> np.ndarray:
        if fc.is_fake(self):
            fc._host_wait("Tensor.numpy()")
            return np.ones(tuple(self.shape), dtype=torch.empty(0, dtype=self.dtype).numpy().dtype)
        # The array shares the memory: the host may read or fill it.
        fc._order.tensors(False, [(self, True)])
        return torch._C.TensorBase.numpy(self, force=force)

    def to_list(self: torch.Tensor) -> Any:
        if not fc.is_fake(self):  # a host tensor's values are read in C++, out of sight
            fc._order.tensors(False, [(self, False)])
        return tolist(self)

    def set_item(self: torch.Tensor, index: Any, value: Any) -> None:
        # On CUDA, setitem turns a Python number into a CPU tensor, which an advanced index
        # then copies from pageable memory: do as CUDA does so the checker sees it.
        if isinstance(value, (bool, int, float, complex)) and fc.is_fake(self):
            if not self.dtype.is_complex:
                value = make(value, dtype=self.dtype)
        setitem(self, index, value)

    return {
        "pin_memory": pin_memory,
        "is_pinned": lambda self, device=None: fc.is_pinned(self),
        "record_stream": lambda self, stream: None,
        "numpy": numpy,
        "tolist": to_list,
        "__setitem__": set_item,
    }


def _torch_stubs(fc: FakeCuda) -> dict[str, Any]:
    """The ``torch`` factories that copy in C++, out of a dispatch mode's sight; in a
    rehearsal also ``Generator`` (meta has none) and ``compile`` (a no-op)."""

    def wrap(name: str) -> Any:
        orig = getattr(torch, name)

        def factory(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            dev, fake = kwargs.get("device"), _tensor(data) and fc.is_fake(data)
            if fake or dev is None or torch.device(dev) != fc.device:
                return orig(data, *args, **kwargs)
            # Made on the host, then copied from pageable memory (CUDA does both in C++).
            grad = kwargs.pop("requires_grad", False)
            out = orig(data, *args, **{**kwargs, "device": "cpu"}).to(fc.device)
            return out.requires_grad_() if grad else out

        return factory

    stubs = {name: wrap(name) for name in ("tensor", "as_tensor", "asarray")}
    if not fc.rehearsal:
        return stubs
    real = torch.Generator

    class Generator(real):  # type: ignore[misc, valid-type]
        def __new__(cls, device: Any = "cpu") -> torch.Generator:
            dev = torch.device(device)
            return real.__new__(cls, "cpu" if dev == fc.device else dev)

        def __init__(self, *_: Any, **__: Any) -> None:
            pass

    return {**stubs, "Generator": Generator, "compile": lambda model, *a, **k: model}


def _scalar_to_meta(t: Any) -> Any:
    if _tensor(t) and t.device.type == "cpu" and t.dim() == 0:
        return torch.empty((), dtype=t.dtype, device="meta")
    return t


def _on_host_ones(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on host stand-ins of its device arguments, all ones (masks all True:
    value-dependent shapes at their maximum); tensor results go back to the device."""

    def to_host(t: Any) -> Any:
        return torch.ones(t.shape, dtype=t.dtype) if _tensor(t) and t.device.type == "meta" else t

    out = func(*tree_map(to_host, args), **tree_map(to_host, kwargs))
    if func._schema.returns and func._schema.returns[0].alias_info is not None:
        return args[0]  # in place: the device tensor itself
    return tree_map(
        lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta") if _tensor(t) else t, out
    )


class _Mode(TorchDispatchMode):
    """Hands every aten operation to ``on(mode, func, args, kwargs)``."""

    def __init__(self, on: Callable[..., Any]) -> None:
        super().__init__()
        self.on = on

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.on(self, func, args, kwargs or {})


# -- the device --------------------------------------------------------------------------------
class FakeCuda:
    """The fake device and its record: ``order=True`` adds race checks, ``rehearsal=True``
    lets a script that measures run, ``device="cpu"`` computes instead (nothing checked)."""

    def __init__(
        self,
        device_name: str = "FakeCuda (meta)",
        order: bool = False,
        rehearsal: bool = False,
        kernels: Mapping[str, Callable[..., Any]] | None = None,
        device: torch.device | str = "meta",
    ):
        self.device = torch.device(device)
        self.computes = self.device.type != "meta"
        self.total_memory = 80 * 2**30
        self.device_name = device_name
        self.rehearsal = rehearsal
        # Operator name -> its CUDA implementation, run before the operator's meta kernel.
        self.kernels = dict(kernels or {})
        self.sync_debug_mode: int | str = 0
        self.sync_windows: list[dict[str, Any]] = []
        self._window: str | None = None  # where the sync debug mode was switched on
        self._sync_seen: Counter[Finding] = Counter()  # its host waits and pageable copies
        self.launches_built: dict[str, int] = {}
        self.launch_configs: dict[str, dict[str, Any]] = {}
        self.phase = "construction"
        self._lock = threading.RLock()
        self._findings: dict[tuple, Finding] = {}
        self._phase_stats = {p: _stats() for p in PHASES}
        self._by_op: dict[str, dict[str, list[int]]] = {p: {} for p in PHASES}
        self._per_step: list[dict[str, Any]] = []
        self._step: dict[str, Any] | None = None
        self._capture: FakeGraph | None = None
        self._pinned = WeakTensorKeyDictionary()
        self._pinned_at: dict[int, Any] = {}  # storage address -> pinned storage
        self._patches = contextlib.ExitStack()
        self._quiet = threading.local()
        self._stream_ids = itertools.count()
        self.default_stream = FakeStream(self)
        self._cublas_streams = {self.default_stream.stream_id}
        self.order = StreamOrder(self) if order else None
        self._order: Any = self.order or _Off()

    # -- entering and leaving ---------------------------------------------------------
    def __enter__(self) -> FakeCuda:
        if active() is not None:  # the patches are process-wide
            raise RuntimeError("a FakeCuda is already active; nest none and share none")
        # Made before any is installed: the Tensor stubs keep the original torch.tensor.
        stubs = (_cuda_stubs(self), _tensor_stubs(self), _torch_stubs(self))
        try:
            for owner, attrs in zip((torch.cuda, torch.Tensor, torch), stubs, strict=True):
                self.patch(owner, attrs)
            self._patches.enter_context(_Mode(self._dispatch))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._pinned_at.clear()
        self._patches.close()  # the dispatch mode first, then the patches

    def patch(self, owner: Any, attrs: dict[str, Any]) -> None:
        """Set ``owner``'s attributes while this device is active (put back on exit)."""
        self._patches.enter_context(mock.patch.multiple(owner, **attrs))

    def is_available(self) -> bool:
        return True

    # -- phases -------------------------------------------------------------------------
    def start_steps(self) -> None:
        """From now on findings are failures (construction is over)."""
        self.phase = "steps"

    @contextlib.contextmanager
    def steps(self) -> Iterator[None]:
        """The steps phase for the block; after it, the teardown phase (not failures)."""
        self.start_steps()
        try:
            yield
        finally:
            self.phase = "teardown"

    @contextlib.contextmanager
    def step(self) -> Iterator[dict[str, Any]]:
        """One step (starts the steps phase): its counts are one entry of ``per_step``."""
        self.start_steps()
        self._step = _stats()
        self._per_step.append(self._step)
        try:
            yield self._step
        finally:
            self._step = None

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Operations of this thread in the block are neither checked nor counted."""
        prev = getattr(self._quiet, "on", False)
        self._quiet.on = True
        try:
            yield
        finally:
            self._quiet.on = prev

    # -- pinned host memory -------------------------------------------------------------
    def is_fake(self, t: torch.Tensor) -> bool:
        return t.device.type == "meta"

    def mark_pinned(self, t: torch.Tensor) -> None:
        self._pinned[t] = True
        # A view made in inference mode has no ``_base``: found by its storage instead
        # (kept alive here, so its address is not reused).
        storage = t.untyped_storage()
        if storage.nbytes():  # an empty one has no address of its own
            self._pinned_at[storage.data_ptr()] = storage
        self._order.fresh(t)

    def is_pinned(self, t: torch.Tensor) -> bool:
        # A view of a pinned tensor keeps its base (and so the pinned storage) alive.
        if t in self._pinned or (t._base is not None and t._base in self._pinned):
            return True
        if t.device.type != "cpu":
            return False
        storage = t.untyped_storage()
        return bool(storage.nbytes()) and storage.data_ptr() in self._pinned_at

    # -- the sync debug mode and launches built ------------------------------------------
    def set_sync_debug_mode(self, mode: int | str) -> None:
        """As on a GPU, under ``"error"`` a host wait or pageable copy raises. Each window
        from switching it on to off is kept in ``sync_windows`` with what was seen."""
        self.sync_debug_mode = mode
        on = mode in ("warn", "error", 1, 2)
        if on and self._window is None:
            file, line, _ = site_parts(_site())
            self._window = f"{os.path.basename(file)}:{line}"
        elif not on and self._window is not None:
            seen, at = self._sync_seen, self._window
            sites = [f"{f.kind} at {f.where}: {f.code} x{n}" for f, n in seen.items()]
            self.sync_windows.append(
                {"set_at": at, "host_waits_and_pageable_copies": seen.total(), "sites": sites}
            )
            self._window, self._sync_seen = None, Counter()

    def launch_built(self, kernel: str, config: dict[str, Any]) -> None:
        """A kernel launch built, not run (meta tensors have no data): counted, each
        distinct ``config`` kept in ``launch_configs``."""
        self.launches_built[kernel] = self.launches_built.get(kernel, 0) + 1
        self.launch_configs.setdefault(repr(config), config)

    # -- recording ----------------------------------------------------------------------
    def _count(self, key: str, n: int = 1, phase: str | None = None) -> None:
        phase = phase or self.phase
        with self._lock:
            self._phase_stats[phase][key] += n
            if self._step is not None and phase == "steps":
                self._step[key] += n

    def _flag(self, kind: str, what: str, site: Site = None) -> None:
        file, line, function = site_parts(site or _site())
        in_capture = self._capture is not None
        key = (self.phase, kind, what, file, line, in_capture)
        with self._lock:
            self._count(kind)
            f = self._findings.get(key)
            if f is not None:
                f.count += 1
            else:
                code = linecache.getline(file, line).strip() if line else ""
                f = self._findings[key] = Finding(
                    kind, what, file, line, function, code, self.phase, in_capture
                )
            if kind in _SYNC_KINDS and self._window is not None:  # kept for the open window
                self._sync_seen[f] += 1
        if kind in _SYNC_KINDS and self.sync_debug_mode in ("error", 2):
            raise RuntimeError(
                f"FakeCuda: {kind} ({what}) under set_sync_debug_mode('error'): on a GPU, "
                "'called a synchronizing CUDA operation'"
            )

    def _host_wait(self, what: str, joins_current: bool = True) -> None:
        """``joins_current``: the host waits for the current stream (else the caller orders)."""
        self._flag("host_wait", what)
        if joins_current:
            self._order.host_joins(self._order.clock(torch.cuda.current_stream().stream_id))

    def _launch(self, op: str, nbytes: int, n: int = 1) -> None:
        with self._lock:
            if self._capture is not None:  # recorded, run by each replay
                by_op = self._capture.by_op
            else:
                self._count("launches", n)
                self._count("bytes", nbytes)
                by_op = self._by_op[self.phase]
            counts = by_op.setdefault(op, [0, 0])
            counts[0] += n
            counts[1] += nbytes

    def _replay(self, graph: FakeGraph) -> None:
        self._count("graph_replays")
        if self.computes:
            with torch.no_grad():
                for func, args, kwargs, out in graph.ops:
                    new = tree_leaves(fresh_outputs(func, func(*args, **kwargs)))
                    for o, n in zip(tree_leaves(fresh_outputs(func, out)), new, strict=True):
                        if _tensor(o):  # into the captured storage, as CUDA
                            o.copy_(n)
        for op, (n, nbytes) in graph.by_op.items():
            self._launch(op, nbytes, n)
        self._order.replay(graph)

    # -- the checks: every aten operation ---------------------------------------------------
    def _dispatch(self, mode: _Mode, func: Any, args: tuple, kwargs: dict) -> Any:
        name, rule = _name(func), RULES.get(_name(func), NONE)
        pin = bool(kwargs.get("pin_memory"))
        if pin:  # a CPU-only build has no pinned allocator: mark the host tensor instead
            kwargs = {**kwargs, "pin_memory": False}
        if getattr(self._quiet, "on", False):
            return func(*args, **kwargs)
        if self.computes:
            out = func(*args, **kwargs)
            if self._capture is not None and moves_data(func):
                self._capture.ops.append((func, args, kwargs, out))  # replayed into ``out``
            return out
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            # Under inference mode composite operations (``to``, ``item``...) reach the mode
            # whole: taken apart, the mode sees what they are made of.
            with mode:  # the parts come back to this mode
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        leaves = [t for t in tree_leaves((args, kwargs)) if _tensor(t)]
        fake, kernel = any(self.is_fake(t) for t in leaves), self.kernels.get(func._schema.name)
        if kernel is not None and fake:
            with mode:  # its checks and the launch it builds, seen as on the device
                kernel(*args, **kwargs)
        dev = kwargs.get("device")
        if not fake and (dev is None or torch.device(dev) != self.device):
            out = func(*args, **kwargs)
            self._order.operation(False, func, args, kwargs, out)  # the host on pinned memory
            if pin:
                self.mark_pinned(out)
            return out  # host work
        if rule.does == COPY:
            return self._copy(func, name, args, kwargs)
        if host_wait_kind(func, args, kwargs):
            out = _on_host_ones(func, args, kwargs)
            self._account(func, name, args, kwargs, out)
            # After the operation's accesses: the host waits for it too.
            self._host_wait(f"aten.{name} (its result needs the values on the host)")
            return out
        host = [t for t in leaves if t.device.type == "cpu"]
        # A 0-dim host tensor is a kernel argument of these (no copy).
        scalar_ok = rule.does == SCALAR or torch.Tag.pointwise in func.tags
        if any(t.dim() or not (scalar_ok or name.startswith("_foreach_")) for t in host):
            self._flag("pageable_copy", f"aten.{name} with a host tensor argument")
        elif host and rule.does == SCALAR:  # CUDA reads the value; meta wants a device one
            args, kwargs = tree_map(_scalar_to_meta, (args, kwargs))
        out = func(*args, **kwargs)
        self._account(func, name, args, kwargs, out)
        return out

    def _copy(self, func: Any, name: str, args: tuple, kwargs: dict) -> Any:
        src, dst = (args[1], args[0]) if name == "copy_" else (args[0], None)
        to = dst.device if dst is not None else torch.device(kwargs.get("device") or src.device)
        non_blocking = kwargs.get("non_blocking", len(args) > 2 and args[2])  # copy_(dst, src, nb)
        if self.is_fake(src) and to.type == "cpu":
            self._launch(f"aten.{name}", 2 * tensor_bytes(src))
            self._order.tensors(True, [(src, False)] + ([(dst, True)] if dst is not None else []))
            if copy_rule(False, non_blocking, dst is not None and self.is_pinned(dst))[0]:
                self._host_wait(f"aten.{name} device -> host")
            if dst is not None:
                return dst.fill_(1)  # what the host reads back: ones, as below
            return torch.ones(src.shape, dtype=kwargs.get("dtype") or src.dtype)
        waits = False
        if src.device.type == "cpu" and to == self.device:
            waits, pageable = copy_rule(True, non_blocking, self.is_pinned(src))
            if pageable:  # flagged as such, not also as a wait
                waits = False
                self._flag("pageable_copy", f"aten.{name} host -> device from pageable memory")
        out = func(*args, **kwargs)
        self._account(func, name, args, kwargs, out)
        if waits:  # after the copy's accesses: the host waits for it
            self._host_wait(f"aten.{name} host -> device, blocking")
        return out

    def _account(self, func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        self._order.operation(True, func, args, kwargs, out)
        if moves_data(func):
            self._launch(f"aten.{name}", op_bytes(func, args, kwargs, out))
        pool = "construction" if self._capture is not None else None  # a graph's, at capture
        for t in tree_leaves(fresh_outputs(func, out)):
            nbytes = tensor_bytes(t) if _tensor(t) and self.is_fake(t) else 0
            if nbytes and pool:
                self._count("allocation", phase=pool)
            elif nbytes:
                self._flag("allocation", f"aten.{name}")
            self._count("allocated_bytes", nbytes, phase=pool)
        s = torch.cuda.current_stream() if RULES.get(name, NONE).does == MATMUL else None
        if s is not None and s.stream_id not in self._cublas_streams:
            self._cublas_streams.add(s.stream_id)
            if self.phase != "construction":  # cuBLAS's workspace for that stream, then
                self._flag("first_cublas", f"first matrix product on {s!r}")

    # -- results ------------------------------------------------------------------------
    def findings(self, phase: str | None = "steps", kind: str | None = None) -> list[Finding]:
        """Findings, deduplicated by kind, what and source line (``count``: occurrences)."""
        with self._lock:
            return [
                f
                for f in self._findings.values()
                if (phase is None or f.phase == phase) and (kind is None or f.kind == kind)
            ]

    def failures(self) -> list[Finding]:
        """Findings in the steps, any host wait or copy inside a graph capture (on a GPU
        the capture itself fails) and every race (a wrong value in any phase)."""
        return [
            f
            for f in self.findings(None)
            if f.phase == "steps" or f.kind == "race" or (f.in_capture and f.kind in _SYNC_KINDS)
        ]

    def report(self) -> dict[str, Any]:
        """Per phase: the counts, ``by_op`` (launches and bytes, most bytes first) and the
        findings; ``steps`` also has ``per_step``. JSON-able."""
        with self._lock:
            out: dict[str, Any] = {}
            for p in PHASES:
                out[p] = dict(self._phase_stats[p])
                by_op = sorted(self._by_op[p].items(), key=lambda kv: -kv[1][1])
                out[p]["by_op"] = {op: {"launches": n, "bytes": b} for op, (n, b) in by_op}
                out[p]["findings"] = [{**asdict(f), "where": f.where} for f in self.findings(p)]
            out["steps"]["per_step"] = [dict(s) for s in self._per_step]
            return out

    def assert_clean(self) -> None:
        """Raise an AssertionError listing every failure with its source line."""
        bad = self.failures()
        if not bad:
            return
        lines = [f"FakeCuda: {len(bad)} finding(s) that would stall, allocate or race on a GPU:"]
        for f in bad:
            cap = " (in a graph capture)" if f.in_capture else ""
            lines += [f"  {f.kind}: {f.what} at {f.where} x{f.count}{cap}", f"      {f.code}"]
        raise AssertionError("\n".join(lines))

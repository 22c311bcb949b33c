"""Stream-ordering checks of :class:`~tllm_core.testing.fake_cuda.FakeCuda` (``order=True``): a
vector clock per context (the host, each stream); two overlapping accesses from different
contexts, one a write, neither ordered before the other, are a race (docs/fake-cuda.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from tllm_core.testing.fake_cuda_checker import NO_DATA

HOST = -1  # the host's context; a stream's is its stream_id
# Past this many accesses kept per storage, the oldest are dropped (a race with one of
# them is then missed; a step touches each buffer a few times).
_HISTORY = 256

Clock = dict[int, int]
# Where an access was made: (code, line) of the first frame outside torch and this package,
# formatted only when a race is reported.
Site = tuple[CodeType, int] | None
# A storage: ("device", StorageImpl address) or ("pinned", host address).
Key = tuple[str, int]


def site_parts(site: Site) -> tuple[str, int, str]:
    """``(file, line, function)``, the file relative to the working directory if under it."""
    if site is None:
        return ("?", 0, "?")
    code, line = site
    path = code.co_filename
    rel = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
    return (rel, line, code.co_name)


def _where(site: Site) -> str:
    return ":".join(map(str, site_parts(site)))


@dataclass
class _Access:
    ctx: int
    tick: int
    write: bool
    lo: int
    hi: int
    site: Site
    captured: Site = None  # a replayed access: where the capture made it

    def describe(self, names: Callable[[int], str], at: bool = True) -> str:
        what = f"{'write' if self.write else 'read'} on {names(self.ctx)}"
        if at:
            what += f" at {_where(self.site)}"
        if self.captured is not None:
            what += f" (graph replay of {_where(self.captured)})"
        return what


def _merge(into: Clock, other: Clock) -> None:
    for ctx, t in other.items():
        if into.get(ctx, 0) < t:
            into[ctx] = t


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage ``t`` may touch: from its first element to its last (a
    strided view's gaps included)."""
    size = t.element_size()
    lo = t.storage_offset() * size
    if t.numel() == 0:
        return lo, lo
    extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    return lo, lo + extent * size


class StreamOrder:
    """The clocks and the accesses of one :class:`FakeCuda`. ``report(what, site)`` is called
    once per race; ``site()`` says where the code under test is."""

    def __init__(
        self,
        is_pinned: Callable[[torch.Tensor], bool],
        report: Callable[[str, Site], None],
        site: Callable[[], Site],
        default_stream_id: int,
    ) -> None:
        self._is_pinned = is_pinned
        self._site = site
        self._report = report
        self._default = default_stream_id
        self._clocks: dict[int, Clock] = {HOST: {HOST: 0}}
        self._history: dict[Key, list[_Access]] = {}
        self._capture: list[tuple[Key, int, int, bool, Site]] | None = None
        self._capture_fresh: set[Key] = set()
        self.accesses = 0

    # -- contexts and clocks ------------------------------------------------------------
    def name(self, ctx: int) -> str:
        if ctx == HOST:
            return "the host"
        return "the default stream" if ctx == self._default else f"stream {ctx}"

    def _clock(self, ctx: int) -> Clock:
        clock = self._clocks.get(ctx)
        if clock is None:
            clock = self._clocks[ctx] = {ctx: 0}
        return clock

    def _enqueued(self, ctx: int) -> Clock:
        """``ctx``'s clock for work queued now: after all the host has done so far."""
        clock = self._clock(ctx)
        if ctx != HOST:
            _merge(clock, self._clocks[HOST])
        return clock

    def wait_stream(self, waiter: Any, other: Any) -> None:
        """``waiter.wait_stream(other)``: later work on ``waiter`` after all queued on ``other``."""
        if self._capture is None:
            _merge(self._enqueued(waiter.stream_id), self._clock(other.stream_id))

    def record(self, event: Any, stream: Any) -> None:
        """``event.record(stream)``: the event completes after all queued on ``stream``."""
        if self._capture is None:
            event._order_clock = dict(self._enqueued(stream.stream_id))

    def wait_event(self, stream: Any, event: Any) -> None:
        """``stream.wait_event(event)`` (a never-recorded event orders nothing, as in CUDA)."""
        clock = getattr(event, "_order_clock", None)
        if clock is not None and self._capture is None:
            _merge(self._enqueued(stream.stream_id), clock)

    def host_joins_event(self, event: Any) -> None:
        """The host saw ``event`` complete (``query()`` True, ``synchronize()``)."""
        clock = getattr(event, "_order_clock", None)
        if clock is not None:
            _merge(self._clocks[HOST], clock)

    def host_joins_stream(self, stream: Any) -> None:
        """The host waited for everything queued on ``stream``."""
        _merge(self._clocks[HOST], self._clock(stream.stream_id))

    def host_joins_all(self) -> None:
        """The host waited for the whole device."""
        for clock in list(self._clocks.values()):
            _merge(self._clocks[HOST], clock)

    # -- storage ------------------------------------------------------------------------
    def _key(self, t: torch.Tensor) -> Key | None:
        if t.device.type == "meta":
            return ("device", t.untyped_storage()._cdata)
        if t.device.type == "cpu" and self._is_pinned(t):
            return ("pinned", t.untyped_storage().data_ptr())
        return None

    def fresh(self, t: torch.Tensor) -> None:
        """``t`` is new storage: what was at its address before is forgotten."""
        key = self._key(t)
        if key is None:
            return
        if self._capture is not None:
            self._capture_fresh.add(key)  # the graph's pool: not followed
        else:
            self._history.pop(key, None)

    def operation(self, on_device: bool, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """An aten operation: its tensor arguments are read (written where the schema says
        so), its new outputs written (``empty`` & co. only new). ``on_device``: on the current
        stream, else on the host."""
        if func.is_view:
            return
        no_data = func._schema.name.split("::")[-1] in NO_DATA
        schema = func._schema
        touched: list[tuple[torch.Tensor, bool]] = []
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written = arg.alias_info is not None and arg.alias_info.is_write
            touched += [(t, written) for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for ret, o in zip(schema.returns, outs, strict=False):
            if ret.alias_info is None and isinstance(o, torch.Tensor):
                self.fresh(o)
                if not no_data:
                    touched.append((o, True))
        self.tensors(on_device, touched)

    def tensors(self, on_device: bool, touched: list[tuple[torch.Tensor, bool]]) -> None:
        """Accesses ``(tensor, written)`` made now by the current stream or the host."""
        site: Site = None
        ctx = torch.cuda.current_stream().stream_id if on_device else HOST
        for t, written in touched:
            key = self._key(t)
            if key is None:
                continue
            if site is None:
                site = self._site()
            lo, hi = _span(t)
            if self._capture is not None and on_device:
                if key not in self._capture_fresh:
                    self._capture.append((key, lo, hi, written, site))
                continue
            self._access(ctx, key, lo, hi, written, site)

    def host_access(self, t: torch.Tensor, written: bool) -> None:
        """The host reads (or fills) ``t`` outside aten: ``.tolist()``, ``.numpy()``."""
        self.tensors(False, [(t, written)])

    def _access(
        self, ctx: int, key: Key, lo: int, hi: int, write: bool, site: Site, captured: Site = None
    ) -> None:
        self.accesses += 1
        clock = self._enqueued(ctx)
        clock[ctx] += 1
        new = _Access(ctx, clock[ctx], write, lo, hi, site, captured)
        history = self._history.setdefault(key, [])
        kept = []
        for old in history:
            overlap = old.lo < hi and lo < old.hi
            if (
                overlap
                and (write or old.write)
                and old.ctx != ctx
                and clock.get(old.ctx, 0) < old.tick
            ):
                # The finding's line is the new access's: the message names the earlier one.
                what = f"{new.describe(self.name, at=False)} unordered with the earlier "
                what += old.describe(self.name)
                self._report(what, site)
            # An earlier access of this context that this one covers finds no race the new
            # one would not (anything unordered after it is unordered after this one too).
            if not (old.ctx == ctx and lo <= old.lo and old.hi <= hi and (write or not old.write)):
                kept.append(old)
        kept.append(new)
        self._history[key] = kept[-_HISTORY:]

    # -- graphs -------------------------------------------------------------------------
    def begin_capture(self) -> None:
        self._capture, self._capture_fresh = [], set()

    def end_capture(self, graph: Any) -> None:
        graph.order_accesses = self._capture or []
        self._capture, self._capture_fresh = None, set()

    def replay(self, graph: Any) -> None:
        """The captured accesses, made again on the current stream."""
        ctx = torch.cuda.current_stream().stream_id
        site = self._site()
        for key, lo, hi, written, captured in getattr(graph, "order_accesses", ()):
            self._access(ctx, key, lo, hi, written, site, captured)

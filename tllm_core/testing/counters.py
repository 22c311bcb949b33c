"""Host waits and bytes an operation sequence would cost on a GPU, counted on real tensors
by the fake device's rule table (:data:`.fake_cuda.RULES`); other threads are not counted."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from tllm_core.testing.fake_cuda import _name, copy_rule, host_wait_kind, moves_data, op_bytes


class SyncCounter(TorchDispatchMode):
    """``with SyncCounter() as c: ...`` then ``c.total`` / ``c.kinds`` (a Counter by kind)."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = host_wait_kind(func, args, kwargs)
        if kind is None and _name(func) in ("_to_copy", "copy_"):
            src, dst = (args[1], args[0]) if _name(func) == "copy_" else (args[0], out)
            if (src.device.type == "cpu") != (dst.device.type == "cpu"):
                non_blocking = kwargs.get("non_blocking", len(args) > 2 and args[2] is True)
                host = src if src.device.type == "cpu" else dst
                if copy_rule(host is src, bool(non_blocking), host.is_pinned())[0]:
                    kind = "host_device_copy"
        if kind is not None:
            self.kinds[kind] += 1
        return out


class BytesCounter(TorchDispatchMode):
    """``with BytesCounter() as c: ...`` then ``c.total`` (bytes), ``c.by_op`` (bytes by
    operation name) and ``c.calls`` (operations counted: a launch each)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.calls = 0

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if moves_data(func):
            self.by_op[_name(func)] += op_bytes(func, args, kwargs, out)
            self.calls += 1
        return out


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Largest sum of live allocations made inside ``fn``, from the torch profiler's memory
    events (CPU has no ``max_memory_allocated``)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak

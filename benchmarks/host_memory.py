"""Peak bytes the CPU allocator hands out during a call, read from the torch profiler's
memory events (CPU has no ``max_memory_allocated``). Torch only."""

from __future__ import annotations

from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Largest sum of live allocations made inside ``fn`` (allocations made before the call
    are not counted; those still alive after it are)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak

"""The CPUs this process may use, as they were before vLLM pinned its threads: a tllm side
thread widens its affinity to this set, never beyond it."""

from __future__ import annotations

import os

# Process-wide by nature: vLLM's pin lasts as long as the process, so the first note is kept.
_noted: frozenset[int] | None = None


def note_allowed_cpus() -> None:
    """Remember the calling thread's CPUs (call before vLLM pins threads; first call wins)."""
    global _noted
    if _noted is None and hasattr(os, "sched_getaffinity"):
        _noted = frozenset(os.sched_getaffinity(0))


def allowed_cpus() -> set[int]:
    """The noted set, else the calling thread's current CPUs (nothing to widen to)."""
    if _noted is not None:
        return set(_noted)
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))

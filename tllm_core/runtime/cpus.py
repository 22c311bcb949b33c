"""The CPUs this process may use, as they were before vLLM pinned its threads.

vLLM's CPU worker binds its threads (the calling one included) to the cores it picks when
the device is initialised; a thread started later inherits that pin. A tllm side thread that
should use the cores the model leaves idle widens its affinity to the set noted here, just
before that happens: the process's allowed set (``taskset``, a container's cpuset), never
more than that.
"""

from __future__ import annotations

import os

# Process-wide by nature: vLLM's pin of a thread lasts as long as the process (a second
# in-process engine would note the pinned set), so the first note is kept for the process;
# side threads that read it get no worker object. Immutable once noted.
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

"""A CPU side thread: the CPU counterpart of the CUDA side stream.

Jobs run one at a time, in submission order, on one daemon thread. :meth:`SideThread.wait`
is the event the engine thread waits on before it reads state the jobs write (the next
prediction), so ordering stays strict while the work itself overlaps with the engine.

Why it helps: vLLM's CPU backend runs the model with one OpenMP thread per core it binds
and leaves the rest to its scheduler (on a 2-core machine the model gets one core). The
side thread asks the kernel for the idle-only scheduling class (``SCHED_IDLE``, falling back
to the lowest nice value) and may run on every core the process is allowed, so it soaks up
idle cycles and yields at once when vLLM's own threads want the core. When no core is idle,
the engine thread's :meth:`wait` blocks, its core falls idle, and the job finishes there.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("tllm")

_STOP = object()


def _lower_priority_and_widen_affinity() -> str:
    """Make the calling thread a background thread; returns what was set (for logs)."""
    done = []
    try:  # Linux: the affinity of the calling thread only.
        allowed = set(range(os.cpu_count() or 1))
        os.sched_setaffinity(0, allowed)
        done.append(f"cpus {sorted(os.sched_getaffinity(0))}")
    except (AttributeError, OSError):
        pass
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        done.append("SCHED_IDLE")
    except (AttributeError, OSError):
        try:  # Linux applies setpriority to the calling thread (its task id).
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            done.append("nice 19")
        except (AttributeError, OSError):
            pass
    return ", ".join(done) or "default scheduling"


class SideThread:
    """One background worker thread with a FIFO of jobs and a join point."""

    def __init__(self, name: str = "tllm-side"):
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self.jobs_run = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job``; it runs after every job submitted before it."""
        self._raise()
        self._jobs.put(job)

    def wait(self) -> None:
        """Block until every submitted job has run; re-raise a job's error here."""
        self._jobs.join()
        self._raise()

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            self._thread.join()

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"side-thread job failed: {type(err).__name__}: {err}") from err

    def _loop(self) -> None:
        log.debug("tllm: side thread started (%s)", _lower_priority_and_widen_affinity())
        while True:
            job = self._jobs.get()
            try:
                if job is _STOP:
                    return
                if self._error is None:  # after a failure, skip until the owner has seen it
                    job()
                    self.jobs_run += 1
            except BaseException as e:  # noqa: BLE001 - handed to the engine thread
                self._error = e
            finally:
                self._jobs.task_done()

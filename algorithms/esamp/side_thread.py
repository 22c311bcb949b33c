"""A CPU side thread: the CPU counterpart of the CUDA side stream.

Jobs run one at a time, in submission order, on one daemon thread. :meth:`SideThread.wait`
is the event the engine thread waits on before it reads state the jobs write (the next
prediction), so ordering stays strict while the work itself overlaps with the engine.

Why it helps: vLLM's CPU backend runs the model with one OpenMP thread per core it binds
and leaves the rest to its scheduler (on a 2-core machine the model gets one core). The side
thread may run on every core the process is allowed, so it takes a core the model leaves
idle. It keeps normal priority on purpose: its work is on the critical path of the next
prediction, and a low-priority thread would be starved whenever other work shares the
machine, stalling the engine thread at :meth:`wait` instead.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

from tllm_core import allowed_cpus

log = logging.getLogger("tllm")

_STOP = object()
# Longest wait for the jobs (a training step takes milliseconds to seconds): past it the
# engine thread gives up with an error (the consumer is then switched off) instead of hanging.
WAIT_TIMEOUT_S = 300.0


def _widen_affinity() -> str:
    """Let the calling thread run on every core the process may use (vLLM pins its engine
    thread, and a new thread inherits that pin), not on cores outside the process's allowed
    set (taskset, a container's cpuset); returns what was set, for the log."""
    try:  # Linux: the affinity of the calling thread only.
        os.sched_setaffinity(0, allowed_cpus())
        return f"cpus {sorted(os.sched_getaffinity(0))}"
    except (AttributeError, OSError):
        return "inherited affinity"


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

    def wait(self, timeout: float = WAIT_TIMEOUT_S) -> None:
        """Block until every submitted job has run; re-raise a job's error here. Raises
        ``RuntimeError`` when the jobs have not finished after ``timeout`` seconds."""
        q = self._jobs
        with q.all_tasks_done:
            done = q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout)
        if not done:
            raise RuntimeError(
                f"side thread {self._thread.name!r} has not finished its jobs after "
                f"{timeout:.0f} s ({q.unfinished_tasks} still queued or running)"
            )
        self._raise()

    def close(self, timeout: float = WAIT_TIMEOUT_S) -> None:
        """Stop the thread after its queued jobs, waiting at most ``timeout`` seconds."""
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("tllm: side thread %r did not stop in %.0f s", self._thread.name, timeout)

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"side-thread job failed: {type(err).__name__}: {err}") from err

    def _loop(self) -> None:
        log.debug("tllm: side thread started (%s)", _widen_affinity())
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

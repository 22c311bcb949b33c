"""A CPU side thread, the counterpart of the CUDA side stream: jobs run in order on one
daemon thread, on a core the model leaves idle, and the engine thread waits for them before
reading the state. Normal priority on purpose: its work is on the next prediction's path."""

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
    thread; a new thread inherits the pin); returns what was set, for the log."""
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
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job``; it runs after every job submitted before it."""
        self._raise()
        self._jobs.put(job)

    def wait(self, timeout: float = WAIT_TIMEOUT_S) -> None:
        """Block until every submitted job has run (at most ``timeout``); re-raise a job's error."""
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
            # bounded: an idle worker; every wait on its jobs has a timeout (wait, close)
            job = self._jobs.get()
            try:
                if job is _STOP:
                    return
                if self._error is None:  # after a failure, skip until the owner has seen it
                    job()
            except BaseException as e:  # noqa: BLE001 - handed to the engine thread
                self._error = e
            finally:
                self._jobs.task_done()

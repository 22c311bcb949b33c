"""Why the engine refused to start, told to the process that started it.

vLLM reports a worker that fails while loading the model as "Engine core initialization
failed. See root cause above": the cause is only in the workers' logs. A tllm refusal there (a
tap site that a layer lacks, a consumer that cannot be built on the real model) is written to
a file the front end names in the runtime settings (``start_error_file``); the front end then
raises it as its own one-line error.

vLLM's own failures in those processes (a KV cache that does not fit, a worker that cannot
start) reach the front end only as "see root cause above" too: while a ``TllmLLM`` starts its
engine, the processes it spawns find the note in :data:`ENV` and :class:`FirstErrorLog`
writes into it the first exception vLLM logs there.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

# "{front end pid}:{note path}", set by the front end while its engine starts; the engine
# processes inherit it.
ENV = "TLLM_START_ERROR_FILE"


def record(path: str | None, message: str) -> None:
    """Write ``message`` to ``path`` unless a rank wrote first (the front end may be gone:
    never raises)."""
    if not path:
        return
    try:
        with open(path, "r+", encoding="utf-8") as f:
            if not f.read():
                f.write(message)
    except OSError:
        pass


class StartErrorNote:
    """The front end's side: an empty file for the engine to write into, read after a failed
    start, removed when the start is over."""

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix="tllm-start-", suffix=".txt")
        os.close(fd)

    @contextmanager
    def shared(self) -> Iterator[None]:
        """While the engine starts: :data:`ENV` names this note to the processes it spawns."""
        old = os.environ.get(ENV)
        os.environ[ENV] = f"{os.getpid()}:{self.path}"
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = old

    def read(self) -> str:
        try:
            with open(self.path, encoding="utf-8") as f:
                return f.read().strip()
        except OSError:
            return ""

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass


class FirstErrorLog(logging.Handler):
    """On the ``vllm`` logger of an engine process: the first logged exception goes into the
    note (``"{Type}: {message}"``); then, or once the note is gone, it removes itself."""

    def __init__(self, path: str):
        super().__init__(logging.ERROR)
        self.path = path

    def emit(self, rec: logging.LogRecord) -> None:
        e = rec.exc_info[1] if rec.exc_info else None
        if e is None and os.path.exists(self.path):
            return
        if e is not None:
            record(self.path, f"{type(e).__name__}: {e}")
        logging.getLogger("vllm").removeHandler(self)


def watch_engine_start() -> None:
    """In a process the front end spawned while starting its engine (:data:`ENV`, another
    pid): note vLLM's first logged exception. Elsewhere a no-op."""
    value = os.environ.get(ENV, "")
    pid, _, path = value.partition(":")
    if path and pid != str(os.getpid()):
        logging.getLogger("vllm").addHandler(FirstErrorLog(path))

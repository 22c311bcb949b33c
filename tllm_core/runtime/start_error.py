"""Why the engine refused to start, told to the front end through a note file: vLLM reports
a worker that fails while loading only as "see root cause above"."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from tllm_core.runtime.environ import env_set

# "{front end pid}:{note path}", set while the engine starts; its processes inherit it.
ENV = "TLLM_START_ERROR_FILE"


def record(path: str | None, message: str) -> None:
    """Write ``message`` to ``path`` unless a rank wrote first; never raises."""
    if not path:
        return
    try:
        with open(path, "r+", encoding="utf-8") as f:
            if not f.read():
                f.write(message)
    except OSError:
        pass


class StartErrorNote:
    """The front end's side: an empty file for the engine to write into."""

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix="tllm-start-", suffix=".txt")
        os.close(fd)

    @contextmanager
    def shared(self) -> Iterator[None]:
        """While the engine starts: :data:`ENV` names this note to the processes it spawns."""
        with env_set(ENV, f"{os.getpid()}:{self.path}"):
            yield

    def read(self) -> str:
        try:
            with open(self.path, encoding="utf-8") as f:
                return f.read().strip()
        except OSError:
            return ""

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class FirstErrorLog(logging.Handler):
    """On the ``vllm`` logger: the first logged exception goes into the note, then (or once
    the note is gone) it removes itself."""

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
    """In a process the front end spawned while starting its engine, note vLLM's first
    logged exception (elsewhere a no-op)."""
    value = os.environ.get(ENV, "")
    pid, _, path = value.partition(":")
    if path and pid != str(os.getpid()):
        logging.getLogger("vllm").addHandler(FirstErrorLog(path))

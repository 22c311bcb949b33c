"""Why the engine refused to start, told to the front end through a note file: vLLM reports
a worker that fails while loading only as "see root cause above"."""

from __future__ import annotations

import logging
import os

from tllm_core.runtime.notes import named, write_once

# "{front end pid}:{note path}", set while the engine starts; its processes inherit it.
ENV = "TLLM_START_ERROR_FILE"
record = write_once  # (path, message): the first rank's reason wins; never raises


class FirstErrorLog(logging.Handler):
    """On the ``vllm`` logger: notes the first logged exception, then removes itself."""

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
    """In a process spawned while its engine starts, note vLLM's first logged exception."""
    note = named(ENV)
    if note is not None and note[0] != os.getpid():
        logging.getLogger("vllm").addHandler(FirstErrorLog(note[1]))

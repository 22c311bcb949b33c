"""Why the engine refused to start, told to the process that started it.

vLLM reports a worker that fails while loading the model as "Engine core initialization
failed. See root cause above": the cause is only in the workers' logs. A tllm refusal there (a
tap site that a layer lacks, a consumer that cannot be built on the real model) is written to
a file the front end names in the runtime settings (``start_error_file``); the front end then
raises it as its own one-line error.
"""

from __future__ import annotations

import os
import tempfile


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

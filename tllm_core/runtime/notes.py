"""Note files: how an engine process tells its starter why it failed or stops. The starter
names an empty file to the processes it spawns (env ``"{pid}:{path}"``); the first to write wins."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator

from tllm_core.runtime.environ import env_set


class NoteFile:
    """An empty temporary file for other processes to write into, read kept at :meth:`close`."""

    def __init__(self, prefix: str) -> None:
        fd, self.path = tempfile.mkstemp(prefix=prefix, suffix=".txt")
        os.close(fd)
        self._kept: str | None = None

    @contextlib.contextmanager
    def shared(self, env: str) -> Iterator[None]:
        """While inside: ``env`` names this note to the processes this one spawns."""
        with env_set(env, f"{os.getpid()}:{self.path}"):
            yield

    def read(self) -> str:
        return self._kept if self._kept is not None else read_text(self.path).strip()

    def close(self) -> None:
        if self._kept is None:
            self._kept = self.read()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def named(env: str) -> tuple[int, str] | None:
    """The (starter's pid, note path) named in ``env`` (None: no note)."""
    pid, _, path = os.environ.get(env, "").partition(":")
    return (int(pid), path) if pid.isdigit() and path else None


def write_once(path: str | None, text: str, create: bool = False) -> bool:
    """Write ``text`` to the note at ``path`` unless another process wrote first; whether it
    wrote. Never raises: a missing note (the starter is gone) stays missing unless ``create``."""
    if not path:
        return False
    try:
        with open(path, "a+" if create else "r+", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            if f.read():
                return False
            f.write(text)
            f.flush()
    except OSError:
        return False
    return True


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""

"""Why a headless node stops on its own, told by its engine processes to the node's command.

An engine process learns that the node must stop (``dp_nodes.py``); the ``tllm serve
--headless`` process must stop the engines and exit with that reason. It names a file in
:data:`ENV` (``"{pid}:{path}"``); the first engine process to :func:`tell` writes the reason
there and sends that pid SIGTERM. :data:`STOP_REQUESTED` is a requested stop (exit 0).
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
from collections.abc import Callable, Iterator

from tllm_core.runtime.environ import env_set

ENV = "TLLM_NODE_NOTE"
# What an engine tells when its leader was asked to stop and has: a requested stop of this
# node too (exit 0), no error (``nodes.NodeWatch.lost`` returns None for it).
STOP_REQUESTED = "the leader stopped on request"


class NodeNote:
    """The note of the node's command (:func:`shared`): what an engine process told, read
    from the note while it exists and kept once it is removed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._kept: str | None = None
        self._closed = False

    def told(self) -> str | None:
        """The reason an engine process told (None: none)."""
        return self._kept if self._closed else (_read(self.path) or None)

    def close(self) -> None:
        """Keep what was told; the note itself is removed by :func:`shared`."""
        if not self._closed:
            self._kept = _read(self.path) or None
            self._closed = True


@contextlib.contextmanager
def shared() -> Iterator[NodeNote]:
    """In the node's command, while its engines run: an empty note named in :data:`ENV`
    (yields it). On leaving, what was told is kept (:meth:`NodeNote.told`) and the file
    removed."""
    fd, path = tempfile.mkstemp(prefix="tllm-node-", suffix=".txt")
    os.close(fd)
    note = NodeNote(path)
    try:
        with env_set(ENV, f"{os.getpid()}:{path}"):
            yield note
    finally:
        note.close()
        with contextlib.suppress(OSError):
            os.unlink(path)


def _spec() -> tuple[int, str] | None:
    pid, _, path = os.environ.get(ENV, "").partition(":")
    return (int(pid), path) if pid.isdigit() and path else None


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


def on_headless_node() -> bool:
    """Whether this process runs under a node's command that reads the note."""
    return _spec() is not None


def tell(reason: str, kill: Callable[[int, int], None] = os.kill) -> bool:
    """In an engine process: write ``reason`` to the note and SIGTERM the node's command,
    unless another process told first or there is no note. Returns whether it told."""
    import fcntl

    spec = _spec()
    if spec is None:
        return False
    pid, path = spec
    try:
        with open(path, "r+", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # engines of one node may tell at the same time
            if f.read():
                return False
            f.write(reason)
            f.flush()
    except OSError:  # the command is gone, and its note with it
        return False
    kill(pid, signal.SIGTERM)
    return True

"""A deadline on consumer callbacks: a daemon thread reports each one past the deadline of
its kind once, with its thread's stack (the runtime then switches it off or stops the engine)."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from tllm_core.runtime.notes import named, read_text, write_once
from tllm_core.runtime.start_error import ENV

log = logging.getLogger("tllm")

# Kinds of callback, each with its own deadline (RuntimeSettings' *_deadline_s).
STEP = "step"  # on the engine thread: the step waits for it
BACKGROUND = "background"  # on a background consumer's own thread
CLOSE = "close"  # close and result: writing what the consumer holds
# The watchdog wakes this many times per shortest deadline (at most once a second).
CHECKS_PER_DEADLINE = 4
HUNG_EXIT_CODE = 75  # the exit status of an engine process the watchdog stopped


@dataclass(frozen=True)
class Hung:
    """A callback past its deadline."""

    consumer: str
    callback: str
    kind: str
    deadline_s: float
    seconds: float
    thread: str
    stack: str

    def message(self) -> str:
        return (
            f"consumer {self.consumer!r} is stuck in {self.callback} ({self.seconds:.0f} s; "
            f"the deadline of a {self.kind} callback is {self.deadline_s:g} s)"
        )

    def where(self) -> str:
        """The innermost frame of :attr:`stack` outside Python's library: ``file:line in f``."""
        frames = [ln.strip() for ln in self.stack.splitlines() if ln.strip().startswith("File ")]
        stdlib = os.path.dirname(os.__file__)
        own = [f for f in frames if stdlib not in f] or frames
        if not own:
            return "an unknown place"
        path, _, rest = own[-1].removeprefix("File ").partition(", line ")
        line, _, func = rest.partition(", in ")
        return f"{path.strip(chr(34))}:{line} in {func}"

    def report(self) -> str:
        return f"{self.message()}; stuck at (thread {self.thread}):\n{self.stack}"


@dataclass(slots=True)
class _Call:
    consumer: str
    callback: str
    kind: str
    start: float = field(default_factory=time.monotonic)
    reported: bool = False


class Watchdog:
    """Reports callbacks past their deadline (``deadlines``: seconds by kind) to ``on_hung``."""

    def __init__(self, deadlines: dict[str, float], on_hung: Callable[[Hung], None]):
        self.deadlines = dict(deadlines)
        self.on_hung = on_hung
        self.interval_s = min(1.0, min(self.deadlines.values()) / CHECKS_PER_DEADLINE)
        self._calls: dict[int, _Call] = {}  # thread id -> the callback running on it
        self._stop = threading.Event()
        # Started at the first callback (a runtime with no callback runs no thread).
        self._thread = threading.Thread(target=self._watch, name="tllm-watchdog", daemon=True)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def watching(self, consumer: str, callback: str, kind: str) -> Iterator[None]:
        """Watch the callback this thread runs inside the block (not one inside another)."""
        tid = threading.get_ident()
        if tid in self._calls:
            yield
            return
        if self._thread.ident is None:
            with self._lock:
                if self._thread.ident is None:
                    self._thread.start()
        self._calls[tid] = _Call(consumer, callback, kind)
        try:
            yield
        finally:
            self._calls.pop(tid, None)

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            now, frames = time.monotonic(), None
            for tid, call in list(self._calls.items()):
                deadline = self.deadlines[call.kind]
                if call.reported or now - call.start <= deadline:
                    continue
                call.reported = True
                frames = frames or sys._current_frames()  # only when one is late
                frame = frames.get(tid)
                stack = "".join(traceback.format_stack(frame)) if frame is not None else "(gone)\n"
                thread = next((t.name for t in threading.enumerate() if t.ident == tid), str(tid))
                late = now - call.start
                hung = Hung(call.consumer, call.callback, call.kind, deadline, late, thread, stack)
                try:
                    self.on_hung(hung)
                except Exception:  # noqa: BLE001 - the watchdog must keep watching
                    log.exception("tllm: handling a hung consumer callback failed")


def write_note(path: str | None, hung: Hung) -> None:
    """Write ``hung`` (JSON) into the front end's note unless one is there; never raises."""
    write_once(path, json.dumps(asdict(hung)), create=True)


def read_note(path: str | None) -> Hung | None:
    """The hung callback the engine wrote at ``path``, if any."""
    text = read_text(path) if path else ""
    try:
        return Hung(**json.loads(text)) if text.strip() else None
    except (ValueError, TypeError):
        return None


class EngineStop:
    """Exits the engine process (:data:`HUNG_EXIT_CODE`) ``after_s`` seconds after a callback
    hung; an engine in the front end's own process is only reported."""

    def __init__(self, after_s: float, exit: Callable[[int], Any] = os._exit):
        self.after_s = after_s
        self._exit = exit
        self._timer: threading.Timer | None = None

    def schedule(self, hung: Hung) -> None:
        if self._timer is not None:
            return
        if multiprocessing.parent_process() is None and self._exit is os._exit:
            log.error("tllm: %s; the engine runs in this process, so it is not stopped", hung)
            return
        self._timer = threading.Timer(self.after_s, self._stop, args=(hung,))
        self._timer.daemon = True
        self._timer.start()

    def _stop(self, hung: Hung) -> None:
        log.error("tllm: stopping the engine: %s", hung.message())
        for h in logging.getLogger().handlers + log.handlers:
            with contextlib.suppress(Exception):  # exiting anyway
                h.flush()
        sys.stderr.flush()
        if self._exit is os._exit:
            _end_engine_core()
            # os._exit skips libiomp5's exit handler, which removes this file (the engine
            # watch removes those of processes ended by a signal: engine_watch.py).
            for path in glob.glob(f"/dev/shm/__KMP_REGISTERED_LIB_{os.getpid()}_*"):
                with contextlib.suppress(OSError):
                    os.unlink(path)
        self._exit(HUNG_EXIT_CODE)


def _end_engine_core() -> None:
    """End a parent offline engine core first (else it logs this exit as its own fatal error)."""
    front = named(ENV)
    parent = os.getppid()
    if front is None or parent in (1, front[0], os.getpid()):
        return
    with contextlib.suppress(OSError):
        os.kill(parent, signal.SIGKILL)

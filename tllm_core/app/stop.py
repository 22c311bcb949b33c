"""Stopping a ``tllm`` command (docs/cli.md, "Stopping"): SIGTERM acts as Ctrl-C; a watchdog
kills the command's processes if it has not exited :func:`stop_timeout` s after the first."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.process
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from tllm_core.runtime.environ import env_seconds

STOP_TIMEOUT_ENV = "TLLM_STOP_TIMEOUT_S"
# vLLM's engine gets 60 s (the command's --shutdown-timeout / lifecycle.SHUTDOWN_TIMEOUT_S),
# its workers 30 s more; the watchdog waits past both.
DEFAULT_STOP_TIMEOUT_S = 120.0
EXIT_STOP_TIMEOUT = 124  # as timeout(1): stopping took too long, processes were killed
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_timeout() -> float:
    """Seconds from the first stop signal to the watchdog's kill (``TLLM_STOP_TIMEOUT_S``)."""
    return env_seconds(STOP_TIMEOUT_ENV, DEFAULT_STOP_TIMEOUT_S)


# POSIX signal handlers are process-wide: install() makes the one StopSignals whose bound
# method handles SIGTERM/SIGINT, and the command's code finds it here until uninstall().
_installed: StopSignals | None = None


class StopSignals:
    """A command's stop: the signals received, the watchdog the first starts, its processes."""

    def __init__(self) -> None:
        from tllm_core.vllm_bridge.nodes import NodeWatch

        self._received: list[int] = []
        self._lock = threading.RLock()  # taken in the signal handler too (same thread)
        self._children: set[int] = set()  # the processes when the first stop signal came
        self.nodes = NodeWatch()
        self.replaced: dict[int, Any] = {}  # the handlers install() replaced
        # Read now, refused naming the variable: in the signal handler an error unbounds the stop.
        self.timeout = stop_timeout()

    def received(self) -> int | None:
        """The first stop signal received (None: none)."""
        return self._received[0] if self._received else None

    def exit_code(self, default: int = 130) -> int:  # as the module's exit_code
        return default if not self._received else 128 + int(self._received[0])

    def note(self, signum: int) -> bool:
        """Record a stop signal; the first one (True) starts the watchdog."""
        with self._lock:
            first = not self._received
            self._received.append(signum)
        if first:
            self.nodes.stop()  # peers that stop answering now are part of this stop
            self.note_children()
            threading.Thread(
                target=self._watchdog, args=(self.timeout,), daemon=True, name="tllm-stop-watchdog"
            ).start()
        else:
            _say(
                f"already stopping ({signal.Signals(signum).name} again); exiting within "
                f"{self.timeout:.0f} s of the first signal"
            )
        return first

    def handle(self, signum: int, frame: Any) -> None:
        """The SIGTERM/SIGINT handler :func:`install` sets: the first signal interrupts whatever
        runs (as Ctrl-C); later ones must not interrupt the cleanup it started (files left)."""
        if self.note(signum):
            raise KeyboardInterrupt(signal.Signals(signum).name)

    def note_children(self) -> None:
        """Remember this command's engine processes now (a killed one's files go at exit)."""
        self._children = self._children | {p.pid for p in _descendants()}  # read at exit

    def forget_dead_children(self) -> list[str]:
        """Remove stopped processes' Intel OpenMP files in /dev/shm (libiomp5 does at exit only)."""
        from tllm_core.vllm_bridge.engine_watch import remove_openmp_files

        return remove_openmp_files(self._children)

    @contextlib.contextmanager
    def noting_handlers(self, seen: Callable[[Any], None] | None = None) -> Iterator[None]:
        """While inside, a SIGINT/SIGTERM handler someone else installs (vLLM's server,
        uvicorn) first records the signal, then runs; ``seen(handler)`` is called with each."""
        original = signal.signal

        def signal_noting(signalnum: Any, handler: Any) -> Any:
            if signalnum in STOP_SIGNALS and callable(handler):
                if seen is not None:
                    seen(handler)
                handler = self._noting(handler)
            return original(signalnum, handler)

        signal.signal = signal_noting  # type: ignore[assignment]
        try:
            yield
        finally:
            signal.signal = original  # type: ignore[assignment]

    def _noting(self, handler: Callable[..., Any]) -> Callable[..., Any]:
        if getattr(handler, "_tllm_noting", False):
            return handler

        def noting(signum: int, frame: Any) -> Any:
            self.note(signum)
            return handler(signum, frame)

        noting._tllm_noting = True  # type: ignore[attr-defined]
        return noting

    def _watchdog(self, timeout: float) -> None:
        threading.Event().wait(timeout)
        _say(
            f"did not stop within {timeout:.0f} s of the stop signal ({STOP_TIMEOUT_ENV}); "
            "killing its engine processes"
        )
        self._children.update(kill_children())
        self.forget_dead_children()
        os._exit(1 if self.nodes.lost() else EXIT_STOP_TIMEOUT)  # a lost node: the error


def install() -> StopSignals | None:
    """SIGTERM and SIGINT stop the command as Ctrl-C does (main thread only, else None); an
    ignored SIGINT (a background job) stays ignored."""
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return None
    signals = _installed
    if signals is None:  # one per process: a second call sets the same owner's handlers
        signals = _installed = StopSignals()
        atexit.register(signals.forget_dead_children)
    for sig in STOP_SIGNALS:
        previous = signal.getsignal(sig)
        if previous == signals.handle or (sig == signal.SIGINT and previous is signal.SIG_IGN):
            continue
        signals.replaced.setdefault(sig, previous)
        signal.signal(sig, signals.handle)
    multiprocessing.process.BaseProcess.start = _deaf_start  # type: ignore[method-assign]
    return signals


_process_start = multiprocessing.process.BaseProcess.start


def _deaf_start(self: multiprocessing.process.BaseProcess) -> None:
    """``Process.start`` with SIGINT ignored while the child is made: the child starts with
    it ignored (kept across exec) until it sets its own handler (vLLM's engine core does, on
    entry), so a Ctrl-C at the terminal, which reaches every process of the command, does
    not print a child's half-imported traceback; the command stops its engine itself. A
    Ctrl-C within the few milliseconds of the start is lost."""
    if threading.current_thread() is not threading.main_thread():
        return _process_start(self)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return _process_start(self)
    finally:
        if previous is not None:  # None: a handler set from C, which Python cannot put back
            signal.signal(signal.SIGINT, previous)


def uninstall() -> None:
    """Undo :func:`install`: the handlers it replaced again, no :class:`StopSignals`."""
    global _installed
    signals, _installed = _installed, None
    if signals is None:
        return
    atexit.unregister(signals.forget_dead_children)
    process = multiprocessing.process.BaseProcess
    if process.start is _deaf_start:  # not another's patch made since
        process.start = _process_start  # type: ignore[method-assign]
    for sig, previous in signals.replaced.items():
        if signal.getsignal(sig) == signals.handle:
            signal.signal(sig, previous)


def installed() -> StopSignals | None:
    """The :class:`StopSignals` :func:`install` made (None: not installed)."""
    return _installed


def exit_code(default: int = 130) -> int:
    """``128 + signal`` for the first stop signal received, else ``default``."""
    return default if _installed is None else _installed.exit_code(default)


def exit_now(code: int) -> None:
    """Exit with ``code`` without the interpreter's teardown (the engine is stopped: it would
    only add seconds and "nanobind: leaked" lines)."""
    if _installed is not None:
        _installed.forget_dead_children()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _say(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(f"tllm: {text}", file=sys.stderr, flush=True)


def _descendants() -> list[Any]:
    import psutil

    with contextlib.suppress(psutil.Error):
        return psutil.Process().children(recursive=True)
    return []


def kill_children() -> list[int]:
    """SIGKILL every descendant but ``multiprocessing``'s resource tracker; the pids killed."""
    import psutil

    killed = []
    for p in _descendants():
        with contextlib.suppress(psutil.Error):
            if "resource_tracker" not in " ".join(p.cmdline()):
                p.kill()
                killed.append(p)
    with contextlib.suppress(psutil.Error):
        psutil.wait_procs(killed, timeout=10)
    return [p.pid for p in killed]

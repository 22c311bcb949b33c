"""Stopping an engine core: the lost wake-up after SIGTERM (issue 15), without vLLM.

vLLM's engine core sleeps on its input queue between requests; SIGTERM's Python handler runs
only when its main thread next runs Python code. A SIGTERM that arrives as the thread goes to
sleep leaves it asleep with the handler pending (seen in the engine core with gdb: the
signal module's ``Handlers[SIGTERM].tripped == 1`` while the main thread waited in
``queue.get``), and vLLM force-kills the process 60 s later. The fake engine core below has
the same loop and gets the same state every time: SIGTERM is kept off its main thread.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from types import SimpleNamespace

from tllm_core.vllm_bridge.lifecycle import WAKE_REQUEST_ID, shutdown_engine

FAKE_ENGINE_CORE = r"""
import queue, signal, sys, threading, time

inputs = queue.Queue()
stop = []
signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))


def feed():  # vLLM's input thread: messages from the front end into the queue
    # "ready" only once the main thread sleeps in inputs.get(): a SIGTERM that came while
    # it still ran Python would be handled there (on a loaded machine it did).
    while not inputs.not_empty._waiters:
        time.sleep(0.001)
    time.sleep(0.05)  # from joining the waiters to blocking: a few bytecodes
    print("ready", flush=True)
    for line in sys.stdin:
        inputs.put(line)


threading.Thread(target=feed, daemon=True).start()
# SIGTERM off the main thread: it lands on the input thread, which cannot run the handler,
# and the sleeping main thread is not woken (the race, made certain).
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
while not stop:  # vLLM's busy loop, idle
    inputs.get()
"""


class FakeProcess:
    """The parts of ``multiprocessing.Process`` that vLLM's process manager uses."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self) -> None:
        self.popen.terminate()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)


class FakeClient:
    """A multiprocess engine-core client: ``shutdown`` does what vLLM's process manager does
    (SIGTERM, then ``join`` with a timeout); ``abort_requests`` sends a message."""

    def __init__(self, proc: FakeProcess) -> None:
        self.resources = SimpleNamespace(engine_manager=SimpleNamespace(processes=[proc]))
        self.aborted: list[str] = []

    def abort_requests(self, ids: list[str]) -> None:
        self.aborted.extend(ids)
        for p in self.resources.engine_manager.processes:
            p.popen.stdin.write("abort\n")
            p.popen.stdin.flush()

    def shutdown(self, timeout: float | None = None) -> None:
        for p in self.resources.engine_manager.processes:
            p.terminate()
        for p in self.resources.engine_manager.processes:
            p.join(timeout)


def test_shutdown_engine_wakes_an_engine_core_that_missed_sigterm():
    popen = subprocess.Popen(
        [sys.executable, "-c", FAKE_ENGINE_CORE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    proc = FakeProcess(popen)
    client = FakeClient(proc)
    try:
        assert popen.stdout.readline().strip() == "ready"
        # What vLLM alone does: SIGTERM and wait. The engine core sleeps on.
        client.shutdown(timeout=1.5)
        assert proc.is_alive()
        assert client.aborted == []

        shutdown_engine(SimpleNamespace(llm_engine=SimpleNamespace(engine_core=client)), 20)
        # Within the grace given (the fake client never kills): it stopped itself.
        assert not proc.is_alive()
        assert popen.returncode == 0
        assert set(client.aborted) == {WAKE_REQUEST_ID}
        assert "join" not in vars(proc)  # vLLM's own join again afterwards
    finally:
        if popen.poll() is None:
            popen.kill()
        popen.wait()


def test_shutdown_engine_without_processes_calls_shutdown_once():
    calls = []
    inproc = SimpleNamespace(shutdown=lambda timeout=None: calls.append(timeout))
    shutdown_engine(SimpleNamespace(llm_engine=SimpleNamespace(engine_core=inproc)), 7)
    assert calls == [7]
    shutdown_engine(SimpleNamespace())  # no engine: nothing to do

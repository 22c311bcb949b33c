"""Start ``tllm serve`` on loopback for a test, and stop it with Ctrl-C (SIGINT)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from cli_util import without_binding

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, key: str | None = None) -> dict:
    """GET ``url`` as JSON, with ``key`` as the bearer token when given."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def tllm_serve(
    args: list[str],
    log: Path,
    ready_timeout: float = 300,
    stop_timeout: float = 90,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """Run ``tllm serve ARGS --port P`` (vLLM's multiprocess layout) until it prints
    ``tllm: ready``; yield its base URL; stop it with SIGINT as a user's Ctrl-C would. A
    ready server must then exit 0 by itself (not through tllm's stop watchdog, which the
    environment here sets to 60 s: exit status 124)."""
    port = free_port()
    extra, env = env or {}, dict(os.environ)
    env.setdefault("TLLM_STOP_TIMEOUT_S", "60")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    without_binding(env)  # tllm serve binds one core group per rank
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    argv = [sys.executable, "-m", "tllm_core.app.cli", "serve", "--port", str(port), *args]
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, env=env, stdout=err, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + ready_timeout
        while "tllm: ready" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(1)
        yield f"http://127.0.0.1:{port}"
    except BaseException:
        stop(proc, stop_timeout)
        raise
    code = stop(proc, stop_timeout)
    assert code == 0, f"tllm serve exited {code} after Ctrl-C:\n{log.read_text()[-4000:]}"


def stop(proc: subprocess.Popen, timeout: float) -> int | None:
    """Ctrl-C (SIGINT) to a running server; its exit status (None: killed after ``timeout``)."""
    if proc.poll() is not None:
        return proc.returncode
    os.kill(proc.pid, signal.SIGINT)  # Ctrl-C stops the server and its engine
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        return None


class SharedServer:
    """One ``tllm serve`` for several tests (a start is three vLLM processes, ~30 s): started
    by the first test that asks, stopped with Ctrl-C after the last one (conftest's
    ``pytest_runtest_teardown``), and checked then as each test checked its own: exit 0, no
    traceback, no force kill."""

    def __init__(self, args: list[str], log: Path, key: str | None = None) -> None:
        self.args, self.log, self.key = args, log, key
        self.url: str | None = None
        self._stack: contextlib.ExitStack | None = None

    def start(self) -> SharedServer:
        if self._stack is None:
            stack = contextlib.ExitStack()
            self.url = stack.enter_context(tllm_serve(self.args, self.log))
            self._stack = stack
        return self

    def stop(self) -> None:
        stack, self._stack = self._stack, None
        if stack is None:
            return
        stack.close()  # Ctrl-C; asserts the exit status
        text = self.log.read_text()
        assert "Traceback" not in text and "force killing" not in text, text[-4000:]

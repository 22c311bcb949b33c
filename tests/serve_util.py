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

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as r:
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
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # tllm serve binds one core group per rank
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

"""Processes of a test: start ``tllm`` commands as a supervisor would, stop them with one
signal to the process alone, and find what they leave behind (processes, ``/dev/shm``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from cli_util import without_binding
from serve_util import ROOT

SHM = Path("/dev/shm")
# What vLLM's processes create there: multiprocessing shared memory (psm_*), semaphores
# (sem.*, loky's included), Intel OpenMP's registration files (__KMP_REGISTERED_LIB_<pid>_*).
SHM_KINDS = re.compile(r"^(psm_|sem\.|__KMP_REGISTERED_LIB_)")


CLI = ("-m", "tllm_core.app.cli")


def start(
    argv: list[str], log: Path, python: tuple[str, ...] = CLI, **env: str
) -> subprocess.Popen:
    """``python -m tllm_core.app.cli ARGV`` (``python``: other interpreter arguments) in its own
    session (a signal to it reaches it alone), this checkout first on the path, stdout and
    stderr to ``log``."""
    full = dict(os.environ)
    full.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    without_binding(full)
    full.update(env)
    full["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), full.get("PYTHONPATH")) if p)
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, *python, *argv],
            env=full,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )


def wait_for(log: Path, text: str, proc: subprocess.Popen, timeout: float) -> str:
    """Wait until ``text`` is in ``log`` (fails if the process ends first, or after
    ``timeout`` s); returns the log."""
    deadline = time.monotonic() + timeout
    while True:
        seen = log.read_text() if log.exists() else ""
        if text in seen:
            return seen
        assert proc.poll() is None, f"ended ({proc.returncode}) before {text!r}:\n{seen[-4000:]}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n{seen[-4000:]}"
        time.sleep(0.5)


def exit_within(proc: subprocess.Popen, timeout: float) -> int | None:
    """The exit status, or None (and the process group killed) if it runs past ``timeout``.
    The resource tracker is spared: it unlinks the shared memory of the killed processes."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc, but="resource_tracker")
        return None


def exit_codes(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """:func:`exit_within` of each process in turn; whatever still runs afterwards (an error
    on the way included) has its process group killed."""
    try:
        return [exit_within(p, timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)


def kill_group(proc: subprocess.Popen, but: str = "", sig: int = signal.SIGKILL) -> list[int]:
    """SIGKILL (or ``sig``) the process's whole session, except processes whose command line
    contains ``but`` (when given); returns the pids signalled."""
    import psutil

    killed = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) != proc.pid:
                continue
            if but and but in " ".join(p.cmdline()):
                continue
            p.send_signal(sig)
            killed.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return killed


def descendants(pid: int, settle: float = 0) -> list[int]:
    """Processes the command ``pid`` started (its session, which :func:`start` gives it, or
    the ``TLLM_CLI_PID`` it gives them: both survive re-parenting; a process vLLM retitled
    shows no environment), still alive after up to ``settle`` s (they may be exiting)."""
    import psutil

    deadline = time.monotonic() + settle
    while True:
        left = []
        for p in psutil.process_iter():
            try:
                if p.pid == pid or p.status() == psutil.STATUS_ZOMBIE:
                    continue
                if os.getsid(p.pid) == pid or p.environ().get("TLLM_CLI_PID") == str(pid):
                    left.append(p.pid)
            except (psutil.Error, OSError):
                continue
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.5)


def shm_entries() -> set[str]:
    return {p.name for p in SHM.iterdir() if SHM_KINDS.match(p.name)} if SHM.is_dir() else set()


def mapped_shm() -> set[str]:
    """``/dev/shm`` entries some live process has mapped or open (other tests' included)."""
    used = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for line in (proc / "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    used.add(line.rsplit("/dev/shm/", 1)[1].split(" ")[0])
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    used.add(target[len("/dev/shm/") :])
        except OSError:
            continue
    return used


def leftover_shm(before: set[str], pids: set[int] = frozenset(), settle: float = 20) -> list[str]:
    """Entries created since ``before`` that no live process uses (another test's live
    engine keeps its own), waiting up to ``settle`` s for resource trackers to unlink
    theirs. Semaphore and OpenMP files named after a pid count only for ``pids`` when given
    (those of another test's process that was killed are not ours)."""

    def ours(name: str) -> bool:
        if not pids:
            return True
        m = re.search(r"(?:sem\.loky-|__KMP_REGISTERED_LIB_)(\d+)", name)
        return m is None or int(m.group(1)) in pids

    deadline = time.monotonic() + settle
    while True:
        left = sorted(n for n in shm_entries() - before - mapped_shm() if ours(n))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1)


def stop_with(proc: subprocess.Popen, sig: signal.Signals) -> None:
    """One signal to the process alone, as a supervisor sends it."""
    os.kill(proc.pid, sig)

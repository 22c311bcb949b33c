"""Notice a dead engine process within a second, name it, and end every wait on it (vLLM's
offline client waits on a dead engine core without a timeout); CONTRACT.md, "Engine lifecycle"."""

from __future__ import annotations

import contextlib
import glob
import os
import select
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

POLL_S = 0.25  # a death is noticed within this
PF_EXITING = 0x4  # the kernel's flag of a process that is exiting (/proc/PID/stat, field 9)
LEFTOVER_GRACE_S = 5.0  # for the others to exit after a death (vLLM's workers take ~1 s)
SHM_EVERY = 8  # looks between two reads of the processes' shared memory (/proc/PID/maps)
# Kernels built without CONFIG_PROC_CHILDREN have no /proc/PID/task/TID/children.
KERNEL_CHILDREN = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


@dataclass(frozen=True)
class Death:
    what: str
    pid: int
    how: str

    def __str__(self) -> str:
        return f"{self.what} (pid {self.pid}) died ({self.how})"


class EngineDiedError(RuntimeError):
    """A process of the engine died (``death``); ``outputs``: what finished before, if kept."""

    def __init__(self, death: Death, outputs: Any = None) -> None:
        super().__init__(f"{death}; the engine is stopped")
        self.death = death
        self.outputs = outputs


def how_it_ended(exitcode: int | None) -> str:
    """``multiprocessing``'s exit code in words."""
    if exitcode is None:
        return "its exit status went to its parent process"
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-exitcode).name}"
        return f"killed by signal {-exitcode}"
    return f"exit status {exitcode}"


def _read(path: str) -> bytes:
    """The bytes of a /proc file (empty where it cannot be read: the process is gone)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _stat(pid: int) -> list[bytes]:
    """The fields of ``/proc/PID/stat`` from the state on (empty where it is gone)."""
    _, paren, rest = _read(f"/proc/{pid}/stat").rpartition(b")")
    return rest.split() if paren else []


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    fields = _stat(pid)
    return bool(fields) and fields[0] not in (b"Z", b"X")


def exit_code(pid: int, exiting: bool = False) -> int | None:
    """How zombie ``pid`` ended, as ``multiprocessing``'s exit code (a worker is not our child:
    only its ``/proc/PID/stat`` tells); ``exiting``: also while it exits, before it is a zombie
    (the kernel sets the status first; its parent may reap the zombie before a look); None
    otherwise."""
    fields = _stat(pid)
    if len(fields) < 50 or not fields[49].isdigit() or not fields[6].isdigit():
        return None
    status = int(fields[49])
    # Alive, the field holds a ptrace stop's signal: trusted only once the kernel marks it
    # exiting (PF_EXITING in its flags).
    if fields[0] != b"Z" and not (exiting and status and int(fields[6]) & PF_EXITING):
        return None
    return -(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF


def _children(pid: int, recursive: bool = True) -> list[int]:
    """The processes below ``pid`` (``recursive``: all, else its children), from the kernel's
    lists (psutil's scan reads every process)."""
    if not KERNEL_CHILDREN:
        import psutil  # vLLM's dependency

        with contextlib.suppress(psutil.Error):
            return [c.pid for c in psutil.Process(pid).children(recursive=recursive)]
        return []
    out, todo = [], [pid]
    while todo:
        for path in glob.glob(f"/proc/{todo.pop()}/task/*/children"):
            kids = [int(k) for k in _read(path).split()]
            out += kids
            todo += kids if recursive else []
    return out


def _vllm_started(pid: int) -> bool:
    """Whether vLLM started ``pid`` (not the resource tracker or a helper such as a compiler)."""
    line = _read(f"/proc/{pid}/cmdline")
    return b"resource_tracker" not in line and (b"VLLM::" in line or b"spawn_main" in line)


def remove_openmp_files(pids: Iterable[int]) -> list[str]:
    """Remove the dead ``pids``' Intel OpenMP files (libiomp5 does only at a normal exit)."""
    removed = []
    for pid in sorted(set(pids)):
        if _alive(pid):
            continue
        for path in glob.glob(f"/dev/shm/__KMP_REGISTERED_LIB_{pid}_*"):
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
    return removed


def mapped_shm(pid: int | str) -> set[str]:
    """The ``/dev/shm`` shared memory (``psm_*``) and semaphores (``sem.*``) ``pid`` maps."""
    lines = _read(f"/proc/{pid}/maps").decode(errors="surrogateescape").splitlines()
    names = {ln.rsplit("/dev/shm/", 1)[1].split(" ")[0] for ln in lines if "/dev/shm/" in ln}
    return {n for n in names if n.startswith(("psm_", "sem."))}


def release_shm(names: Iterable[str]) -> list[str]:
    """Unlink the segments ``names`` no process of ours maps, and unregister them from
    ``multiprocessing``'s resource tracker (else it warns of leaks)."""
    from multiprocessing import resource_tracker

    ours = mapped_shm("self")
    released = []
    for name in sorted(set(names) - ours):
        try:
            os.unlink(f"/dev/shm/{name}")
        except OSError:
            continue
        # The tracker's names: "/psm_..." (shared_memory), "/mp-..." for file sem.mp-...
        sem = name.startswith("sem.")
        kind, tracked = ("semaphore", f"/{name[4:]}") if sem else ("shared_memory", f"/{name}")
        with contextlib.suppress(Exception):  # no tracker running: nothing to tell
            resource_tracker.unregister(tracked, kind)
        released.append(name)
    return released


def engine_processes(core: Any) -> list[Any]:
    """The engine-core processes a multiprocess client started (empty for other clients)."""
    manager = getattr(getattr(core, "resources", None), "engine_manager", None)
    procs = getattr(manager, "processes", None)
    return [p for p in procs or () if callable(getattr(p, "join", None))]


class EngineWatch:
    """Watches the processes of vLLM's engine client ``core`` from a daemon thread."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.cores = engine_processes(core)
        self.death: Death | None = None
        self.pids: set[int] = {int(p.pid) for p in self.cores if p.pid}  # every one seen
        self._workers: set[int] = set()  # every worker seen, until its death
        # A pidfd per worker, readable once it exits: its status is read before it is reaped.
        self._pidfds: dict[int, int] = {}
        self._codes: dict[int, int] = {}  # worker pid -> exit code, read as it exits
        self.shm: set[str] = set()  # shared memory the engine processes had mapped
        self._looks = 0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> EngineWatch:
        if self.cores and self._thread is None:
            self._look()  # the workers as they are now
            self._thread = threading.Thread(target=self._run, daemon=True, name="tllm-engine-watch")
            self._thread.start()
        return self

    def stop(self) -> None:
        """The engine is being stopped on purpose: processes that end now are no death."""
        self._stopping.set()

    def check(self) -> None:
        """Raise :class:`EngineDiedError` if a process of the engine died."""
        if self.death is not None:
            raise EngineDiedError(self.death)

    def wait_for_death(self, timeout: float) -> Death | None:
        """The death, waiting up to ``timeout`` s for it (vLLM may see it first)."""
        deadline = time.monotonic() + timeout
        while self.death is None and self._thread is not None and time.monotonic() < deadline:
            if not self._thread.is_alive():
                break
            time.sleep(0.05)
        return self.death

    def _run(self) -> None:
        try:
            while not self._wait():
                self.death = self.death or self._look()
                if self.death is not None:
                    self._close_pidfds()
                    self._wake_waiters()
        finally:
            self._close_pidfds()

    def _wait(self) -> bool:
        """Wait :data:`POLL_S` or until a worker exits (its status read); True once stopped."""
        if not self._pidfds:
            return self._stopping.wait(POLL_S)
        poller = select.poll()
        for fd in self._pidfds.values():
            poller.register(fd, select.POLLIN)
        by_fd = {fd: pid for pid, fd in self._pidfds.items()}
        for fd, _ in poller.poll(POLL_S * 1000):
            if (code := exit_code(by_fd[fd])) is not None:
                self._codes.setdefault(by_fd[fd], code)
        return self._stopping.is_set()

    def _follow(self, workers: set[int]) -> None:
        """A pidfd for each new worker (none where the kernel has no ``pidfd_open``)."""
        for pid in workers - set(self._pidfds):
            with contextlib.suppress(AttributeError, OSError):  # gone, or Linux < 5.3: polled
                self._pidfds[pid] = os.pidfd_open(pid)

    def _close_pidfds(self) -> None:
        fds, self._pidfds = list(self._pidfds.values()), {}
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _look(self) -> Death | None:
        """One look; the causing death: one killed by a signal (core first), else a worker's."""
        deaths = []
        for pid in sorted(self._workers):
            if not _alive(pid):
                code = self._codes[pid] if pid in self._codes else exit_code(pid)
                deaths.append(Death("vLLM's worker process", pid, how_it_ended(code)))
            elif (code := exit_code(pid, exiting=True)) is not None:
                self._codes.setdefault(pid, code)
        for p in self.cores:
            if (code := p.exitcode) is not None:
                deaths.insert(0, Death("vLLM's engine core", int(p.pid), how_it_ended(code)))
        if deaths:
            killed = [d for d in deaths if "killed" in d.how]
            workers = [d for d in deaths if "worker" in d.what]
            return (killed or workers or deaths)[0]
        # Workers are an engine core's children: a process a worker forks (a consumer's pool)
        # keeps its "VLLM::" title, and its end is no worker's death. A worker stays one until
        # it dies: a killed one's title reads empty while it exits, before it is a zombie.
        kids = {c for p in self.cores for c in _children(int(p.pid), recursive=False)}
        self._workers |= {w for w in kids - self._workers if _vllm_started(w)}
        self._follow(self._workers)
        self.pids |= kids | {c for w in kids for c in _children(w)}
        if self._looks % SHM_EVERY == 0:
            for pid in self.pids:
                self.shm |= mapped_shm(pid)
        self._looks += 1
        return None

    def _wake_waiters(self) -> None:
        assert self.death is not None
        error = EngineDiedError(self.death)
        resources = getattr(self.core, "resources", None)
        if resources is not None:
            resources.engine_dead = True
        for future in list(getattr(self.core, "utility_results", {}).values()):
            with contextlib.suppress(Exception):  # already answered
                future.set_exception(error)
        outputs = getattr(self.core, "outputs_queue", None)
        if outputs is not None and outputs.empty():
            outputs.put_nowait(error)

    def clean_up(self, grace: float = LEFTOVER_GRACE_S) -> list[int]:
        """After a death: wait ``grace`` s, SIGKILL the rest, remove their files; pids killed."""
        self.stop()
        deadline = time.monotonic() + grace
        while any(_alive(p) for p in self.pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        killed = []
        for pid in sorted(self.pids):
            if _alive(pid) and _vllm_started(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
        for p in self.cores:  # reap them (they are this process's children)
            with contextlib.suppress(Exception):
                p.join(1.0)
        deadline = time.monotonic() + 2.0
        while any(_alive(p) for p in killed) and time.monotonic() < deadline:
            time.sleep(0.05)
        remove_openmp_files(self.pids)
        if not any(_alive(p) for p in self.pids):
            release_shm(self.shm)
        return killed

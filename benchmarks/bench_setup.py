"""Set-up shared by the benchmark scripts: the process environment of an in-process engine,
the model folder, the run's machine and code version, and the markdown each script's
``render`` writes into docs/results.md."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPTS_FILE = ROOT / "benchmarks" / "prompts.txt"


def engine_env(
    kv_cache_gib: int, env: MutableMapping[str, str] = os.environ, **forced: str
) -> MutableMapping[str, str]:
    """``env`` (this process's by default) set for one vLLM engine in its process, quiet:
    ``forced`` variables overwrite, the others are defaults."""
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.update(forced)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def offline_engine_env(kv_cache_gib: int) -> None:
    """Environment for one vLLM engine inside this process, quiet and offline; makes the
    checkout and this folder importable."""
    engine_env(kv_cache_gib).setdefault("HF_HUB_OFFLINE", "1")
    for p in (str(ROOT), str(Path(__file__).resolve().parent)):
        if p not in sys.path:
            sys.path.insert(0, p)


def shutdown_engine(llm: Any) -> None:
    """Stops the engine core of a ``vllm.LLM`` or ``TllmLLM`` (its worker threads hold memory
    until then); a failure to stop (or no engine core) is not the benchmark's."""
    with contextlib.suppress(Exception):
        getattr(llm, "llm", llm).llm_engine.engine_core.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(argv: list[str], log: Path, ready: Callable[[], bool]) -> Iterator[int]:
    """``argv`` in its own session (vLLM's multiprocess layout, quiet, the checkout
    importable), output to ``log``; yields its process id once ``ready()``, then SIGTERM to its
    process group, SIGKILL after 60 s. ``RuntimeError`` with the log's tail if it exits first,
    ``TimeoutError`` after 900 s."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            argv, cwd=log.parent, env=env, stdout=out, stderr=out, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 900
        while not ready():
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[2]} exited:\n{log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{argv[2]} not ready in 900 s; log: {log}")
            time.sleep(1)
        yield proc.pid
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def add_model_args(
    p: argparse.ArgumentParser, max_model_len: int | None = None, kv_cache_gib: int = 4
) -> None:
    """``--model``, ``--enforce-eager`` and ``--json``; with ``max_model_len`` (a tool that
    builds the engine itself) also ``--dtype``, ``--max-model-len`` and ``--kv-cache-gib``."""
    p.add_argument("--model", help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--enforce-eager", action="store_true", help="no compilation (faster start)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    if max_model_len is not None:
        p.add_argument("--dtype", default="float32")
        p.add_argument("--max-model-len", type=int, default=max_model_len)
        p.add_argument("--kv-cache-gib", type=int, default=kv_cache_gib, help="KV cache (GiB)")


def model_path(model: str | None) -> str:
    """The model folder asked for, or the embedded SmolLM2."""
    if model is not None:
        return model
    from tllm_core.app.default_model import default_model_path

    return str(default_model_path())


def run_machine(load_start: float) -> dict[str, Any]:
    """The hardware and software a run measured on, the code version it ran, and the 1-minute
    load at its start and end."""
    info: dict[str, Any] = {
        "code": code_version(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_1m_start": load_start,
        "loadavg_1m_end": os.getloadavg()[0],
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        info["mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (OSError, ValueError):
        pass
    try:
        import torch
        import vllm

        info["torch"] = torch.__version__
        info["vllm"] = vllm.__version__
        info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001
        pass
    return info


def code_version(root: Path = ROOT) -> str:
    """The checkout's commit (short), ``+`` when tracked files have uncommitted changes."""
    head = _git(["git", "rev-parse", "--short", "HEAD"], root) or "unknown"
    return head + ("+" if _git(["git", "status", "--porcelain", "-uno"], root) else "")


def _git(cmd: list[str], cwd: Path) -> str:
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def command_line(script: str, argv: list[str] | None = None) -> str:
    """The command a run of ``benchmarks/{script}`` was started with, as results record it."""
    return "python " + shlex.join([f"benchmarks/{script}", *(argv or sys.argv[1:])])


def machine_text(m: dict[str, Any] | None) -> str:
    """One line for a run's ``machine`` record."""
    if not m:
        return "not recorded"
    parts = [
        f"{m['cpu']}, {m.get('cpus', '?')} CPUs" if m.get("cpu") else None,
        m.get("device") if m.get("device") not in (None, "cpu") else None,
        f"torch {m['torch']}" if m.get("torch") else None,
        f"vLLM {m['vllm']}" if m.get("vllm") else None,
        f"load {m['loadavg_1m_start']:.1f} → {m['loadavg_1m_end']:.1f}"
        if "loadavg_1m_end" in m
        else None,
    ]
    return ", ".join(p for p in parts if p)


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A markdown table; numbers right-aligned."""
    first = rows[0] if rows else header
    align = ["---:" if _number(c) else "---" for c in first]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _number(cell: Any) -> bool:
    try:
        float(str(cell).replace("%", "").split(" ")[0])
    except ValueError:
        return False
    return True


def section(title: str, result: dict[str, Any], *tables: str, command: str | None = None) -> str:
    """A docs/results.md section: its title, the result's command, code version and machine
    (one row), then its tables."""
    m = result.get("machine") if isinstance(result.get("machine"), dict) else None
    code = result.get("code") or (m or {}).get("code") or "unknown"
    cmd = command or result.get("command") or "not recorded"
    head = table(["command", "code version", "machine"], [[f"`{cmd}`", code, machine_text(m)]])
    return "\n\n".join([f"## {title}", head, *tables]) + "\n"

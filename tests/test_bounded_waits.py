"""Every wait in shipped code and the benchmark tools has a bound (developers' guide): a blocking
``get``, ``join``, ``wait``, ``acquire``, ``result`` or ``communicate`` without a timeout, or a
``subprocess.run``-style call without a timeout, or a read of a pipe (a loop over it or its
``readline``), or an awaited call to the engine (``rpc``, ``rpc_all``, ``collective_rpc``,
``call_utility_all_async``, ``call_all``) not under ``asyncio.wait_for``, is refused unless a ``bounded:``
comment on its line or the line above says what bounds it. Other awaits (ASGI ``receive`` and
``send``, the app) are the client's pace, not a wait of ours."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("tllm_core", "producers", "consumers", "algorithms", "benchmarks")
BLOCKING = {"get", "join", "wait", "acquire", "result", "communicate"}
SUBPROCESS = {"run", "call", "check_call", "check_output"}  # subprocess's, waiting for the child
PIPES = ("stdout", "stderr")
RPC = {"rpc", "rpc_all", "collective_rpc", "call_utility_all_async", "call_all"}  # to the engine


def _keyword(call: ast.Call, name: str) -> object:
    """The value of keyword ``name`` (``...``: not a constant; None: not given either)."""
    k = next((k for k in call.keywords if k.arg == name), None)
    if k is None:
        return None
    return k.value.value if isinstance(k.value, ast.Constant) else ...


def _bounded(call: ast.Call) -> bool:
    """Whether the call gives a timeout (or does not block): a keyword ``timeout`` or
    ``blocking=False``, or a first argument other than None or True."""
    if _keyword(call, "timeout") is not None:
        return True
    if _keyword(call, "block") is False or _keyword(call, "blocking") is False:
        return True
    first = call.args[0] if call.args else None
    # None or True as the first argument: no timeout (True: ``block``/``blocking``)
    return first is not None and not (
        isinstance(first, ast.Constant) and (first.value is None or first.value is True)
    )


def _waits(call: ast.Call, name: str, receiver: ast.expr) -> bool:
    """Whether ``receiver.name(...)`` may block without a bound."""
    if isinstance(receiver, ast.Name) and receiver.id == "subprocess":
        return name in SUBPROCESS and _keyword(call, "timeout") is None
    if name == "readline":
        return isinstance(receiver, ast.Attribute) and receiver.attr in PIPES
    if name not in BLOCKING or _bounded(call):
        return False
    # a ContextVar (module constants are named in capitals): no wait
    return not (isinstance(receiver, ast.Name) and receiver.id.isupper())


def unbounded_waits(path: Path, source: str) -> list[str]:
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if not _waits(node, node.func.attr, node.func.value):
                continue
        elif isinstance(node, ast.Await):  # an awaited call to the engine, unbounded
            call = node.value
            if not isinstance(call, ast.Call):
                continue
            f = call.func
            if (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")) not in RPC:
                continue
        elif isinstance(node, ast.For):  # reading a pipe line by line until it closes
            it = node.iter
            if not (isinstance(it, ast.Attribute) and it.attr in PIPES):
                continue
        else:
            continue
        near = " ".join(lines[max(0, node.lineno - 2) : node.lineno])
        if "bounded:" not in near:
            what = ast.unparse(node.iter if isinstance(node, ast.For) else node)
            found.append(f"{path}:{node.lineno}: {what}")
    return sorted(found, key=lambda w: int(w.split(":")[1]))


def test_every_blocking_wait_has_a_bound():
    files = subprocess.run(
        ["git", "ls-files", *(f"{p}/*.py" for p in CHECKED)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert files
    found = [w for f in files for w in unbounded_waits(Path(f), (ROOT / f).read_text())]
    assert not found, "waits without a timeout or a 'bounded:' comment:\n" + "\n".join(found)


def test_the_check_sees_an_unbounded_wait():
    src = (
        "q.get()\n"
        "t.join(5)\n"
        "e.wait(timeout=1)\n"
        "VAR.get()\n"
        "# bounded: the watchdog frees it\n"
        "s.acquire()\n"
        "lock.acquire()\n"
        "lock.acquire(blocking=False)\n"
        "q.get(timeout=None)\n"
        "q.get(True)\n"
        "fut.result()\n"
        "for line in proc.stdout:\n    pass\n"
        "subprocess.run(cmd)\n"
        "subprocess.run(cmd, timeout=5)\n"
        "subprocess.run(cmd, timeout=None)\n"
        "subprocess.check_output(cmd)\n"
        "proc.stderr.readline()\n"
        "f.readline()\n"
        "await rpc_all(client, 'tllm_status')\n"
        "await asyncio.wait_for(rpc_all(client, 'tllm_status'), 5)\n"
        "await client.collective_rpc('m')\n"
        "await receive()\n"
    )
    assert unbounded_waits(Path("x.py"), src) == [
        "x.py:1: q.get()",
        "x.py:7: lock.acquire()",
        "x.py:9: q.get(timeout=None)",
        "x.py:10: q.get(True)",
        "x.py:11: fut.result()",
        "x.py:12: proc.stdout",
        "x.py:14: subprocess.run(cmd)",
        "x.py:16: subprocess.run(cmd, timeout=None)",
        "x.py:17: subprocess.check_output(cmd)",
        "x.py:18: proc.stderr.readline()",
        "x.py:20: await rpc_all(client, 'tllm_status')",
        "x.py:22: await client.collective_rpc('m')",
    ]

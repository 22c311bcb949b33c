"""Every wait in shipped code and the benchmark tools has a bound (developers' guide): a blocking ``get()``,
``join()``, ``wait()`` or ``acquire()`` without a timeout is refused unless a ``bounded:``
comment on its line or the line above says what bounds it."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("tllm_core", "producers", "consumers", "algorithms", "benchmarks")
BLOCKING = {"get", "join", "wait", "acquire"}


def unbounded_waits(path: Path, source: str) -> list[str]:
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in BLOCKING or node.args:
            continue
        if any(k.arg in ("timeout", "blocking") for k in node.keywords):
            continue
        receiver = node.func.value
        if isinstance(receiver, ast.Name) and receiver.id.isupper():
            continue  # a ContextVar (module constants are named in capitals): no wait
        near = " ".join(lines[max(0, node.lineno - 2) : node.lineno])
        if "bounded:" not in near:
            found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


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
    )
    assert unbounded_waits(Path("x.py"), src) == ["x.py:1: q.get()", "x.py:7: lock.acquire()"]

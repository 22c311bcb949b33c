"""House style: no module-level mutable singletons in tllm_core, producers, consumers and
algorithms. State belongs to an object whose owner is clear (whoever creates it holds it and
passes it on); a module-level name is a constant: a tuple, frozenset, ``MappingProxyType``,
compiled regex, ``__all__`` -- never a list, dict or set, a lock or event, a counter, and no
``global`` statement.

Where state is process-wide by nature (POSIX signal handlers, the CPUs before vLLM pins the
process's threads), the module keeps one slot for the one value its install/note call makes;
those are listed in :data:`ALLOWED` with why.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tllm_core", "producers", "consumers", "algorithms")

# Calls that build a mutable container, a lock or event, a queue, or a counter.
MUTABLE_CALLS = frozenset(
    {
        "list",
        "dict",
        "set",
        "bytearray",
        "defaultdict",
        "OrderedDict",
        "Counter",
        "ChainMap",
        "deque",
        "fromkeys",  # dict.fromkeys
        "count",  # itertools.count
        "Lock",
        "RLock",
        "Event",
        "Condition",
        "Semaphore",
        "BoundedSemaphore",
        "Barrier",
        "local",  # threading.local
        "Queue",
        "SimpleQueue",
        "LifoQueue",
        "PriorityQueue",
        "WeakValueDictionary",
        "WeakKeyDictionary",
        "WeakSet",
    }
)
MUTABLE_NODES = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)

# (path, name): why the module keeps it. Keep this tiny.
ALLOWED = {
    ("tllm_core/app/stop.py", "_installed"): (
        "POSIX signal handlers are process-wide: the one StopSignals that install() created "
        "and whose bound method handles SIGTERM/SIGINT, until uninstall()"
    ),
    ("tllm_core/runtime/cpus.py", "_noted"): (
        "the process's CPUs before vLLM pins its threads: the pin lasts for the process, so "
        "the first note (a frozenset) is kept for it; plugins' side threads have no worker "
        "object to read it from"
    ),
}


def _called(node: ast.expr) -> str | None:
    if not isinstance(node, ast.Call):
        return None
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)


def _module_statements(body: list[ast.stmt]):
    """Statements run at import: the module's own, and those inside its if/try/with blocks."""
    for stmt in body:
        if isinstance(stmt, ast.If) and "__main__" in ast.unparse(stmt.test):
            continue  # a script's locals, not the module's
        if isinstance(stmt, (ast.If, ast.Try, ast.With)):
            yield from _module_statements(stmt.body)
            yield from _module_statements(getattr(stmt, "orelse", []))
            yield from _module_statements(getattr(stmt, "finalbody", []))
            for handler in getattr(stmt, "handlers", []):
                yield from _module_statements(handler.body)
        else:
            yield stmt


def _targets(stmt: ast.stmt) -> list[str]:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
    names = []
    for t in targets:
        names += [n.id for n in ast.walk(t) if isinstance(n, ast.Name)]
    return names


def findings(source: str, path: str) -> list[str]:
    """``path:line: what`` for each module-level mutable binding and ``global`` statement."""
    tree = ast.parse(source)
    found = []
    for stmt in _module_statements(tree.body):
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or stmt.value is None:
            continue
        value = stmt.value
        call = _called(value)
        if not (isinstance(value, MUTABLE_NODES) or call in MUTABLE_CALLS):
            continue
        for name in _targets(stmt):
            if name != "__all__" and (path, name) not in ALLOWED:
                what = call + "()" if call else type(value).__name__.lower()
                found.append(f"{path}:{stmt.lineno}: {name} is a module-level {what}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            names = [n for n in node.names if (path, n) not in ALLOWED]
            if names:
                found.append(f"{path}:{node.lineno}: global {', '.join(names)}")
    return found


def test_no_module_level_mutable_state():
    found = []
    for package in PACKAGES:
        for file in sorted((ROOT / package).rglob("*.py")):
            rel = file.relative_to(ROOT).as_posix()
            found += findings(file.read_text(encoding="utf-8"), rel)
    assert not found, (
        "module-level mutable state (give it an owner object; constants: tuple, frozenset, "
        "MappingProxyType):\n" + "\n".join(found)
    )


def test_the_allowlist_names_what_exists():
    for path, name in ALLOWED:
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        bound = {
            n
            for s in _module_statements(tree.body)
            if isinstance(s, (ast.Assign, ast.AnnAssign))
            for n in _targets(s)
        }
        assert name in bound, f"{path}: {name} is allowlisted but not bound there any more"


def test_the_check_sees_each_kind():
    src = (
        "import itertools, threading\n"
        "a = []\nb: dict = {}\nc = {1}\nd = set()\ne = threading.Event()\n"
        "f = itertools.count()\ng = dict.fromkeys('x', 0)\nh = [i for i in ()]\n"
        "if True:\n    i = threading.Lock()\n"
        "if __name__ == '__main__':\n    j = []\n"
        "def k():\n    global a\n"
        "__all__ = ['a']\nT = (1, 2)\nF = frozenset({1})\n"
    )
    got = [line.split(": ", 1)[1] for line in findings(src, "m.py")]
    assert [g.split()[0] for g in got] == ["a", "b", "c", "d", "e", "f", "g", "h", "i", "global"]

"""The project's import graph, type-level imports included: a module that names another's
types only under ``if TYPE_CHECKING:`` still depends on it (a reader, a type checker and
any later runtime import follow that edge), so cycles are counted with those imports too.
Shipped packages import nothing from ``benchmarks`` or ``tests`` (neither is installed)."""

from __future__ import annotations

from pathlib import Path

from test_boundaries import ROOT, _imports, _modules


def _graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (the longest module an imported name
    names; a module's own package ``__init__`` left out: importing it is not a cycle of
    responsibilities, the package re-exports the module)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for name, _ in _imports(path, mod, typing=True):
            parts = name.split(".")
            for k in range(len(parts), 0, -1):
                target = ".".join(parts[:k])
                if target in mods:
                    if target != mod and not mod.startswith(target + "."):
                        graph[mod].add(target)
                    break
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """One cycle per back edge of a depth-first walk (none: the graph is acyclic)."""
    cycles: list[str] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join([*stack[stack.index(t) :], t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def test_no_import_cycles_type_level_imports_included():
    cycles = _cycles(_graph(_modules()))
    assert not cycles, "import cycles (TYPE_CHECKING imports included):\n" + "\n".join(cycles)


def test_a_type_only_cycle_is_seen(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from tllm_core.b import B\n")
    b.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tllm_core.a import A\n"
    )
    mods = {"tllm_core.a": a, "tllm_core.b": b}
    assert _cycles(_graph(mods)) == ["tllm_core.a -> tllm_core.b -> tllm_core.a"]


def test_nothing_shipped_imports_benchmarks_or_tests():
    bad = []
    for mod, path in _modules().items():
        for name, line in _imports(path, mod, typing=True):
            if name.split(".")[0] in ("benchmarks", "tests"):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
        text = path.read_text()
        for pkg in ("benchmarks.", "tests."):
            if f'"{pkg}' in text or f"'{pkg}" in text:  # import_module("benchmarks.x")
                bad.append(f"{path.relative_to(ROOT)} names a module of {pkg[:-1]}/")
    assert not bad, "shipped code reaches into benchmarks/ or tests/:\n" + "\n".join(bad)

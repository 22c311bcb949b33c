"""Architecture boundaries, read from the source (no imports executed):

- only ``tllm_core/vllm_bridge/`` imports vLLM internals (anything of ``vllm`` beyond
  ``LLM``, ``SamplingParams`` and the public entry points);
- ``tllm_core`` imports neither ``consumers``, ``algorithms`` nor ``producers``, and names
  no built-in consumer module;
- ``tllm_core``'s layers import only the layers below them (``LAYERS``);
- the built-ins import ``tllm_core``'s public API (its ``__all__``), nothing deeper;
- import cycles: ``test_import_graph.py``.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tllm_core", "producers", "consumers", "algorithms")
# What any module may import from vLLM: the public offline API.
PUBLIC_VLLM = {"vllm.LLM", "vllm.SamplingParams"}
BRIDGE = "tllm_core.vllm_bridge"


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(path: Path, module: str, typing: bool = False) -> list[tuple[str, int]]:
    """Every imported name (``pkg.mod`` or ``pkg.mod.attr``), with its line, including
    imports inside functions (lazy imports are still dependencies); imports only for type
    checkers (``if TYPE_CHECKING:``) are not run, so they are left out unless ``typing``."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree) if typing else _walk_runtime(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[: len(parent) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return out


def _walk_runtime(node: ast.AST):
    """``ast.walk`` without the bodies of ``if TYPE_CHECKING:`` blocks."""
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            for orelse in child.orelse:
                yield from _walk_runtime(orelse)
            continue
        yield from _walk_runtime(child)


def test_only_the_bridge_imports_vllm_internals():
    bad = []
    for mod, path in _modules().items():
        if mod == BRIDGE or mod.startswith(BRIDGE + "."):
            continue
        for name, line in _imports(path, mod):
            if (name == "vllm" or name.startswith("vllm.")) and name not in PUBLIC_VLLM:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "vLLM internals outside tllm_core/vllm_bridge:\n" + "\n".join(bad)


def test_core_imports_no_builtin_package():
    bad = []
    for mod, path in _modules().items():
        if not mod.startswith("tllm_core"):
            continue
        for name, line in _imports(path, mod):
            if name.split(".")[0] in ("consumers", "algorithms", "producers"):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
        text = path.read_text()
        for builtin in ("consumers.", "algorithms.", "producers."):
            if f'"{builtin}' in text or f"'{builtin}" in text:
                bad.append(f"{path.relative_to(ROOT)} names a built-in module ({builtin}...)")
    assert not bad, "tllm_core reaches into built-ins:\n" + "\n".join(bad)


# tllm_core's sub-packages, lowest first: the data flow read upwards from the consumer API
# (docs/index.md, "Layout"). A layer may import its own modules and the layers before it.
LAYERS = ("api", "plugins", "runtime", "serving", "vllm_bridge", "app", "testing")
# Modules of tllm_core's top level: the public API and its lazy loader may import any layer.
TOP = {"tllm_core", "tllm_core.lazy"}


def _layer_violations(mods: dict[str, Path]) -> list[str]:
    bad = []
    for mod, path in mods.items():
        if not mod.startswith("tllm_core.") or mod in TOP:
            continue
        own = LAYERS.index(mod.split(".")[1])
        for name, line in _imports(path, mod):
            parts = name.split(".")
            if parts[0] != "tllm_core" or len(parts) < 2 or parts[1] not in LAYERS:
                continue
            if LAYERS.index(parts[1]) > own:
                bad.append(f"{path.name}:{line}: layer {LAYERS[own]} imports {name}")
    return bad


def test_core_layers_import_only_layers_below():
    mods = _modules()
    layered = {m.split(".")[1] for m in mods if m.startswith("tllm_core.") and m not in TOP}
    assert layered == set(LAYERS), f"tllm_core sub-packages {sorted(layered)} != {LAYERS}"
    bad = _layer_violations(mods)
    assert not bad, "a tllm_core layer imports a layer above it:\n" + "\n".join(bad)


def test_the_layer_check_sees_an_upward_import(tmp_path):
    f = tmp_path / "rows.py"
    f.write_text("def f():\n    from tllm_core.app.engine import TllmLLM\n")
    assert _layer_violations({"tllm_core.api.rows": f}) == [
        "rows.py:2: layer api imports tllm_core.app.engine.TllmLLM"
    ]
    assert _layer_violations({"tllm_core.app.cli": f}) == []


def _public_names() -> set[str]:
    import tllm_core  # cheap: every public name is imported on first use

    return set(tllm_core.__all__)


def _deep_core_imports(mods: dict[str, Path], public: set[str]) -> list[str]:
    bad = []
    for mod, path in mods.items():
        if mod.split(".")[0] == "tllm_core":
            continue
        for name, line in _imports(path, mod):
            parts = name.split(".")
            if parts[0] != "tllm_core" or parts[:2] == ["tllm_core", "lazy"]:
                continue
            if len(parts) != 2 or parts[1] not in public:
                bad.append(f"{path.name}:{line} imports {name}")
    return bad


def test_builtins_import_only_the_public_api():
    bad = _deep_core_imports(_modules(), _public_names())
    assert not bad, "built-ins reach past tllm_core's public API:\n" + "\n".join(bad)


def test_the_public_api_check_sees_a_deep_import(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text("from tllm_core import Consumer\nfrom tllm_core.api.rows import RowInfo\n")
    assert _deep_core_imports({"consumers.mine": f}, {"Consumer", "RowInfo"}) == [
        "mine.py:2 imports tllm_core.api.rows.RowInfo"
    ]


def test_every_lazy_export_resolves_to_its_type_checking_import():
    """A package exporting names on first use (tllm_core/lazy.py) lists them once, as its
    ``if TYPE_CHECKING:`` imports: each resolves at run time to what its import names."""
    mods = _modules()
    lazy = sorted(m for m, p in mods.items() if "= lazy_exports(" in p.read_text())
    assert len(lazy) >= 6, lazy  # tllm_core, .testing, producers, esamp, export, steer
    for mod in lazy:
        package = importlib.import_module(mod)
        typed = set(_imports(mods[mod], mod, typing=True)) - set(_imports(mods[mod], mod))
        homes = [name.rpartition(".") for name, _ in typed]
        assert sorted(package.__all__) == sorted(n for _, _, n in homes), mod
        for home, _, name in homes:
            got = getattr(package, name)  # first: a submodule is its package's attribute after
            want = getattr(importlib.import_module(home), name, None)
            assert got is want is not None, f"{mod}.{name} is not {home}.{name}"


def test_the_checks_see_a_violation(tmp_path):
    """The parser resolves relative and lazy imports, so the checks above can fail."""
    f = tmp_path / "mod.py"
    f.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a.b\n"
        "def f():\n    from ..x import y\n    import vllm.v1.worker\n"
    )
    names = [n for n, _ in _imports(f, "tllm_core.sub.mod")]
    assert names == ["typing.TYPE_CHECKING", "tllm_core.x.y", "vllm.v1.worker"]

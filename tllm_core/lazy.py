"""Public names imported on first use (PEP 562): a package's entry point stays cheap to import
(no torch, no vLLM) while ``from package import Name`` keeps working."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def lazy_getattr(package: str, home: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: each name of ``home`` (name -> module)
    imported from its module when first asked for; a name that is its module's own last
    component (``"cli_common": "pkg.app.cli_common"``) is the module itself."""

    def __getattr__(name: str) -> Any:
        if name in home:
            module = importlib.import_module(home[name])
            return module if home[name].rpartition(".")[2] == name else getattr(module, name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def lazy_exports(package: str, init_file: str) -> tuple[list[str], Callable[[str], Any]]:
    """``(__all__, __getattr__)`` of a package whose public names are the imports of the
    ``if TYPE_CHECKING:`` block of its ``__init__.py``: one list, read by type checkers and
    editors there and imported on first use here (a submodule imported by name is itself)."""
    home: dict[str, str] = {}
    for node in ast.parse(Path(init_file).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                if isinstance(imp, ast.ImportFrom) and imp.module:
                    for alias in imp.names:
                        home[alias.asname or alias.name] = f"{imp.module}.{alias.name}"

    def __getattr__(name: str) -> Any:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attr = home[name].rpartition(".")
        parent = importlib.import_module(module)
        return (
            getattr(parent, attr) if hasattr(parent, attr) else importlib.import_module(home[name])
        )

    return sorted(home), __getattr__

"""Public names imported on first use (PEP 562): a package's entry point stays cheap to import
(no torch, no vLLM) while ``from package import Name`` keeps working."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any


def lazy_exports(package: str, init_file: str) -> tuple[list[str], Callable[[str], Any]]:
    """``(__all__, __getattr__)`` exporting the imports of the ``if TYPE_CHECKING:`` block of
    ``init_file`` (a name its module lacks is a submodule: ``from pkg.app import cli_common``)."""
    home: dict[str, str] = {}
    for node in ast.parse(Path(init_file).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                if isinstance(imp, ast.ImportFrom) and imp.module and not imp.level:
                    for alias in imp.names:
                        if alias.asname:  # imported on first use by its own name only
                            raise ImportError(f"{init_file}: 'as {alias.asname}' in the exports")
                        home[alias.name] = imp.module
    if not home:  # a guard spelled otherwise would export nothing, silently
        raise ImportError(f"{init_file}: no absolute imports under 'if TYPE_CHECKING:' to export")

    def __getattr__(name: str) -> Any:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(home[name])
        if hasattr(module, name):
            return getattr(module, name)
        return importlib.import_module(f"{home[name]}.{name}")

    return sorted(home), __getattr__

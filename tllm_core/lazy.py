"""Public names imported on first use (PEP 562): a package's entry point stays cheap to import
(no torch, no vLLM) while ``from package import Name`` keeps working."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
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

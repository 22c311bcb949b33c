"""Which vLLM versions the bridge supports (see CONTRACT.md); runners: ``worker_setup.py``."""

from __future__ import annotations

import os

from tllm_core.vllm_bridge.errors import UnsupportedEngineError

SUPPORTED_SERIES = ("0.32", "0.33")


def in_series(version: str, series: str) -> bool:
    """``version`` belongs to release series ``series`` ("0.32" holds "0.32" and "0.32.1")."""
    return version == series or version.startswith(series + ".")


def check_version(version: str | None = None) -> str:
    """``version`` (default: the installed vLLM's), or ``UnsupportedEngineError``."""
    if version is None:
        import vllm

        version = vllm.__version__
    supported = any(in_series(version, s) for s in SUPPORTED_SERIES)
    if not supported and os.environ.get("TLLM_ALLOW_UNSUPPORTED_VLLM") != "1":
        raise UnsupportedEngineError(
            f"tllm supports vLLM {', '.join(s + '.x' for s in SUPPORTED_SERIES)}; found {version}. "
            f"Install a supported version, or set TLLM_ALLOW_UNSUPPORTED_VLLM=1 to try anyway "
            f"(the bridge still fails loudly if a hooked method is missing)."
        )
    return version


def _has(obj: object, path: str) -> bool:
    for part in path.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def require_attrs(obj: object, paths: tuple[str, ...], what: str) -> None:
    """``UnsupportedEngineError`` naming every dotted path of ``paths`` that ``obj`` lacks."""
    missing = [p for p in paths if not _has(obj, p)]
    if missing:
        raise UnsupportedEngineError(
            f"vLLM's {what} lacks {', '.join(repr(m) for m in missing)}: this vLLM is not supported"
        )

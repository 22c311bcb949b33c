"""Which vLLM versions the bridge supports (see CONTRACT.md); runners: ``runners.py``."""

from __future__ import annotations

import os

from tllm_core.vllm_bridge.errors import UnsupportedEngineError

SUPPORTED_SERIES = ("0.32", "0.33")


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def in_series(version: str, series: str) -> bool:
    """``version`` belongs to release series ``series`` ("0.32" holds "0.32" and "0.32.1")."""
    return version == series or version.startswith(series + ".")


def check_version(version: str | None = None) -> str:
    version = version or vllm_version()
    if not any(in_series(version, s) for s in SUPPORTED_SERIES):
        if os.environ.get("TLLM_ALLOW_UNSUPPORTED_VLLM") != "1":
            raise UnsupportedEngineError(
                f"tllm supports vLLM {', '.join(s + '.x' for s in SUPPORTED_SERIES)}; found {version}. "
                f"Install a supported version, or set TLLM_ALLOW_UNSUPPORTED_VLLM=1 to try anyway "
                f"(the bridge still fails loudly if a hooked method is missing)."
            )
    return version


def missing_attrs(obj: object, paths: tuple[str, ...]) -> list[str]:
    """The dotted attribute paths of ``paths`` that ``obj`` does not have."""
    missing = []
    for path in paths:
        cur = obj
        for part in path.split("."):
            if not hasattr(cur, part):
                missing.append(path)
                break
            cur = getattr(cur, part)
    return missing


def require_attrs(obj: object, paths: tuple[str, ...], what: str) -> None:
    """``UnsupportedEngineError`` naming every path of ``paths`` that ``obj`` (vLLM's
    ``what``, e.g. "V2 runner") lacks; nothing when it has them all."""
    missing = missing_attrs(obj, paths)
    if missing:
        raise UnsupportedEngineError(
            f"vLLM's {what} lacks {', '.join(repr(m) for m in missing)}: this vLLM is not supported"
        )

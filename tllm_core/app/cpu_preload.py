"""The libraries vLLM's CPU backend asks to have preloaded (tcmalloc, Intel OpenMP): the
``tllm`` command puts those it finds into its engine processes' ``LD_PRELOAD``
(``TLLM_NO_PRELOAD=1``: off)."""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

OFF_ENV = "TLLM_NO_PRELOAD"
TCMALLOC_FILES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
IOMP_FILES = ("libiomp5.so",)
OPENMP_KINDS = ("libiomp", "libomp", "libgomp")


def _lib_dirs() -> list[Path]:
    prefixes = dict.fromkeys([sys.prefix, sys.base_prefix, sys.exec_prefix])
    dirs = [Path(p) / "lib" for p in prefixes]
    dirs += [Path(d) for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")]
    dirs += [Path(d) for d in ("/usr/lib/aarch64-linux-gnu", "/usr/local/lib")]
    return dirs


def find(files: tuple[str, ...]) -> str | None:
    """The first existing library among ``files`` in the usual library folders."""
    for d in _lib_dirs():
        for f in files:
            if (d / f).is_file():
                return str(d / f)
    return None


def apply(env: MutableMapping[str, str] | None = None) -> list[str]:
    """Prepend the found libraries of kinds ``env["LD_PRELOAD"]`` lacks; returns what was added."""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux") or env.get(OFF_ENV, "") not in ("", "0"):
        return []
    current = env.get("LD_PRELOAD", "")
    added = []
    tcmalloc = find(TCMALLOC_FILES)
    if tcmalloc and "libtcmalloc" not in current:
        added.append(tcmalloc)
    iomp = find(IOMP_FILES)
    # One OpenMP runtime only: vLLM refuses an LD_PRELOAD naming both libiomp and libgomp
    # (e.g. inherited from a process where vLLM preloaded PyTorch's libgomp itself).
    if iomp and not any(k in current for k in OPENMP_KINDS):
        added.append(iomp)
    if added:
        env["LD_PRELOAD"] = ":".join([*added, *([current] if current else [])])
    return added

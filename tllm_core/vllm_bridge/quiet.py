"""A quiet ``tllm`` command (unless ``-v``): vLLM's and torch's known-harmless messages hidden
in every process (:func:`quiet_env` for the engine processes, :func:`install` in each).
Every warning not listed still shows, as do all errors."""

from __future__ import annotations

import builtins
import logging
import os
import re
import warnings
from pathlib import Path

QUIET_ENV = "TLLM_QUIET"
LOGGING_CONFIG = Path(__file__).with_name("vllm_quiet_logging.json")

# vLLM log messages (regular expressions) known to be harmless on the CPU build.
HARMLESS: tuple[str, ...] = (
    # No Triton for CPU in the wheel: vLLM uses its own CPU kernels.
    r"Triton is installed, but doesn't include CPU backend",
    r"Triton is not installed\. triton-cpu is expected",
    # vLLM's own runner choice on the CPU build: tllm names the runner it hooked.
    r"Model Runner V2 requires Triton; using the V1 model runner instead",
    # --enforce-eager does what it says.
    r"Enforce eager set, disabling torch\.compile",
    r"Inductor compilation was disabled by user settings",
    # Mamba-only setting, reset for every model on CPU.
    r"Reset SSM cache type to float32",
    # Allocator/OpenMP advice: tllm preloads these itself (unless TLLM_NO_PRELOAD=1).
    r"(libtcmalloc|libiomp) is not found in LD_PRELOAD",
    # The default 2 GiB KV cache is tllm's choice (--kv-cache-gib).
    r"VLLM_CPU_KVCACHE_SPACE",
    # vLLM's default sampling settings notice (the command sets its own).
    r"Default sampling parameters have been overridden",
)

# Errors vLLM logs after its engine has stopped, as a consequence (the cause still shows).
CONSEQUENCES: tuple[str, ...] = (
    # The server's output task sees the engine gone when the server stops it.
    r"AsyncLLM output_handler failed",
    # A dead engine core: tllm names the process and its signal itself (engine_watch.py).
    r"engine core exited unexpectedly; starting cleanup",
)

# Python warnings ignored (``PYTHONWARNINGS`` entries: action:message-prefix:category).
PY_WARNINGS: tuple[str, ...] = (
    # vLLM's Triton dispatcher looks at every torch attribute, deprecated ones included.
    "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning",
)

_PATTERN = re.compile("|".join(f"(?:{p})" for p in HARMLESS))
_CONSEQUENCE = re.compile("|".join(f"(?:{p})" for p in CONSEQUENCES))


class HarmlessFilter(logging.Filter):
    """Drops records below ERROR matching :data:`HARMLESS`, and any matching CONSEQUENCES."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken record is vLLM's to show
            return True
        if _CONSEQUENCE.search(msg):
            return False
        exc = record.exc_info[1] if record.exc_info else None
        if type(exc).__name__ == "VLLMValidationError":  # a client's bad request (in a stream)
            record.msg, record.args, record.exc_info = f"{msg} {exc}", (), None
        return record.levelno >= logging.ERROR or _PATTERN.search(msg) is None


def quiet_env(verbose: bool) -> dict[str, str]:
    """Environment for the command's process and its engine processes (see module doc)."""
    env = {"VLLM_LOGGING_STREAM": "ext://sys.stderr"}  # stdout is for results
    if verbose:
        return env
    theirs = os.environ.get("PYTHONWARNINGS", "")
    return env | {
        QUIET_ENV: "1",
        "VLLM_LOGGING_CONFIG_PATH": str(LOGGING_CONFIG),
        "VLLM_LOGGING_LEVEL": "WARNING",
        "PYTHONWARNINGS": ",".join(w for w in (theirs, *PY_WARNINGS) if w),
        "TORCH_CPP_LOG_LEVEL": "ERROR",
    }


def install() -> None:
    """In this process: the filter on the last-resort and vLLM's handlers, and the ignored
    Python warnings (idempotent)."""
    for handler in (logging.lastResort, *logging.getLogger("vllm").handlers):
        if handler is not None and not any(isinstance(f, HarmlessFilter) for f in handler.filters):
            handler.addFilter(HarmlessFilter())
    for entry in PY_WARNINGS:
        _, message, category = entry.split(":")
        warnings.filterwarnings(
            "ignore", message=re.escape(message), category=getattr(builtins, category)
        )


def install_if_quiet() -> None:
    """:func:`install` when the ``tllm`` command asked for quiet processes."""
    if os.environ.get(QUIET_ENV) == "1":
        install()

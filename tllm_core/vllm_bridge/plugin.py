"""vLLM general plugin (entry point ``vllm.general_plugins: tllm``).

vLLM loads it in every process. It wraps the V1 runners' ``load_model`` so that,
after the weights load and before anything compiles, a runner whose config carries
``additional_config["tllm"]`` gets the tllm hooks. Without that key the wrapper
calls the original and returns: nothing of tllm is in the request path.

In the OpenAI server (``vllm serve``) it also adds :class:`EndpointGate` to the endpoint
plugins the API server loads; the gate does nothing unless the server's
``--additional-config`` carries the ``tllm`` key, in which case it wires up
:mod:`tllm_core.vllm_bridge.serving` (request checks, cache salt, ``/tllm/*`` routes).
"""

from __future__ import annotations

import functools
import logging
import os

log = logging.getLogger("tllm")

_PATCHED_ATTR = "_tllm_patched"


def _wrap_load_model(cls: type) -> None:
    orig = cls.__dict__.get("load_model")
    if orig is None or getattr(orig, _PATCHED_ATTR, False):
        return

    @functools.wraps(orig)
    def load_model(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        cfg = (self.vllm_config.additional_config or {}).get("tllm")
        if cfg is not None:
            from tllm_core.vllm_bridge.hooks import install

            install(self, cfg)
            from tllm_core.vllm_bridge.worker_ext import ensure_worker_methods

            ensure_worker_methods(self.vllm_config)
        return out

    setattr(load_model, _PATCHED_ATTR, True)
    cls.load_model = load_model


def register() -> None:
    if os.environ.get("TLLM_DISABLE_PLUGIN") == "1":
        return
    from tllm_core.vllm_bridge import workarounds

    workarounds.apply()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _wrap_load_model(GPUModelRunner)
    _patch_v2_if_present()
    _patch_endpoint_plugins()
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:  # CUDA builds may not ship the CPU runner
        return
    _wrap_load_model(CPUModelRunner)


def _refuse_v2(cls: type) -> None:
    """The V2 GPU runner is not hooked: refuse loudly instead of capturing nothing."""
    orig = cls.__dict__.get("load_model")
    if orig is None or getattr(orig, _PATCHED_ATTR, False):
        return

    @functools.wraps(orig)
    def load_model(self, *args, **kwargs):
        if (self.vllm_config.additional_config or {}).get("tllm") is not None:
            from tllm_core.vllm_bridge.version import UnsupportedEngineError

            raise UnsupportedEngineError(
                "tllm consumers are configured but vLLM selected its V2 model runner, which "
                "tllm does not hook. Set VLLM_USE_V2_MODEL_RUNNER=0 (tllm's own LLM wrapper "
                "and CLI do this for you)."
            )
        return orig(self, *args, **kwargs)

    setattr(load_model, _PATCHED_ATTR, True)
    cls.load_model = load_model


def _patch_v2_if_present() -> None:
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    except Exception:  # noqa: BLE001 - absent or not importable on this platform (CPU)
        return
    _refuse_v2(V2Runner)


# -- the OpenAI server ----------------------------------------------------------------------
def _tllm_settings(additional_config) -> dict | None:
    if isinstance(additional_config, str):
        import json

        try:
            additional_config = json.loads(additional_config)
        except ValueError:
            return None
    if not isinstance(additional_config, dict):
        return None
    return additional_config.get("tllm")


class EndpointGate:
    """vLLM endpoint plugin (API server only) that is inert unless the tllm switch is on."""

    name = "tllm"
    required_tasks = None

    def __init__(self) -> None:
        self.active = False
        self.engine = None  # EngineConsumers, built once in attach_router

    def attach_router(self, app) -> None:
        cfg = _tllm_settings(getattr(getattr(app.state, "args", None), "additional_config", None))
        if cfg is None:
            return
        from tllm_core.serving.keys import EngineConsumers
        from tllm_core.vllm_bridge.serving import attach_routes

        self.active = True
        # The front end's check of the consumer names and configs (the worker checks again).
        self.engine = EngineConsumers.from_settings(cfg)
        attach_routes(app, self.engine)

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is None:
            return
        cfg = _tllm_settings(engine_client.vllm_config.additional_config)
        if cfg is None:
            return
        from tllm_core.serving.keys import EngineConsumers
        from tllm_core.vllm_bridge.serving import init_state

        engine = self.engine if self.engine is not None else EngineConsumers.from_settings(cfg)
        await init_state(engine_client, state, engine)


def _patch_endpoint_plugins() -> None:
    """Append :class:`EndpointGate` to what ``vllm.plugins.load_endpoint_plugins`` returns.

    vLLM loads ``vllm.endpoint_plugins`` entry points only when named in ``VLLM_PLUGINS``;
    the gate is added here instead, so that ``--additional-config`` alone is the switch.
    """
    import vllm.plugins as vp

    orig = getattr(vp, "load_endpoint_plugins", None)
    if orig is None:
        # Not silent: serving would run without per-request validation or /tllm endpoints.
        log.warning(
            "tllm: vllm.plugins.load_endpoint_plugins is missing in this vLLM; "
            "serving runs without tllm's request checks and /tllm endpoints"
        )
        return
    if getattr(orig, _PATCHED_ATTR, False):
        return

    @functools.wraps(orig)
    def load_endpoint_plugins(*args, **kwargs):
        return [*orig(*args, **kwargs), EndpointGate()]

    setattr(load_endpoint_plugins, _PATCHED_ATTR, True)
    vp.load_endpoint_plugins = load_endpoint_plugins

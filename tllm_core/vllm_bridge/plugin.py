"""vLLM general plugin (entry point ``vllm.general_plugins: tllm``).

vLLM loads it in every process. It wraps the V1 runners' ``load_model`` so that,
after the weights load and before anything compiles, a runner whose config carries
``additional_config["tllm"]`` gets the tllm hooks. Without that key the wrapper
calls the original and returns: nothing of tllm is in the request path.
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
        return out

    setattr(load_model, _PATCHED_ATTR, True)
    cls.load_model = load_model


def register() -> None:
    if os.environ.get("TLLM_DISABLE_PLUGIN") == "1":
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _wrap_load_model(GPUModelRunner)
    _patch_v2_if_present()
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

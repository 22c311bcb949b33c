"""Which adapter hooks the model runner vLLM built (CONTRACT.md, "Runners"): read from the
runner's class hierarchy by module name, so neither runner module is imported (V2's pulls in
Triton kernels)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from tllm_core.vllm_bridge.errors import UnsupportedEngineError
from tllm_core.vllm_bridge.parallel import check_layout
from tllm_core.vllm_bridge.runner_base import LOADED_MODEL_ATTRS, RunnerAdapterBase
from tllm_core.vllm_bridge.v1_runner import V1RunnerAdapter
from tllm_core.vllm_bridge.v2_runner import V2RunnerAdapter
from tllm_core.vllm_bridge.version import require_attrs

# (module, class) of each runner generation's base class -> its adapter
ADAPTERS: Mapping[tuple[str, str], type[RunnerAdapterBase]] = MappingProxyType(
    {
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"): V1RunnerAdapter,
        ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"): V2RunnerAdapter,
    }
)


def adapter_class(runner: object) -> type[RunnerAdapterBase]:
    """The adapter for ``runner``'s generation, or ``UnsupportedEngineError`` naming it."""
    for cls in type(runner).__mro__:
        found = ADAPTERS.get((cls.__module__, cls.__name__))
        if found is not None:
            return found
    cls = type(runner)
    known = ", ".join(f"{m}.{c}" for m, c in ADAPTERS)
    raise UnsupportedEngineError(
        f"tllm has no adapter for vLLM's model runner {cls.__module__}.{cls.__name__}; "
        f"supported runners derive from {known}"
    )


def check_runner(runner: object) -> type[RunnerAdapterBase]:
    """Refuse, before the first step, a runner tllm cannot hook; return its adapter class."""
    adapter = adapter_class(runner)
    paths = adapter.required_attrs
    if getattr(runner, "model", None) is not None:
        paths = paths + LOADED_MODEL_ATTRS
    require_attrs(runner, paths, f"{adapter.generation} runner")
    if getattr(runner, "speculative_config", None) is not None:
        raise UnsupportedEngineError("tllm does not support speculative decoding yet")
    check_layout(runner.vllm_config.parallel_config)
    return adapter

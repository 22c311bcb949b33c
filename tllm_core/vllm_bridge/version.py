"""Which vLLM versions and model runners the bridge supports (see CONTRACT.md)."""

from __future__ import annotations

import os

from tllm_core.vllm_bridge.errors import UnsupportedEngineError
from tllm_core.vllm_bridge.parallel import check_layout

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


# Every runner attribute the hooks read or wrap (see CONTRACT.md), as dotted paths. Checked when
# tllm attaches to the worker, before the weights load, and again when the hooks are installed.
RUNNER_ATTRS = (
    "_prepare_inputs",
    "execute_model",
    "execute_model_state",
    "_sample",
    "sampler.topk_topp_sampler.forward",
    "input_batch.req_ids",
    "input_batch.num_reqs",
    "input_batch.num_computed_tokens_cpu",
    "input_batch.num_tokens_no_spec",
    "input_batch.sampling_metadata",
    "requests",
    "input_ids.gpu",
    "max_num_tokens",
    "device",
    "model_config",
    "vllm_config.additional_config",
    "vllm_config.parallel_config",
)
# Read once the weights are loaded (``runner.model`` exists only then).
LOADED_MODEL_ATTRS = ("model.compute_logits", "model.model.layers")


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


def check_runner(runner: object) -> None:
    """The bridge hooks the V1 runner (GPUModelRunner and its CPU subclass) only."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception as e:  # noqa: BLE001 - reported, never swallowed
        raise UnsupportedEngineError(
            f"tllm cannot import vLLM's V1 model runner ({type(e).__name__}: {e}): "
            f"this vLLM is not supported"
        ) from e

    if not isinstance(runner, GPUModelRunner):
        raise UnsupportedEngineError(
            f"tllm hooks vLLM's V1 model runner; this engine uses {type(runner).__module__}."
            f"{type(runner).__name__} (vLLM's V2 runner is not supported). On GPU set "
            f"VLLM_USE_V2_MODEL_RUNNER=0 (tllm sets it when it starts the engine itself)."
        )
    paths = RUNNER_ATTRS
    if getattr(runner, "model", None) is not None:
        paths = paths + LOADED_MODEL_ATTRS
    missing = missing_attrs(runner, paths)
    if missing:
        raise UnsupportedEngineError(
            f"vLLM runner lacks {', '.join(repr(m) for m in missing)}: this vLLM is not supported"
        )
    if getattr(runner, "speculative_config", None) is not None:
        raise UnsupportedEngineError("tllm does not support speculative decoding yet")

    check_layout(runner.vllm_config.parallel_config)

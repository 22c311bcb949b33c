"""Which vLLM versions and model runners the bridge supports (see CONTRACT.md)."""

from __future__ import annotations

import os

SUPPORTED_SERIES = ("0.32", "0.33")


class UnsupportedEngineError(RuntimeError):
    """vLLM version, runner or model layout the bridge does not support."""


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


def check_runner(runner: object) -> None:
    """The bridge hooks the V1 runner (GPUModelRunner and its CPU subclass) only."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not isinstance(runner, GPUModelRunner):
        raise UnsupportedEngineError(
            f"tllm hooks vLLM's V1 model runner; this engine uses {type(runner).__module__}."
            f"{type(runner).__name__}. On GPU set VLLM_USE_V2_MODEL_RUNNER=0 (tllm sets it "
            f"when it starts the engine itself)."
        )
    for name in ("_prepare_inputs", "execute_model", "_sample", "sampler", "input_batch"):
        if not hasattr(runner, name):
            raise UnsupportedEngineError(f"vLLM runner lacks {name!r}: this vLLM is not supported")
    if getattr(runner, "speculative_config", None) is not None:
        raise UnsupportedEngineError("tllm does not support speculative decoding yet")
    pc = runner.vllm_config.parallel_config
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        raise UnsupportedEngineError(
            "tllm supports tensor_parallel_size=1 and pipeline_parallel_size=1 only "
            f"(got tp={pc.tensor_parallel_size}, pp={pc.pipeline_parallel_size})"
        )

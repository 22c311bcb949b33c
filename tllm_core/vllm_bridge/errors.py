"""The bridge's error type (its own module: every bridge module raises it)."""


class UnsupportedEngineError(RuntimeError):
    """vLLM version, runner or model layout the bridge does not support."""


def vllm_value_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a bad value given to its public objects (``SamplingParams``):
    ``ValueError``, and its ``VLLMValidationError``, which is no ``ValueError``."""
    from vllm.exceptions import VLLMValidationError

    return (ValueError, VLLMValidationError)

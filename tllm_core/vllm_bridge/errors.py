"""The bridge's error types (their own module: every bridge module raises them)."""


class UnsupportedEngineError(RuntimeError):
    """vLLM version, runner or model layout the bridge does not support."""


class EngineNoAnswer(RuntimeError):
    """The engine did not answer a tllm call in time."""


def vllm_value_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a bad value given to its public objects (``SamplingParams``):
    ``ValueError``, and its ``VLLMValidationError``, which is no ``ValueError``."""
    from vllm.exceptions import VLLMValidationError

    return (ValueError, VLLMValidationError)

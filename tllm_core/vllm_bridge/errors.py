"""The bridge's error types (their own module: every bridge module raises them)."""


class UnsupportedEngineError(RuntimeError):
    """vLLM version, runner or model layout the bridge does not support."""


class EngineNoAnswer(RuntimeError):
    """The engine did not answer a tllm call in time."""


class EngineLost(EngineNoAnswer):
    """A node of the engine is lost: the server stops, and sends it no more tllm calls."""


class EngineCallFailed(RuntimeError):
    """The engine answered a tllm call with an error (a worker's, or vLLM's own timeout)."""


def vllm_value_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a bad value given to its public objects (``SamplingParams``):
    ``ValueError``, and its ``VLLMValidationError``, which is no ``ValueError``."""
    from vllm.exceptions import VLLMValidationError

    return (ValueError, VLLMValidationError)

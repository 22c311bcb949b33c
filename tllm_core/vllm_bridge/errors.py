"""The bridge's error type (its own module: every bridge module raises it)."""


class UnsupportedEngineError(RuntimeError):
    """vLLM version, runner or model layout the bridge does not support."""

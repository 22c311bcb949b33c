"""The request keys and their checks, for the server and ``TllmLLM`` alike (no vLLM here)."""

from tllm_core.serving.keys import KEYS, EngineConsumers, request_salt, validate_extra_args

__all__ = ["KEYS", "EngineConsumers", "request_salt", "validate_extra_args"]

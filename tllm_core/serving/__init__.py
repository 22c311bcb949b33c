"""Serving: the request keys and their validation against an engine's consumers (server and
``TllmLLM`` alike), without vLLM; the wiring lives in :mod:`tllm_core.vllm_bridge.serving`.
"""

from tllm_core.serving.keys import (
    KEYS,
    EngineConsumers,
    request_salt,
    validate_extra_args,
)

__all__ = ["KEYS", "EngineConsumers", "request_salt", "validate_extra_args"]

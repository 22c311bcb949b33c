"""Serving: per-request settings of tllm consumers behind vLLM's OpenAI server.

Engine-neutral (nothing here imports vLLM): the generic request keys, the consumers' own keys
and their validation against the consumers an engine was started with (used by the server
and by ``TllmLLM`` alike). The vLLM wiring (HTTP 400, cache salt, the ``/tllm/*`` routes)
lives in :mod:`tllm_core.vllm_bridge.serving`.
"""

from tllm_core.serving.keys import (
    KEYS,
    EngineConsumers,
    request_salt,
    validate_extra_args,
)

__all__ = ["KEYS", "EngineConsumers", "request_salt", "validate_extra_args"]

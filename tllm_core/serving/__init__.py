"""Serving: per-request settings of tllm consumers behind vLLM's OpenAI server.

Engine-neutral (nothing here imports vLLM): the keys a client may put in ``vllm_xargs`` and
their validation against the consumers a server was started with. The vLLM wiring (HTTP 400,
cache salt, the ``/tllm/*`` routes) lives in :mod:`tllm_core.vllm_bridge.serving`.
"""

from tllm_core.serving.keys import (
    KEYS,
    ServerConsumers,
    request_salt,
    validate_extra_args,
)

__all__ = ["KEYS", "ServerConsumers", "request_salt", "validate_extra_args"]

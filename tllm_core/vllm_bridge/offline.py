"""``LLM.chat`` takes no ``cache_salt``: :func:`chat_with_salts` salts each conversation as
``TllmLLM.generate`` salts prompts (CONTRACT.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tllm_core.vllm_bridge.errors import UnsupportedEngineError


def chat_with_salts(llm: Any, salts: Sequence[str | None], messages: Any, params: Any, **kwargs):
    """``llm.chat(messages, params, **kwargs)`` with ``salts[i]`` set on the engine input
    ``LLM._preprocess_chat_one`` renders for conversation ``i`` (one already there is kept)."""
    if not any(s is not None for s in salts):
        return llm.chat(messages, params, **kwargs)
    render = llm._preprocess_chat_one
    pending = iter(salts)

    def _preprocess_chat_one(*args, **kw):
        engine_input = render(*args, **kw)
        salt = next(pending)
        if salt is None or (isinstance(engine_input, dict) and engine_input.get("cache_salt")):
            return engine_input
        if not isinstance(engine_input, dict):
            raise UnsupportedEngineError(
                f"vLLM rendered a chat as {type(engine_input).__name__}, not a dict: tllm cannot "
                f"salt its prefix cache in this vLLM"
            )
        return {**engine_input, "cache_salt": salt}

    llm._preprocess_chat_one = _preprocess_chat_one
    try:
        return llm.chat(messages, params, **kwargs)
    finally:
        del llm._preprocess_chat_one

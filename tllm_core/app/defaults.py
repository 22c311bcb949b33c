"""The defaults ``TllmLLM``, every ``tllm`` command and ``ConsumerKit`` share: float32 (full
speed on any x86 CPU, matches transformers' forward, so one prompt gives the same text in
each) and a 2 GiB CPU KV cache (vLLM's CPU backend would reserve 92% of the memory)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from tllm_core.runtime.environ import env_set

DEFAULT_DTYPE = "float32"
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT_KV_CACHE_GIB = 2


def kv_cache_gib(gib: int | None = None, llm_kwargs: Mapping[str, Any] | None = None) -> str | None:
    """``VLLM_CPU_KVCACHE_SPACE``'s value: ``gib``, else None when the user chose a size
    (the variable or ``kv_cache_memory_bytes``), else the default."""
    if gib is not None:
        return str(gib)
    if os.environ.get(KV_ENV) or (llm_kwargs or {}).get("kv_cache_memory_bytes") is not None:
        return None
    return str(DEFAULT_KV_CACHE_GIB)


def default_kv_cache(llm_kwargs: Mapping[str, Any]) -> AbstractContextManager[None]:
    """The default KV cache size while ``vllm.LLM(...)`` starts, unless the caller chose one."""
    value = kv_cache_gib(None, llm_kwargs)
    return env_set(KV_ENV, value) if value is not None else nullcontext()

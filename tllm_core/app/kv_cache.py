"""The CPU KV cache default that ``TllmLLM`` and every ``tllm`` command share.

On vLLM's CPU backend the KV cache is ``VLLM_CPU_KVCACHE_SPACE`` GiB (or the engine argument
``kv_cache_memory_bytes``); when neither is given, vLLM reserves ``gpu_memory_utilization``
(default 0.92) of the machine's memory instead and refuses to start when that much is not
free. tllm gives both front ends one small default instead: 2 GiB. The variable is read by
the CPU backend only; on a GPU it changes nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT_KV_CACHE_GIB = 2


def kv_cache_gib(gib: int | None = None, llm_kwargs: Mapping[str, Any] | None = None) -> str | None:
    """The value ``VLLM_CPU_KVCACHE_SPACE`` must have: ``gib`` when given, else None (leave it)
    when the user set the variable or passed ``kv_cache_memory_bytes``, else the default."""
    if gib is not None:
        return str(gib)
    if os.environ.get(KV_ENV) or (llm_kwargs or {}).get("kv_cache_memory_bytes") is not None:
        return None
    return str(DEFAULT_KV_CACHE_GIB)


@contextmanager
def default_kv_cache(llm_kwargs: Mapping[str, Any]) -> Iterator[None]:
    """While the engine's configuration is made (``vllm.LLM(...)``): the default KV cache size
    unless the caller chose one; the caller's environment is left as it was afterwards."""
    value = kv_cache_gib(None, llm_kwargs)
    if value is None:
        yield
        return
    old = os.environ.get(KV_ENV)
    os.environ[KV_ENV] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(KV_ENV, None)
        else:
            os.environ[KV_ENV] = old

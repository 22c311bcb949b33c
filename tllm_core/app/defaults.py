"""The defaults ``TllmLLM``, every ``tllm`` command and ``ConsumerKit`` share.

The model dtype, so that one prompt gives the same text in each: float32 runs at full speed on
any x86 CPU and matches transformers' forward (``dtype="auto"``: the model's own, usual on a
GPU). The CPU KV cache, 2 GiB: without ``VLLM_CPU_KVCACHE_SPACE`` (or
``kv_cache_memory_bytes``) vLLM's CPU backend reserves 92% of the machine's memory and refuses
to start when that much is not free.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from tllm_core.runtime.environ import env_set

DEFAULT_DTYPE = "float32"
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
    with env_set(KV_ENV, value):
        yield

"""Test tools that run without vLLM or a GPU: :class:`ConsumerKit` runs consumers on a
transformers model through the engine's runtime (docs/testing-consumers.md);
:mod:`.fake_cuda` runs CUDA-path code on a fake device and :mod:`.counters` counts host waits
and bytes by the same rules (docs/fake-cuda.md; torch only)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tllm_core.testing.kit import ConsumerKit
    from tllm_core.testing.sampling import Sampling

__all__ = ["ConsumerKit", "Sampling"]
_HOME = {"ConsumerKit": "kit", "Sampling": "sampling"}  # imported on first use: torch only here


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'tllm_core.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tllm_core.testing.{_HOME[name]}"), name)

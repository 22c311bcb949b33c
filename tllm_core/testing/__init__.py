"""Test tools that run without vLLM or a GPU: :class:`ConsumerKit` runs consumers on a
transformers model through the engine's runtime (docs/testing-consumers.md);
:mod:`.fake_cuda` runs CUDA-path code on a fake device and :mod:`.counters` counts host waits
and bytes by the same rules (docs/fake-cuda.md; torch only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tllm_core.lazy import lazy_exports

if TYPE_CHECKING:  # imported on first use: torch only here
    from tllm_core.testing.kit import ConsumerKit, Sampling

__all__, __getattr__ = lazy_exports(__name__, __file__)

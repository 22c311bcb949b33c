"""Test tools without vLLM or a GPU: :class:`ConsumerKit` (docs/testing-consumers.md),
:mod:`.fake_cuda` and :mod:`.counters` (docs/fake-cuda.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tllm_core.lazy import lazy_exports

if TYPE_CHECKING:  # imported on first use: torch only here
    from tllm_core.testing.kit import ConsumerKit, Sampling

__all__, __getattr__ = lazy_exports(__name__, __file__)

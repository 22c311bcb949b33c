"""Test tools for consumer authors and for tllm's own GPU-only code: checks that run
without vLLM (and without a GPU) in a plain pytest test.

:class:`ConsumerKit` runs consumers on a Hugging Face model run by transformers, through the
engine's own runtime (docs/testing-consumers.md); :mod:`tllm_core.testing.fake_cuda` runs
CUDA-path code on a fake device and :mod:`tllm_core.testing.counters` counts host waits and
bytes on real tensors, by the same rules (docs/fake-cuda.md). Imported on first use: the fake
device and the counters need torch only (they run on a GPU image without pydantic), the kit
needs the runtime."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tllm_core.testing.kit import ConsumerKit
    from tllm_core.testing.sampling import Sampling

__all__ = ["ConsumerKit", "Sampling"]


def __getattr__(name: str) -> Any:
    if name == "ConsumerKit":
        from tllm_core.testing.kit import ConsumerKit

        return ConsumerKit
    if name == "Sampling":
        from tllm_core.testing.sampling import Sampling

        return Sampling
    raise AttributeError(f"module 'tllm_core.testing' has no attribute {name!r}")

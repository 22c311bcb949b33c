"""Test tools for consumer authors and for tllm's own GPU-only code: checks that run
without vLLM (and without a GPU) in a plain pytest test.

:class:`ConsumerKit` runs consumers on a Hugging Face model run by transformers, through the
engine's own runtime (docs/testing-consumers.md)."""

from tllm_core.testing.kit import ConsumerKit
from tllm_core.testing.sampling import Sampling

__all__ = ["ConsumerKit", "Sampling"]

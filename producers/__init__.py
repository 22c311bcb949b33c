"""Producers: turn what an engine step computed into typed bundles.

The vLLM bridge (``tllm_core.vllm_bridge``) fills a :class:`StepCapture` per step; the
functions here cut it into each consumer's :class:`~tllm_core.bundles.Bundle` and
:class:`~tllm_core.bundles.GuideView`.
"""

from producers.bundle import build_bundle, plan_reads
from producers.step import StepCapture

__all__ = ["StepCapture", "build_bundle", "plan_reads"]

"""tllm: run consumers inside vLLM generation.

Public API for consumer authors: :class:`Consumer`, :class:`ConsumerConfig`,
:class:`RequestSettings`, the port types, :class:`Bundle`, :class:`EditPlan`,
:class:`GuideView` and ``hookimpl``. Command authors: :mod:`tllm_core.cli_common`.
"""

from tllm_core.bundles import Bundle, EditPlan, GuideView
from tllm_core.consumer import Consumer, ConsumerConfig, ConsumerContext, ModelInfo
from tllm_core.hookspecs import hookimpl
from tllm_core.ports import (
    Delivery,
    HiddenStates,
    Logits,
    Phase,
    ResidualEdit,
    SampledTokens,
    SamplerGuide,
)
from tllm_core.request_settings import RequestSettings
from tllm_core.rows import RequestInfo, RowInfo
from tllm_core.settings import ConsumerSpec, ConsumerSpecError

__all__ = [
    "Bundle",
    "Consumer",
    "ConsumerConfig",
    "ConsumerContext",
    "ConsumerSpec",
    "ConsumerSpecError",
    "Delivery",
    "EditPlan",
    "GuideView",
    "HiddenStates",
    "Logits",
    "ModelInfo",
    "Phase",
    "RequestInfo",
    "RequestSettings",
    "ResidualEdit",
    "RowInfo",
    "SampledTokens",
    "SamplerGuide",
    "TllmLLM",
    "hookimpl",
]


def __getattr__(name: str):
    # vLLM is heavy to import: load the engine wrapper only when asked for.
    if name == "TllmLLM":
        from tllm_core.engine import TllmLLM

        return TllmLLM
    raise AttributeError(name)

"""tllm: run consumers inside vLLM generation.

Public API for consumer authors: :class:`Consumer`, :class:`ConsumerConfig`,
:class:`RequestSettings`, the port types, :class:`Bundle`, :class:`EditPlan`,
:class:`GuideView` and ``hookimpl``; for producer authors: :class:`Producer`,
:class:`TapRequest`, :class:`StepCapture` and the port bases :class:`TokenPort`,
:class:`SamplePort`, :class:`LayerPort`. Command authors: :mod:`tllm_core.cli_common`.
"""

from tllm_core.bundles import Bundle, GuideView
from tllm_core.consumer import Consumer, ConsumerConfig, ConsumerContext, ModelInfo
from tllm_core.edits import EditPlan
from tllm_core.hookspecs import hookimpl
from tllm_core.numbers import FiniteF32
from tllm_core.ports import (
    Delivery,
    Edit,
    HiddenStates,
    LayerPort,
    Logits,
    Phase,
    ReadPort,
    ResidualEdit,
    SampledTokens,
    SamplePort,
    SamplerGuide,
    TokenPort,
)
from tllm_core.producer import Producer, TapRequest
from tllm_core.request_settings import RequestSettings
from tllm_core.rows import RequestInfo, RowInfo
from tllm_core.settings import ConsumerSpec, ConsumerSpecError
from tllm_core.step import StepCapture

__all__ = [
    "Bundle",
    "Consumer",
    "ConsumerConfig",
    "ConsumerContext",
    "ConsumerSpec",
    "ConsumerSpecError",
    "FiniteF32",
    "Delivery",
    "Edit",
    "EditPlan",
    "GuideView",
    "HiddenStates",
    "LayerPort",
    "Logits",
    "ModelInfo",
    "Phase",
    "Producer",
    "ReadPort",
    "RequestInfo",
    "RequestSettings",
    "ResidualEdit",
    "RowInfo",
    "SamplePort",
    "SampledTokens",
    "SamplerGuide",
    "StepCapture",
    "TapRequest",
    "TllmLLM",
    "TokenPort",
    "hookimpl",
]


def __getattr__(name: str):
    # vLLM is heavy to import: load the engine wrapper only when asked for.
    if name == "TllmLLM":
        from tllm_core.engine import TllmLLM

        return TllmLLM
    raise AttributeError(name)

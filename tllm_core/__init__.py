"""tllm: run consumers inside vLLM generation.

Public API for consumer authors: :class:`Consumer`, :class:`ConsumerConfig`,
:class:`RequestSettings`, the port types, :class:`Bundle`, :class:`EditPlan`,
:class:`GuideView`, ``hookimpl`` and the port-name grammar (:class:`PortName`,
``parse_port_name``, ``format_port_name``); for producer authors: :class:`Producer`,
:class:`TapRequest`, :class:`StepCapture` and the port bases :class:`TokenPort`,
:class:`SamplePort`, :class:`LayerPort`; for architecture plugins: :class:`SiteSpec` and
:class:`ArchitectureSpec`. Command authors: :mod:`tllm_core.cli_common`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tllm_core.lazy import lazy_getattr

if TYPE_CHECKING:
    from tllm_core.architectures import ArchitectureSpec, SiteSpec
    from tllm_core.bundles import Bundle, GuideView
    from tllm_core.consumer import Consumer, ConsumerConfig, ConsumerContext, ModelInfo
    from tllm_core.edits import EditPlan
    from tllm_core.engine import TllmLLM
    from tllm_core.hookspecs import hookimpl
    from tllm_core.numbers import FiniteF32
    from tllm_core.port_names import PortName, format_port_name, parse_port_name
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
    "ArchitectureSpec",
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
    "PortName",
    "Producer",
    "ReadPort",
    "RequestInfo",
    "RequestSettings",
    "ResidualEdit",
    "RowInfo",
    "SamplePort",
    "SampledTokens",
    "SamplerGuide",
    "SiteSpec",
    "StepCapture",
    "TapRequest",
    "TllmLLM",
    "TokenPort",
    "format_port_name",
    "hookimpl",
    "parse_port_name",
]


# Each public name -> its module, imported on first use (PEP 562): importing a plugin's entry
# point (``from tllm_core import hookimpl``) then costs neither torch nor vLLM.
_HOME = {
    "ArchitectureSpec": "tllm_core.architectures",
    "SiteSpec": "tllm_core.architectures",
    "Bundle": "tllm_core.bundles",
    "GuideView": "tllm_core.bundles",
    "Consumer": "tllm_core.consumer",
    "ConsumerConfig": "tllm_core.consumer",
    "ConsumerContext": "tllm_core.consumer",
    "ModelInfo": "tllm_core.consumer",
    "EditPlan": "tllm_core.edits",
    "hookimpl": "tllm_core.hookspecs",
    "FiniteF32": "tllm_core.numbers",
    "PortName": "tllm_core.port_names",
    "format_port_name": "tllm_core.port_names",
    "parse_port_name": "tllm_core.port_names",
    "Delivery": "tllm_core.ports",
    "Edit": "tllm_core.ports",
    "HiddenStates": "tllm_core.ports",
    "LayerPort": "tllm_core.ports",
    "Logits": "tllm_core.ports",
    "Phase": "tllm_core.ports",
    "ReadPort": "tllm_core.ports",
    "ResidualEdit": "tllm_core.ports",
    "SampledTokens": "tllm_core.ports",
    "SamplePort": "tllm_core.ports",
    "SamplerGuide": "tllm_core.ports",
    "TokenPort": "tllm_core.ports",
    "Producer": "tllm_core.producer",
    "TapRequest": "tllm_core.producer",
    "RequestSettings": "tllm_core.request_settings",
    "RequestInfo": "tllm_core.rows",
    "RowInfo": "tllm_core.rows",
    "ConsumerSpec": "tllm_core.settings",
    "ConsumerSpecError": "tllm_core.settings",
    "StepCapture": "tllm_core.step",
    "TllmLLM": "tllm_core.engine",
}

__getattr__ = lazy_getattr(__name__, _HOME)

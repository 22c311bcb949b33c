"""tllm: run consumers inside vLLM generation.

Public API for consumer authors: :class:`Consumer`, :class:`ConsumerConfig`,
:class:`RequestSettings`, the port types, :class:`Bundle`, :class:`EditPlan`,
:class:`GuideView` (and :class:`GuideBuffers`, with ``carve_workspace`` and
``workspace_bytes`` for a step's preallocated temporaries), :class:`Window` and
``WindowSetting`` (a per-request capture window: ``window: WindowSetting = None``) and
``CaptureWindow`` (a config's ``phase``: a phase or capture window),
:class:`DeviceSums` (counts kept on the device, read back without a host wait) and :class:`HostCopyRing` (device tensors
copied to the host without a wait; ``HostCopies``: its deprecated name) and
:class:`StagingRing` (host values copied to the device from pinned buffers; one tensor:
``host_to_device``), ``hookimpl``, the run report's :class:`Plot` and :class:`Series`, and
the port-name grammar (:class:`PortName`, ``parse_port_name``, ``format_port_name``); for producer authors: :class:`Producer`,
:class:`TapRequest`, :class:`StepCapture` and the port bases :class:`TokenPort`,
:class:`SamplePort`, :class:`LayerPort`; for architecture plugins: :class:`SiteSpec` and
:class:`ArchitectureSpec`. Command authors: ``cli_common`` (:mod:`tllm_core.app.cli_common`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from tllm_core.lazy import lazy_getattr

if TYPE_CHECKING:
    from tllm_core.api.architectures import ArchitectureSpec, SiteSpec
    from tllm_core.api.bundles import Bundle, GuideView
    from tllm_core.api.consumer import (
        Consumer,
        ConsumerConfig,
        ConsumerContext,
        ControlError,
        ModelInfo,
    )
    from tllm_core.api.consumer_spec import ConsumerSpec, ConsumerSpecError
    from tllm_core.api.counters import Counters
    from tllm_core.api.device_sums import DeviceSums
    from tllm_core.api.edits import EditPlan
    from tllm_core.api.guide_buffers import GuideBuffers
    from tllm_core.api.hookspecs import hookimpl
    from tllm_core.api.numbers import FiniteF32
    from tllm_core.api.plots import Plot, Series
    from tllm_core.api.port_names import FINAL, PortName, format_port_name, parse_port_name
    from tllm_core.api.ports import (
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
        as_selector,
        layer_key,
        residual_port,
    )
    from tllm_core.api.producer import LayerProducer, Producer, TapRequest
    from tllm_core.api.request_settings import RequestSettings
    from tllm_core.api.results import (
        PlannedRequest,
        RequestRows,
        array_json_bytes,
        decode_results,
    )
    from tllm_core.api.rows import (
        RequestInfo,
        RowInfo,
        max_rows,
        phase_mask,
        request_runs,
        row_mask,
        window_rows,
    )
    from tllm_core.api.step import StepCapture
    from tllm_core.api.transfers import (
        HostCopies,
        HostCopyRing,
        StagingRing,
        host_to_device,
        pow2_rows,
    )
    from tllm_core.api.window_setting import CaptureWindow, WindowSetting
    from tllm_core.api.windows import Window, window_text
    from tllm_core.api.workspace import (
        WorkspaceSpec,
        carve_workspace,
        carve_workspace_from,
        workspace_bytes,
    )
    from tllm_core.app import cli_common
    from tllm_core.app.engine import ConsumerDisabledError, TllmLLM
    from tllm_core.runtime.cpus import allowed_cpus

__all__ = [
    "ArchitectureSpec",
    "SiteSpec",
    "WritePort",
    "cli_common",
    "allowed_cpus",
    "phase_mask",
    "row_mask",
    "max_rows",
    "window_rows",
    "decode_results",
    "RequestRows",
    "PlannedRequest",
    "array_json_bytes",
    "window_text",
    "pow2_rows",
    "as_selector",
    "request_runs",
    "residual_port",
    "layer_key",
    "FINAL",
    "Counters",
    "DeviceSums",
    "HostCopies",
    "HostCopyRing",
    "StagingRing",
    "host_to_device",
    "Bundle",
    "Consumer",
    "ConsumerConfig",
    "ConsumerContext",
    "ControlError",
    "Window",
    "WindowSetting",
    "CaptureWindow",
    "ConsumerSpec",
    "ConsumerSpecError",
    "FiniteF32",
    "Delivery",
    "Edit",
    "EditPlan",
    "GuideView",
    "GuideBuffers",
    "WorkspaceSpec",
    "carve_workspace",
    "carve_workspace_from",
    "workspace_bytes",
    "HiddenStates",
    "LayerPort",
    "Logits",
    "ModelInfo",
    "Phase",
    "Plot",
    "PortName",
    "Producer",
    "LayerProducer",
    "ReadPort",
    "RequestInfo",
    "RequestSettings",
    "ResidualEdit",
    "RowInfo",
    "SamplePort",
    "SampledTokens",
    "Series",
    "SamplerGuide",
    "StepCapture",
    "TapRequest",
    "TllmLLM",
    "ConsumerDisabledError",
    "TokenPort",
    "format_port_name",
    "hookimpl",
    "parse_port_name",
]


# Each public name -> its module, imported on first use (PEP 562): importing a plugin's entry
# point (``from tllm_core import hookimpl``) then costs neither torch nor vLLM.
_HOME = MappingProxyType(
    {
        "ArchitectureSpec": "tllm_core.api.architectures",
        "SiteSpec": "tllm_core.api.architectures",
        "Bundle": "tllm_core.api.bundles",
        "GuideView": "tllm_core.api.bundles",
        "GuideBuffers": "tllm_core.api.guide_buffers",
        "WorkspaceSpec": "tllm_core.api.workspace",
        "carve_workspace": "tllm_core.api.workspace",
        "carve_workspace_from": "tllm_core.api.workspace",
        "workspace_bytes": "tllm_core.api.workspace",
        "Consumer": "tllm_core.api.consumer",
        "ConsumerConfig": "tllm_core.api.consumer",
        "ConsumerContext": "tllm_core.api.consumer",
        "ControlError": "tllm_core.api.consumer",
        "Window": "tllm_core.api.windows",
        "WindowSetting": "tllm_core.api.window_setting",
        "CaptureWindow": "tllm_core.api.window_setting",
        "ModelInfo": "tllm_core.api.consumer",
        "EditPlan": "tllm_core.api.edits",
        "hookimpl": "tllm_core.api.hookspecs",
        "FiniteF32": "tllm_core.api.numbers",
        "Plot": "tllm_core.api.plots",
        "Series": "tllm_core.api.plots",
        "PortName": "tllm_core.api.port_names",
        "format_port_name": "tllm_core.api.port_names",
        "parse_port_name": "tllm_core.api.port_names",
        "Delivery": "tllm_core.api.ports",
        "Edit": "tllm_core.api.ports",
        "HiddenStates": "tllm_core.api.ports",
        "LayerPort": "tllm_core.api.ports",
        "Logits": "tllm_core.api.ports",
        "Phase": "tllm_core.api.ports",
        "ReadPort": "tllm_core.api.ports",
        "ResidualEdit": "tllm_core.api.ports",
        "SampledTokens": "tllm_core.api.ports",
        "SamplePort": "tllm_core.api.ports",
        "SamplerGuide": "tllm_core.api.ports",
        "TokenPort": "tllm_core.api.ports",
        "WritePort": "tllm_core.api.ports",
        "Producer": "tllm_core.api.producer",
        "LayerProducer": "tllm_core.api.producer",
        "TapRequest": "tllm_core.api.producer",
        "RequestSettings": "tllm_core.api.request_settings",
        "RequestInfo": "tllm_core.api.rows",
        "RowInfo": "tllm_core.api.rows",
        "ConsumerSpec": "tllm_core.api.consumer_spec",
        "ConsumerSpecError": "tllm_core.api.consumer_spec",
        "StepCapture": "tllm_core.api.step",
        "TllmLLM": "tllm_core.app.engine",
        "ConsumerDisabledError": "tllm_core.app.engine",
        "cli_common": "tllm_core.app.cli_common",
        "allowed_cpus": "tllm_core.runtime.cpus",
        "phase_mask": "tllm_core.api.rows",
        "row_mask": "tllm_core.api.rows",
        "max_rows": "tllm_core.api.rows",
        "window_rows": "tllm_core.api.rows",
        "decode_results": "tllm_core.api.results",
        "RequestRows": "tllm_core.api.results",
        "PlannedRequest": "tllm_core.api.results",
        "array_json_bytes": "tllm_core.api.results",
        "window_text": "tllm_core.api.windows",
        "pow2_rows": "tllm_core.api.transfers",
        "as_selector": "tllm_core.api.ports",
        "request_runs": "tllm_core.api.rows",
        "residual_port": "tllm_core.api.ports",
        "layer_key": "tllm_core.api.ports",
        "FINAL": "tllm_core.api.port_names",
        "Counters": "tllm_core.api.counters",
        "DeviceSums": "tllm_core.api.device_sums",
        "HostCopies": "tllm_core.api.transfers",
        "HostCopyRing": "tllm_core.api.transfers",
        "StagingRing": "tllm_core.api.transfers",
        "host_to_device": "tllm_core.api.transfers",
    }
)

__getattr__ = lazy_getattr(__name__, _HOME)

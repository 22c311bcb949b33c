"""tllm: run consumers inside vLLM generation.

The public API for consumer, producer, architecture-plugin and command authors
(docs/ports.md, docs/hooks.md); every name below is imported on first use.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from tllm_core.lazy import lazy_getattr

if TYPE_CHECKING:  # the names of _EXPORTS, for type checkers and editors
    from tllm_core.api.architectures import ArchitectureSpec, SiteSpec  # noqa: F401
    from tllm_core.api.bundles import Bundle, GuideView  # noqa: F401
    from tllm_core.api.consumer import (  # noqa: F401
        Consumer,
        ConsumerConfig,
        ConsumerContext,
        ControlError,
        ModelInfo,
    )
    from tllm_core.api.consumer_spec import ConsumerSpec, ConsumerSpecError  # noqa: F401
    from tllm_core.api.counters import Counters  # noqa: F401
    from tllm_core.api.device_sums import DeviceSums  # noqa: F401
    from tllm_core.api.edits import EditPlan  # noqa: F401
    from tllm_core.api.guide_buffers import GuideBuffers  # noqa: F401
    from tllm_core.api.hookspecs import hookimpl  # noqa: F401
    from tllm_core.api.numbers import FiniteF32  # noqa: F401
    from tllm_core.api.plots import Plot, Series  # noqa: F401
    from tllm_core.api.port_names import FINAL, PortName, format_port_name, parse_port_name  # noqa: F401
    from tllm_core.api.ports import (  # noqa: F401
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
        WritePort,
        as_selector,
        layer_key,
        residual_port,
    )
    from tllm_core.api.producer import LayerProducer, Producer, TapRequest  # noqa: F401
    from tllm_core.api.request_settings import RequestSettings  # noqa: F401
    from tllm_core.api.results import (  # noqa: F401
        PlannedRequest,
        RequestRows,
        array_json_bytes,
        decode_results,
    )
    from tllm_core.api.rows import (  # noqa: F401
        RequestInfo,
        RowInfo,
        max_rows,
        phase_mask,
        request_runs,
        row_mask,
        window_rows,
    )
    from tllm_core.api.step import StepCapture  # noqa: F401
    from tllm_core.api.transfers import (  # noqa: F401
        HostCopies,
        HostCopyRing,
        StagingRing,
        host_to_device,
        pow2_rows,
    )
    from tllm_core.api.window_setting import CaptureWindow, WindowSetting  # noqa: F401
    from tllm_core.api.windows import Window, window_text  # noqa: F401
    from tllm_core.api.workspace import (  # noqa: F401
        WorkspaceSpec,
        carve_workspace,
        carve_workspace_from,
        workspace_bytes,
    )
    from tllm_core.app import cli_common  # noqa: F401
    from tllm_core.app.engine import ConsumerDisabledError, TllmLLM  # noqa: F401
    from tllm_core.runtime.cpus import allowed_cpus  # noqa: F401

# Each module -> the public names it holds, imported on first use (PEP 562): importing a
# plugin's entry point (``from tllm_core import hookimpl``) then costs neither torch nor vLLM.
_EXPORTS = MappingProxyType(
    {
        "tllm_core.api.architectures": "ArchitectureSpec SiteSpec",
        "tllm_core.api.bundles": "Bundle GuideView",
        "tllm_core.api.consumer": "Consumer ConsumerConfig ConsumerContext ControlError ModelInfo",
        "tllm_core.api.consumer_spec": "ConsumerSpec ConsumerSpecError",
        "tllm_core.api.counters": "Counters",
        "tllm_core.api.device_sums": "DeviceSums",
        "tllm_core.api.edits": "EditPlan",
        "tllm_core.api.guide_buffers": "GuideBuffers",
        "tllm_core.api.hookspecs": "hookimpl",
        "tllm_core.api.numbers": "FiniteF32",
        "tllm_core.api.plots": "Plot Series",
        "tllm_core.api.port_names": "FINAL PortName format_port_name parse_port_name",
        "tllm_core.api.ports": "Delivery Edit HiddenStates LayerPort Logits Phase ReadPort "
        "ResidualEdit SamplePort SampledTokens SamplerGuide TokenPort WritePort as_selector "
        "layer_key residual_port",
        "tllm_core.api.producer": "LayerProducer Producer TapRequest",
        "tllm_core.api.request_settings": "RequestSettings",
        "tllm_core.api.results": "PlannedRequest RequestRows array_json_bytes decode_results",
        "tllm_core.api.rows": "RequestInfo RowInfo max_rows phase_mask request_runs row_mask "
        "window_rows",
        "tllm_core.api.step": "StepCapture",
        "tllm_core.api.transfers": "HostCopies HostCopyRing StagingRing host_to_device pow2_rows",
        "tllm_core.api.window_setting": "CaptureWindow WindowSetting",
        "tllm_core.api.windows": "Window window_text",
        "tllm_core.api.workspace": "WorkspaceSpec carve_workspace carve_workspace_from "
        "workspace_bytes",
        "tllm_core.app.cli_common": "cli_common",
        "tllm_core.app.engine": "ConsumerDisabledError TllmLLM",
        "tllm_core.runtime.cpus": "allowed_cpus",
    }
)
_HOME = MappingProxyType({n: m for m, names in _EXPORTS.items() for n in names.split()})
__all__ = sorted(_HOME)

__getattr__ = lazy_getattr(__name__, _HOME)

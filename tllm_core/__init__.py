"""tllm: run consumers inside vLLM generation. The public API for consumer, producer,
architecture-plugin and command authors (docs/ports.md, docs/hooks.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tllm_core.lazy import lazy_exports

# Imported on first use (tllm_core.lazy): ``from tllm_core import hookimpl`` costs no torch.
if TYPE_CHECKING:
    from tllm_core.api.architectures import ArchitectureSpec, SiteSpec
    from tllm_core.api.bundles import Bundle, GuideView
    from tllm_core.api.candidates import Candidates, GuideBuffers, TopCandidates
    from tllm_core.api.consumer import (
        Consumer,
        ConsumerConfig,
        ConsumerContext,
        ControlError,
        ModelInfo,
    )
    from tllm_core.api.consumer_spec import ConsumerSpec, ConsumerSpecError
    from tllm_core.api.counters import Counters
    from tllm_core.api.edits import EditPlan
    from tllm_core.api.hookspecs import hookimpl
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
        WritePort,
        as_selector,
        layer_key,
        residual_port,
    )
    from tllm_core.api.producer import LayerProducer, Producer, TapRequest
    from tllm_core.api.request_settings import (
        CaptureWindow,
        FiniteF32,
        RequestSettings,
        WindowSetting,
    )
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
        DeviceSums,
        HostCopies,
        HostCopyRing,
        StagingRing,
        host_to_device,
        pow2_rows,
    )
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

__all__, __getattr__ = lazy_exports(__name__, __file__)

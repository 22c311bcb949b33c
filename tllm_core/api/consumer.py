"""The one base class a consumer author touches, its config model and its context."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from tllm_core.api.bundles import Bundle, GuideView
from tllm_core.api.counters import Counters
from tllm_core.api.edits import EditPlan
from tllm_core.api.plots import Plot
from tllm_core.api.ports import Delivery, Phase, ReadPort, TokenPort, WritePort, residual_port
from tllm_core.api.request_settings import RequestSettings
from tllm_core.api.results import PlannedRequest
from tllm_core.api.rows import RequestInfo, RowInfo


class ConsumerConfig(BaseModel):
    """Base for consumer configs. Unknown fields are errors, so typos fail before generation."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class ModelInfo:
    """What a consumer may know about the model it runs in (docs/testing-consumers.md)."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    lm_head: Callable[[torch.Tensor], torch.Tensor]
    lm_head_weight: torch.Tensor | None
    final_norm: Callable[[torch.Tensor], torch.Tensor] | None = None
    final_norm_weight: torch.Tensor | None = None
    final_norm_eps: float | None = None


@dataclass
class ConsumerContext:
    model: ModelInfo
    # A (possibly negative) layer index -> absolute; ValueError naming the layer count.
    resolve_layer: Callable[[int], int]
    # A token port from its name ("3", "attn.2"; without a registry: residual and final only).
    parse_port: Callable[[str, Phase], TokenPort] = residual_port
    # The consumer acts only on requests naming it in extra_args["tllm_consumers"].
    per_request: bool = False
    data_parallel_rank: int = 0
    data_parallel_size: int = 1
    # The largest per-request result (JSON bytes) the engine keeps.
    max_result_bytes: int = 16 * 1024 * 1024


class ControlError(ValueError):
    """A control request a consumer refuses; ``status``: the HTTP status the server answers
    (400 malformed, 404 unknown, 409 conflicting, 413 too large)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Consumer:
    """Base class of every consumer: set ``name``, ``description``, ``Config`` (and optionally
    ``Request``), declare ports and implement the callbacks (docs/hooks.md)."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Config: ClassVar[type[ConsumerConfig]] = ConsumerConfig
    Request: ClassVar[type[RequestSettings] | None] = None
    # A class attribute, or set per instance in ``__init__`` (e.g. from the config).
    delivery: Delivery = Delivery.END_OF_STEP
    # The counter shown in the ``tllm`` command's summary line (empty: its first non-zero one).
    proof_counter: ClassVar[str] = ""
    # The rows (of token, sample ports) a request's capture window narrows.
    request_window_rows: ClassVar[frozenset[str]] = frozenset({"token", "sample"})

    def __init__(self, config: ConsumerConfig, context: ConsumerContext):
        self.config = config
        self.context = context
        self.counters = Counters()

    def reads(self) -> list[ReadPort]:
        """Read ports; their data arrive in :meth:`on_bundle`."""
        return []

    def writes(self) -> list[WritePort]:
        """Write ports: ``ResidualEdit`` layers (see :meth:`edit`) and/or ``SamplerGuide``."""
        return []

    def acts_on(self, request: RequestInfo) -> bool:
        """Whether this consumer acts on ``request`` (always, unless it is per-request)."""
        return request.acted_on_by(self.name, self.context.per_request)

    def edit(self, rows: RowInfo, plan: EditPlan) -> None:
        """Before the forward of a step: ask for residual edits on selected rows."""

    def guide(self, view: GuideView) -> None:
        """In the sampler, after filtering, before sampling: change candidate logits."""

    def on_bundle(self, bundle: Bundle) -> None:
        """Receive the read ports' data (end of step, or on the background thread)."""

    def on_request_finished(self, request: RequestInfo) -> None:
        """A request (one sample) finished or (``request.cut_short``) was aborted."""

    def on_bundle_dropped(self, step: int, requests: list[RequestInfo]) -> None:
        """A bundle of ``step`` was dropped (a full background queue); ``requests`` lost rows."""

    def result(self) -> Any:
        """A JSON-able result returned to the caller after the run (optional)."""
        return None

    def request_result(self, request: RequestInfo) -> Any:
        """What this consumer returns with ``request``'s completion if its ``tllm_results`` asks."""
        return None

    @classmethod
    def result_bytes(cls, config: ConsumerConfig, request: PlannedRequest) -> int | None:
        """An upper bound of :meth:`request_result`'s JSON size for ``request`` (None: unknown)."""
        return None

    @classmethod
    def makes_results(cls) -> bool:
        """Whether this consumer makes per-request results (overrides request_result)."""
        return cls.request_result is not Consumer.request_result

    def close(self) -> None:
        """Flush and release resources; called at shutdown and when results are collected."""

    @classmethod
    def check_control(
        cls, action: str, payload: dict[str, Any], config: ConsumerConfig
    ) -> tuple[ConsumerConfig, Any]:
        """In the server's front end (``POST /tllm/consumers/{name}/control``): check a control
        request; ``(config, reply)`` or a :class:`ControlError` (default: 404)."""
        raise ControlError(f"consumer {cls.name!r} takes no control requests", 404)

    def control(self, action: str, payload: dict[str, Any]) -> Any:
        """In the engine, between steps: apply a request :meth:`check_control` accepted."""
        raise ControlError(f"consumer {self.name!r} takes no control requests", 404)

    @classmethod
    def summary(cls, counters: dict[str, Any], result: Any) -> list[str]:
        """In the ``tllm`` command's process: one or two lines saying what this consumer did."""
        return []

    @classmethod
    def summary_warnings(cls, counters: dict[str, Any], result: Any) -> list[str]:
        """Only what a person must act on (data lost, work not done)."""
        return []

    @classmethod
    def report_plots(cls, counters: dict[str, Any], result: Any) -> list[Plot]:
        """Plots of the run report (``tllm run --report DIR``): data only."""
        return []

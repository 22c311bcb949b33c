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
from tllm_core.api.rows import RequestInfo, RowInfo


class ConsumerConfig(BaseModel):
    """Base for consumer configs. Unknown fields are errors, so typos fail before generation."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class ModelInfo:
    """What a consumer may know about the model it runs in."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    # LM head: final hidden state -> logits, exactly as the model computes them.
    lm_head: Callable[[torch.Tensor], torch.Tensor]
    # Head weight [vocab, hidden] when the head is a plain linear map (no bias,
    # soft-capping or scaling), else None: consumers then must use ``lm_head``.
    lm_head_weight: torch.Tensor | None
    # The model's final norm, hidden state -> the LM head's input (what ``HiddenStates("final")``
    # holds): ``lm_head(final_norm(h))`` are the logits of residual stream ``h`` (logit lens,
    # DoLa, early exit). None where unknown (the dry build: no weights).
    final_norm: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Its gain g when it is a plain RMSNorm, ``h / sqrt(mean(h**2) + final_norm_eps) * g``
    # (Gemma's stored ``w`` is given as ``1 + w``), else None.
    final_norm_weight: torch.Tensor | None = None
    final_norm_eps: float | None = None


@dataclass
class ConsumerContext:
    model: ModelInfo
    # Resolves a (possibly negative) layer index; raises ValueError naming the layer count.
    resolve_layer: Callable[[int], int]
    # A token port from its name ("3", "final", "attn.2", "mlp.-1", ...; grammar in
    # tllm_core.api.port_names), served by the registered producers; raises ValueError naming
    # the accepted forms. Without a registry (unit tests): residual stream and final only.
    parse_port: Callable[[str, Phase], TokenPort] = residual_port
    # The consumer acts only on requests naming it in extra_args["tllm_consumers"].
    per_request: bool = False
    # Data parallel: this engine's rank among ``data_parallel_size`` independent engines
    # (each with its own consumers). A consumer writing files names them per rank.
    data_parallel_rank: int = 0
    data_parallel_size: int = 1
    # The largest per-request result (JSON bytes) the engine keeps (``request_result``): a
    # consumer collecting one may stop collecting past it.
    max_result_bytes: int = 16 * 1024 * 1024


class ControlError(ValueError):
    """A control request a consumer refuses; ``status``: the HTTP status the server answers
    (400 malformed, 404 unknown, 409 conflicting, 413 too large)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Consumer:
    """Base class of every consumer (built-in or third-party).

    Subclasses set ``name``, ``description`` and ``Config``; declare ports in
    :meth:`reads` / :meth:`writes`; and implement the callbacks they need. Construction
    happens in the process that runs the model, before the first forward: raise
    ``ValueError`` there for bad settings so the user sees it before generation.

    ``proof_counter`` (optional) names the counter that proves the consumer did its work
    (the ``tllm`` command's summary line shows it).

    ``Request`` (optional) declares per-request settings: field ``f`` is the request key
    ``tllm_{name}_{f}`` (``vllm_xargs`` in the server, ``SamplingParams.extra_args``
    offline), validated before a request reaches the engine; read a request's values with
    ``request.settings(self)``. A field ``window: WindowSetting = None`` is a per-request
    capture window: the runtime narrows this consumer's rows of a request that sets
    ``tllm_{name}_window`` to it (see ``request_window_rows``), before any copy.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Config: ClassVar[type[ConsumerConfig]] = ConsumerConfig
    Request: ClassVar[type[RequestSettings] | None] = None
    # A class attribute, or set per instance in ``__init__`` (e.g. from the config).
    delivery: Delivery = Delivery.END_OF_STEP
    # The counter that proves this consumer's work, shown in the ``tllm`` command's summary
    # line (empty: its first non-zero counter).
    proof_counter: ClassVar[str] = ""
    # The rows a request's capture window narrows: "token" (token ports' rows) and
    # "sample" (sampling ports' rows, by the sampling row's position). A consumer whose
    # sampling ports only complete each request's token ids (export) keeps "token" alone.
    request_window_rows: ClassVar[frozenset[str]] = frozenset({"token", "sample"})

    def __init__(self, config: ConsumerConfig, context: ConsumerContext):
        self.config = config
        self.context = context
        self.counters = Counters()

    # -- declarations -------------------------------------------------------------
    def reads(self) -> list[ReadPort]:
        """Read ports; their data arrive in :meth:`on_bundle`."""
        return []

    def writes(self) -> list[WritePort]:
        """Write ports: ``ResidualEdit`` layers (see :meth:`edit`) and/or ``SamplerGuide``."""
        return []

    def acts_on(self, request: RequestInfo) -> bool:
        """Whether this consumer acts on ``request`` (always, unless it is per-request)."""
        return request.acted_on_by(self.name, self.context.per_request)

    # -- callbacks ----------------------------------------------------------------
    def edit(self, rows: RowInfo, plan: EditPlan) -> None:
        """Before the forward of a step: ask for residual edits on selected rows."""

    def guide(self, view: GuideView) -> None:
        """In the sampler, after filtering, before sampling: change candidate logits."""

    def on_bundle(self, bundle: Bundle) -> None:
        """Receive the read ports' data (end of step, or on the background thread)."""

    def on_request_finished(self, request: RequestInfo) -> None:
        """A request (one sample) finished or was aborted: ``request.cut_short`` tells
        which (True: aborted or closed before its end, see :class:`RequestInfo`)."""

    def on_bundle_dropped(self, step: int, requests: list[RequestInfo]) -> None:
        """A bundle of ``step`` was dropped (background delivery with ``overflow: "drop"``
        and a full queue); ``requests`` lost rows or sampled tokens. Delivered in order on
        the consumer's background thread, like bundles."""

    def result(self) -> Any:
        """A JSON-able result returned to the caller after the run (optional)."""
        return None

    # -- per-request results (returned with the completion: tllm_core/api/results.py) -------
    def request_result(self, request: RequestInfo) -> Any:
        """What this consumer computed for ``request`` (one sample), returned with its
        completion when the request asks for it (``tllm_results`` names this consumer).
        Called once, after :meth:`on_request_finished`, on the same thread; return JSON-able
        values, tensors and arrays (sent as arrays). A consumer that overrides it collects
        only for requests that ask (``request.wants_result(self.name)``)."""
        return None

    @classmethod
    def result_bytes(
        cls,
        config: ConsumerConfig,
        extra_args: dict[str, Any],
        prompt_tokens: int,
        max_tokens: int,
        hidden_size: int,
    ) -> int | None:
        """An upper bound of :meth:`request_result`'s JSON size for a request with these
        ``extra_args``, prompt length and ``max_tokens`` (on a model of ``hidden_size``);
        the server refuses (HTTP 400) a
        request whose bound is past its ``max_result_bytes`` before generating. None
        (the default): unknown, checked when the result is made."""
        return None

    @classmethod
    def makes_results(cls) -> bool:
        """Whether this consumer makes per-request results (overrides request_result)."""
        return cls.request_result is not Consumer.request_result

    def close(self) -> None:
        """Flush and release resources; called at shutdown and when results are collected."""

    # -- control requests (a running server: ``POST /tllm/consumers/{name}/control``) --------
    @classmethod
    def check_control(
        cls, action: str, payload: dict[str, Any], config: ConsumerConfig
    ) -> tuple[ConsumerConfig, Any]:
        """In the server's front end (no model): check a control request before the engine
        sees it. Return the config the front end validates later requests against (e.g. with
        a newly registered name) and the reply for the client. Returning ``config`` itself
        (the same object) answers from the front end alone (a read such as ``"list"``; also
        shown in ``/tllm/status``); a new config sends the request to the engine's
        :meth:`control` first. Raise :class:`ControlError` (its ``status`` is the HTTP
        status). Default: no control requests (404)."""
        raise ControlError(f"consumer {cls.name!r} takes no control requests", 404)

    def control(self, action: str, payload: dict[str, Any]) -> Any:
        """In the engine, between steps: apply a request :meth:`check_control` accepted
        (every rank gets it); return a JSON-able reply, or raise :class:`ControlError`."""
        raise ControlError(f"consumer {self.name!r} takes no control requests", 404)

    # -- the run's summary and report (the ``tllm`` command's process, not the engine's) ------
    # Class methods: the command has the consumer's class, not the instance that ran in the
    # engine; they read the counters and result the engine returned (docs/hooks.md).
    @classmethod
    def summary(cls, counters: dict[str, Any], result: Any) -> list[str]:
        """One or two lines saying what this consumer did, with the counters that prove it,
        printed after a ``tllm`` run and shown in its report. Empty (the default): a line
        with :attr:`proof_counter`."""
        return []

    @classmethod
    def summary_warnings(cls, counters: dict[str, Any], result: Any) -> list[str]:
        """Only what a person must act on (data lost, work not done); printed after the
        summary as ``warning: ...``. The runtime's own warnings (consumer disabled, bundles
        dropped, callback errors) are added by tllm."""
        return []

    @classmethod
    def report_plots(cls, counters: dict[str, Any], result: Any) -> list[Plot]:
        """Plots of the run report (``tllm run --report DIR``, ``tllm report``): data only,
        the report draws them."""
        return []

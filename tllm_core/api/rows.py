"""Row localization: which packed row belongs to which request, sample, position and phase."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from tllm_core.api.ports import Phase, as_selector
from tllm_core.api.request_settings import (
    GROUP_KEY,
    OWN_GROUP,
    SAMPLES_KEY,
    WINDOW_FIELD,
    RequestSettings,
    acts_on,
    enabled_consumers,
    parse_request_settings,
    request_key,
)
from tllm_core.api.results import asked_results
from tllm_core.api.transfers import index_to
from tllm_core.api.windows import LastRow, Window


class SettingsOwner(Protocol):
    """What :meth:`RequestInfo.settings` reads of a consumer (rows does not import it)."""

    name: str
    config: Any
    Request: ClassVar[type[RequestSettings] | None]


@dataclass
class RequestInfo:
    """One engine request (one of the ``n`` samples of a prompt): ``engine_id`` is vLLM's id,
    ``request_id`` the caller's (without vLLM's random suffix or the ``n`` fan-out prefix),
    ``parent_id`` vLLM's id of the request its ``n`` samples fan out of (default: its own)."""

    engine_id: str
    request_id: str
    prompt_index: int
    sample_index: int
    num_prompt_tokens: int
    extra_args: dict[str, Any] = field(default_factory=dict)
    # Highest position delivered so far: rows at or below it are flagged ``recomputed``.
    max_position_seen: int = -1
    # Aborted or closed unfinished (not stop or length); set before ``on_request_finished``.
    cut_short: bool = False
    # The prompt's token ids where the runner gives them.
    prompt_token_ids: tuple[int, ...] | None = field(default=None, repr=False, compare=False)
    parent_id: str = ""
    _settings: dict[str, RequestSettings] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.parent_id = self.parent_id or self.engine_id

    def settings(self, consumer: SettingsOwner) -> RequestSettings:
        """This request's validated ``consumer.Request`` settings (defaults for absent keys)."""
        out = self._settings.get(consumer.name)
        if out is None:
            model = type(consumer).Request
            if model is None:
                raise TypeError(f"consumer {consumer.name!r} declares no Request settings")
            out = parse_request_settings(
                consumer.name, model, self.extra_args, config=consumer.config
            )
            self._settings[consumer.name] = out
        return out

    def window(self, consumer: SettingsOwner) -> Any:
        """The selector this request's ``tllm_{name}_window`` sets for ``consumer``, or None."""
        if request_key(consumer.name, WINDOW_FIELD) not in self.extra_args:
            return None
        model = type(consumer).Request
        if model is None or WINDOW_FIELD not in model.model_fields:
            return None
        return getattr(self.settings(consumer), WINDOW_FIELD)

    @property
    def enabled_consumers(self) -> frozenset[str]:
        """Consumers this request switched on (``extra_args["tllm_consumers"]``, comma-separated)."""
        return frozenset(enabled_consumers(self.extra_args))

    def acted_on_by(self, consumer: str, per_request: bool) -> bool:
        """Whether consumer ``consumer`` (per-request or not) acts on this request."""
        return acts_on(consumer, per_request, self.extra_args)

    @functools.cached_property
    def results_asked(self) -> frozenset[str]:
        """The consumers whose results this request asks for (``tllm_results``)."""
        return frozenset(asked_results(self.extra_args))

    def wants_result(self, consumer: str) -> bool:
        """Whether this request asks for ``consumer``'s per-request result."""
        return consumer in self.results_asked

    @property
    def group_key(self) -> str:
        """Key shared by the ``n`` samples of one prompt (overridable via extra_args)."""
        key = self.extra_args.get(GROUP_KEY)
        return str(key) if key is not None else self.request_id

    @property
    def num_samples(self) -> int | None:
        """The ``n`` of its prompt (``tllm_n``), or None where the caller did not say."""
        n = self.extra_args.get(SAMPLES_KEY)
        return int(n) if n is not None else None

    @property
    def group_size(self) -> int | None:
        """:attr:`num_samples` when its group is its prompt's own, else None (docs/ports.md)."""
        key = self.extra_args.get(GROUP_KEY)
        return self.num_samples if key is None or str(key).startswith(OWN_GROUP) else None


def request_runs(requests: Sequence[Any]) -> Iterator[tuple[Any, int, int]]:
    """``(request, start, stop)`` per run of consecutive rows of one request (by identity)."""
    n = len(requests)
    start = 0
    for i in range(1, n + 1):
        if i == n or requests[i] is not requests[start]:
            yield requests[start], start, i
            start = i


@dataclass
class RowInfo:
    """Metadata of a set of token rows, one entry per row (docs/ports.md, "Rows and phases")."""

    row: np.ndarray  # int64 [R]: packed row index in the step
    requests: list[RequestInfo]
    position: np.ndarray  # int64 [R]
    is_decode: np.ndarray  # bool [R]
    recomputed: np.ndarray  # bool [R]: position was delivered before (preemption)
    token_ids: torch.Tensor  # [R]
    mid_prefill: np.ndarray | None = None  # bool [R]: prompt unfinished after the step

    def __post_init__(self) -> None:
        if self.mid_prefill is None:
            self.mid_prefill = np.zeros(len(self.row), dtype=bool)

    def __len__(self) -> int:
        return int(self.row.shape[0])

    def _per_row(self, attr: str) -> np.ndarray:
        return np.fromiter((getattr(r, attr) for r in self.requests), np.int64, len(self))

    def prompt_lengths(self) -> np.ndarray:
        """Each row's request's prompt length (int64 ``[R]``): what a capture window needs."""
        return self._per_row("num_prompt_tokens")

    def runs(self) -> Iterator[tuple[RequestInfo, int, int]]:
        """``(request, start, stop)`` per run of one request's rows (see :func:`request_runs`)."""
        return request_runs(self.requests)

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    @property
    def prompt_index(self) -> np.ndarray:
        return self._per_row("prompt_index")

    @property
    def sample_index(self) -> np.ndarray:
        return self._per_row("sample_index")

    def take(self, idx: np.ndarray, token_ids: torch.Tensor | None = None) -> RowInfo:
        """Rows at indices ``idx`` (``token_ids``: theirs, when already gathered)."""
        if token_ids is None:
            token_ids = self.token_ids[index_to(idx, self.token_ids.device)]
        return RowInfo(
            row=self.row[idx],
            requests=[self.requests[i] for i in idx],
            position=self.position[idx],
            is_decode=self.is_decode[idx],
            recomputed=self.recomputed[idx],
            token_ids=token_ids,
            mid_prefill=self.mid_prefill[idx],  # type: ignore[index]
        )

    def to_host(self) -> RowInfo:
        return dataclasses.replace(self, token_ids=self.token_ids.to("cpu"))


@dataclass
class StepLayout:
    """How a runner packed one step (filled by a runner adapter), per scheduled request."""

    engine_ids: list[str]  # in packing order
    num_scheduled: np.ndarray  # int64 [R]: tokens scheduled this step
    num_computed: np.ndarray  # int64 [R]: tokens computed before
    num_tokens: np.ndarray  # int64 [R]: prompt + output so far, no speculative ones
    token_ids: torch.Tensor  # [T]: the packed tokens

    @property
    def total(self) -> int:
        return int(self.num_scheduled.sum())


def layout_rows(
    layout: StepLayout, requests: list[RequestInfo]
) -> tuple[RowInfo, np.ndarray, np.ndarray]:
    """``(rows, sample_token_row, sample_kept)`` of a step (``requests[j]`` describes
    ``layout.engine_ids[j]``): a request samples at its last row, kept unless mid-prefill."""
    nsched = layout.num_scheduled.astype(np.int64)
    total = layout.total
    req_idx = np.repeat(np.arange(len(requests)), nsched)
    cu = np.cumsum(nsched)
    offs = np.arange(total) - np.repeat(cu - nsched, nsched)
    computed = layout.num_computed.astype(np.int64)
    positions = computed[req_idx] + offs
    n_prompt = np.array([q.num_prompt_tokens for q in requests], dtype=np.int64)
    seen = np.array([q.max_position_seen for q in requests], dtype=np.int64)
    # The prompt is not complete after this step: every row of the request is mid-prefill.
    unfinished = computed + nsched < n_prompt
    rows = RowInfo(
        row=np.arange(total, dtype=np.int64),
        requests=[requests[i] for i in req_idx],
        position=positions,
        is_decode=positions >= n_prompt[req_idx],
        recomputed=positions <= seen[req_idx],
        token_ids=layout.token_ids[:total],
        mid_prefill=unfinished[req_idx],
    )
    kept = computed + nsched >= layout.num_tokens.astype(np.int64)
    return rows, cu - 1, kept


def phase_mask(is_decode: np.ndarray, phase: Phase) -> np.ndarray:
    """Which of the rows (``is_decode`` per row) belong to ``phase``."""
    if phase is Phase.ALL:
        return np.ones_like(is_decode)
    if phase is Phase.GUIDE:  # read at guide time only: no row goes into bundles
        return np.zeros_like(is_decode)
    return is_decode if phase is Phase.DECODE else ~is_decode


def max_rows(selector: Any, prompt: int, generated: int) -> int:
    """At most how many rows of a request (``prompt``, ``generated`` rows) ``selector`` keeps."""
    if isinstance(selector, Phase):
        counts = {Phase.PREFILL: prompt, Phase.DECODE: generated, Phase.ALL: prompt + generated}
        return counts.get(selector, 0)
    if isinstance(selector, (Window, LastRow)):
        return selector.max_rows(prompt, generated)
    return min(prompt + generated, sum(max_rows(p, prompt, generated) for p in selector.parts))


def window_rows(consumer: str, selector: Any, request: Any) -> int:
    """:func:`max_rows` of a consumer's ports for a planned request, within its own window."""
    prompt, generated = request.prompt_tokens, request.max_tokens
    rows = max_rows(selector, prompt, generated)
    text = request.extra_args.get(request_key(consumer, WINDOW_FIELD))
    if isinstance(text, str):
        rows = min(rows, max_rows(as_selector(text, "window"), prompt, generated))
    return rows


def row_mask(selector: Any, is_decode: np.ndarray, position: np.ndarray, num_prompt: Any) -> Any:
    """Which rows ``selector`` (a Phase, Window or AnyOf) keeps; ``num_prompt`` a callable
    giving the rows' prompt lengths (built only when a window needs it)."""
    if isinstance(selector, Phase):
        return phase_mask(is_decode, selector)
    if isinstance(selector, (Window, LastRow)):
        return selector.mask(position, num_prompt())
    out = np.zeros(len(is_decode), np.bool_)
    for part in selector.parts:
        out |= row_mask(part, is_decode, position, num_prompt)
    return out

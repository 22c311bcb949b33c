"""The engine-neutral step protocol between a runner adapter and the taps' step flow.

A runner adapter (one module per vLLM model runner: ``v1_runner.py``, ``v2_runner.py``)
wraps its runner and reports each engine step through these events, in this order:
``finished`` (requests the scheduler dropped) -> ``begin`` (the step's packing, before the
forward) -> the forward (taps write their buffers) -> ``forward_done`` (final hidden
state, raw logits) -> ``guide`` (post-filter candidates, only when a consumer guides) ->
``sampled`` (the step's sampled tokens). :class:`~tllm_core.vllm_bridge.hooks.RunnerHooks`
implements them without reading any runner.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from tllm_core.api.rows import StepLayout


class StepEvents(Protocol):
    """What an adapter reports per engine step."""

    @property
    def active(self) -> bool:
        """Whether any consumer needs row metadata (else ``begin(None)`` only counts)."""
        ...

    def begin(self, layout: StepLayout | None) -> None: ...

    def finished(self, engine_ids: list[str]) -> None: ...

    def forward_done(self, final_hidden: torch.Tensor | None, logits: torch.Tensor) -> None: ...

    def guide(
        self, logits: torch.Tensor, temperature: torch.Tensor, is_random: np.ndarray, filtered: bool
    ) -> bool:
        """Let guiding consumers edit ``logits`` in place; True when a guide wrote logits."""
        ...

    def sampled(self, token_ids: torch.Tensor) -> None: ...

"""The engine-neutral step protocol between a runner adapter and the taps' step flow, in
order: ``finished`` -> ``begin`` (the step's packing) -> the forward -> ``forward_done``
(final hidden state, raw logits) -> ``guide`` (when a consumer guides) -> ``sampled``.
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

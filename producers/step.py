"""What one engine step computed, in engine-neutral form (filled by the vLLM bridge)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tllm_core.rows import RowInfo


@dataclass
class StepCapture:
    """One engine step.

    ``rows`` are all packed token rows of the step. Sampling row ``j`` (row ``j`` of
    ``logits``) is the last token row of the ``j``-th scheduled request,
    ``sample_token_row[j]``; its token is kept unless the request is mid-prefill
    (``sample_kept[j]`` False).
    """

    step: int
    rows: RowInfo
    sample_token_row: np.ndarray  # int64 [S]
    sample_kept: np.ndarray  # bool [S]
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> [T, H]
    logits: torch.Tensor | None = None  # [S, V]
    sampled_token_ids: torch.Tensor | None = None  # [S]

    def sample_rows(self) -> RowInfo:
        """RowInfo of the sampling rows, in logits order."""
        return self.rows.take(self.sample_token_row)

"""A per-request consumer's rows of a step, cut without a device allocation or host wait: views
of the step's tensors where they form one range (a guide writes in place, undone by
``GuideView.rollback``), else gathered into reused buffers and written back on success."""

from __future__ import annotations

import numpy as np
import torch

from tllm_core.api.bundles import GuideView
from tllm_core.api.rows import RowInfo
from tllm_core.runtime.step_indices import StepIndices


def span(index: np.ndarray) -> slice | None:
    """``index`` (sorted, distinct) as a slice when it is one contiguous range, else None."""
    if index.size and int(index[-1]) - int(index[0]) + 1 == index.size:
        return slice(int(index[0]), int(index[-1]) + 1)
    return None


class RowSelection:
    """The rows where ``mask`` is true (see the module docstring)."""

    def __init__(self, mask: np.ndarray) -> None:
        self.mask = mask
        self.index = np.nonzero(mask)[0]
        self.span = span(self.index)

    def __len__(self) -> int:
        return int(self.index.size)

    def indices(self) -> list[np.ndarray]:
        """The host index :meth:`cut` sends to the device (none for a range)."""
        return [] if self.span is not None else [self.index]

    def cut(self, t: torch.Tensor, buffers: StepIndices) -> torch.Tensor:
        """``t``'s selected rows: a view for a range, else gathered into a reused buffer."""
        if self.span is not None:
            return t[self.span]
        return buffers.gather(t, self.index)

    def rows(self, rows: RowInfo, buffers: StepIndices) -> RowInfo:
        """The selected rows' metadata (their token ids cut as by :meth:`cut`)."""
        return rows.take(self.index, self.cut(rows.token_ids, buffers))

    def guide_view(
        self,
        buffers: StepIndices,
        step: int,
        rows: RowInfo,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        is_random: np.ndarray,
        filtered: bool,
        hidden: dict[str, torch.Tensor],
        changed: torch.Tensor,
    ) -> GuideView:
        """The consumer's guide view of the step's sampling rows (``rows``, ``logits``...)."""
        return GuideView(
            step,
            self.rows(rows, buffers),
            self.cut(logits, buffers),
            self.cut(temperature, buffers),
            is_random[self.mask],
            filtered,
            {k: self.cut(v, buffers) for k, v in hidden.items()},
            changed,
        )

    def write_back(self, logits: torch.Tensor, view: GuideView, buffers: StepIndices) -> None:
        """A guide that succeeded and wrote: its logits into the step's (a range wrote them
        in place)."""
        if self.span is None:
            logits.index_copy_(0, buffers.index(self.index, logits.device), view.logits)

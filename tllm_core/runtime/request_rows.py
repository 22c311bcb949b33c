"""A per-request consumer's rows of a step (the requests that switched it on), cut out of the
step's tensors without a device allocation or a host wait in a steady step.

Where the rows form one contiguous range (a block of requests) the consumer gets views of
the step's tensors: nothing is copied, and a guide writes the step's logits in place (its
writes are undone through the view's undo log if it fails: :meth:`GuideView.rollback`).
Otherwise its rows are gathered into the runtime's reused buffers (:mod:`.buffer_pool`) and
a guide's logits are written back into the step's only if it succeeded and wrote. A guide's
index goes to the device in the step's one index copy (:meth:`StepIndices.plan`); an
editor's rows are cut in ``begin_step``, before the step is planned, so their index is sent
in a copy of its own (pinned and asynchronous as well).
"""

from __future__ import annotations

import numpy as np
import torch

from tllm_core.api.bundles import GuideView
from tllm_core.api.rows import RowInfo
from tllm_core.runtime.step_indices import StepIndices


def span(index: np.ndarray) -> slice | None:
    """``index`` (sorted and distinct, as ``np.nonzero`` gives it) as a slice when it is one
    contiguous range; None otherwise (or when empty)."""
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
    ) -> GuideView:
        """The consumer's guide view of the step's sampling rows (``rows``, ``logits``...)."""
        changed = buffers.pool.take((len(self),), torch.long, logits.device)
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
        """A guide that succeeded and wrote: its logits into the step's (already there for
        a range: the view wrote them in place)."""
        if self.span is None:
            logits.index_copy_(0, buffers.index(self.index, logits.device), view.logits)

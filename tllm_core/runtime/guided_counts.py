"""``rows_guided`` and ``candidates_guided`` summed on the logits' device, read only when the
counters are (a read per step would stall the host until the step's kernels finish)."""

from __future__ import annotations

import torch

from tllm_core.runtime.buffer_pool import BufferPool


class GuidedCounts:
    """Per device: ``[rows with a changed logit, changed logits]``, accumulated without a host
    read (the per-row mask taken from ``pool`` when given)."""

    def __init__(self, pool: BufferPool | None = None) -> None:
        self._pool = pool
        # Per device: the two totals, then the two sums of the view being added.
        self._totals: dict[torch.device, torch.Tensor] = {}

    def add(self, changed_per_row: torch.Tensor) -> None:
        """Add one view's ``changed_per_row`` (int64 ``[R]``, on its device)."""
        c = changed_per_row
        total = self._totals.get(c.device)
        if total is None:
            total = self._totals[c.device] = torch.zeros(4, dtype=torch.long, device=c.device)
        out = None if self._pool is None else self._pool.take(c.shape, torch.bool, c.device)
        mask = torch.gt(c, 0, out=out)
        torch.sum(mask, 0, out=total[2])
        torch.sum(c, 0, out=total[3])
        total[:2].add_(total[2:])

    def drain(self) -> tuple[int, int]:
        """``(rows_guided, candidates_guided)`` since the last drain (a host read per device)."""
        rows = candidates = 0
        for total in self._totals.values():
            r, c = total[:2].cpu().tolist()
            rows, candidates = rows + r, candidates + c
        # Dropped, not zeroed: a total made in the sampler is an inference tensor, which
        # may not be changed in place outside inference mode.
        self._totals.clear()
        return rows, candidates

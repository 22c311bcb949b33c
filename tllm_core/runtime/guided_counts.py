"""``rows_guided`` and ``candidates_guided`` summed on the logits' device.

A guided step must not wait for the device to learn how many logits its guides changed
(on CUDA each such read stalls the host until the step's kernels finish, which undoes
vLLM's overlap of the next step's scheduling with the GPU). The counts are therefore added
up where the writes happened, on the device, and read into the runtime's counters only when
the counters are read (``Runtime.collect``)."""

from __future__ import annotations

import torch


class GuidedCounts:
    """Per device: ``[rows with a changed logit, changed logits]``, int64, accumulated
    without a host read."""

    def __init__(self) -> None:
        self._totals: dict[torch.device, torch.Tensor] = {}

    def add(self, changed_per_row: torch.Tensor) -> None:
        """Add one view's ``changed_per_row`` (int64 ``[R]``, on its device)."""
        device = changed_per_row.device
        total = self._totals.get(device)
        if total is None:
            total = self._totals[device] = torch.zeros(2, dtype=torch.long, device=device)
        total.add_(torch.stack([(changed_per_row > 0).sum(), changed_per_row.sum()]))

    def drain(self) -> tuple[int, int]:
        """``(rows_guided, candidates_guided)`` added since the last drain (one host read
        per device)."""
        rows = candidates = 0
        for total in self._totals.values():
            r, c = total.cpu().tolist()
            rows, candidates = rows + r, candidates + c
        # Dropped, not zeroed: a total made in the sampler is an inference tensor, which
        # may not be changed in place outside inference mode.
        self._totals.clear()
        return rows, candidates

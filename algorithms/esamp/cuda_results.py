"""The CUDA update's results, logged in a device ring (one row per update batch) and copied
to the host every ``every`` updates without blocking; only :meth:`ResultLog.drain` waits."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from algorithms.esamp.adam import STATS
from algorithms.esamp.slots import TrainResult
from tllm_core import HostCopyRing

# Update results kept on the device between background copies.
RESULT_ROWS = 512


@dataclass
class Pending:
    """One submitted train step: its batches' ring rows and which step groups each holds."""

    parts: list[tuple[int, np.ndarray]]  # (ring row, indices of the step's groups)
    res: TrainResult  # filled in from the ring
    serial: int = 0  # updates logged before and including this one


class ResultLog:
    """The device ring of update results and the staleness maximum ``stale``, copied back
    through a two-buffer :class:`~tllm_core.HostCopyRing`."""

    def __init__(
        self,
        capacity: int,
        stats: bool,
        device: torch.device,
        rows: int = RESULT_ROWS,
        every: int = 32,
    ):
        self.rows, self.every = rows, every
        self.losses = torch.zeros(rows, capacity, device=device)
        self.ok = torch.zeros(rows, capacity, device=device)
        self.stats = torch.zeros(rows, capacity, len(STATS), device=device) if stats else None
        self.stale = torch.zeros(1, dtype=torch.long, device=device)  # max staleness seen
        self._copies = HostCopyRing(self._device_buffers(), 2, read=self._read)
        self._pending: list[Pending] = []
        self._next = 0  # updates logged so far
        self._copied = 0  # updates covered by the last copy issued
        self.staleness_max = 0

    @property
    def host_waits(self) -> int:
        """Copies the host had to wait for (a buffer still in flight, drain)."""
        return self._copies.waits

    def _device_buffers(self) -> list[torch.Tensor]:
        return [self.losses, self.ok, self.stale] + ([self.stats] if self.stats is not None else [])

    def next_row(self) -> int:
        """The ring row of the next update batch."""
        if self._next - self._copied >= self.rows:
            raise RuntimeError("result ring overrun: copy() was not called in time")
        row = self._next % self.rows
        self._next += 1
        return row

    def add(self, p: Pending) -> None:
        p.serial = self._next
        self._pending.append(p)

    def maybe_copy(self, stream) -> None:
        """Start a background copy every ``every`` updates (and before the ring wraps)."""
        if self._next - self._copied >= min(self.every, self.rows // 2):
            self.copy(stream)

    def copy(self, stream) -> None:
        """Copy the ring to the host without blocking, after the updates logged."""
        if self._next == self._copied:
            return
        self._copies.send(self._device_buffers(), tag=self._next, stream=stream)
        self._copied = self._next

    def poll(self) -> None:
        """Hand out every result whose copy has arrived (no waiting)."""
        self._copies.arrived()

    def drain(self, stream) -> None:
        """Copy and wait for every result logged (a host sync)."""
        self.copy(stream)
        self._copies.arrived(wait=True)

    def _read(self, serial: int, host: list[torch.Tensor]) -> None:
        losses, ok, stale = host[0], host[1], host[2]
        stats = host[3] if self.stats is not None else None
        self.staleness_max = max(self.staleness_max, int(stale[0]))
        while self._pending and self._pending[0].serial <= serial:
            p = self._pending.pop(0)
            res = p.res
            for row, groups in p.parts:
                k = len(groups)
                idx = torch.from_numpy(groups)
                res.losses[idx] = losses[row, :k]
                res.updated[idx] = ok[row, :k] > 0
                if res.stats is not None and stats is not None:
                    res.stats[idx] = stats[row, :k]
            res.done.set()

"""The CUDA update's results (each group's loss, whether it was applied, its statistics),
logged on the device and brought to the host in the background.

Each update batch writes one row of a device ring (``[N, C]``). Every ``every`` updates the
whole ring and the staleness maximum are copied into pinned host memory without blocking
(a D2H copy on the side stream, after the updates it covers) and an event is recorded;
:meth:`ResultLog.poll` hands out the results whose copy has arrived (``event.query()``: no
wait). Only :meth:`ResultLog.drain` waits, where a host sync is paid anyway (the consumer's
``result()``, shutdown)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from algorithms.esamp.adam import STATS


@dataclass
class Pending:
    """One submitted train step: its batches' ring rows and which step groups each holds."""

    parts: list[tuple[int, np.ndarray]]  # (ring row, indices of the step's groups)
    groups: int
    losses: torch.Tensor
    updated: torch.Tensor
    stats: torch.Tensor | None
    done: threading.Event = field(default_factory=threading.Event)
    serial: int = 0  # updates logged before and including this one


class ResultLog:
    def __init__(
        self, rows: int, capacity: int, stats: bool, device: torch.device, pin, every: int = 32
    ):
        self.rows, self.every = rows, every
        self.losses = torch.zeros(rows, capacity, device=device)
        self.ok = torch.zeros(rows, capacity, device=device)
        self.stats = torch.zeros(rows, capacity, len(STATS), device=device) if stats else None
        self.stale = torch.zeros(1, dtype=torch.long, device=device)  # max staleness seen
        # Two host copies, alternating: one may be in flight while the other is read.
        self._host = [self._host_buffers(pin) for _ in range(2)]
        self._flight: list[tuple[int, torch.cuda.Event, int]] = []  # (buffer, event, serial)
        self._pending: list[Pending] = []
        self._next = 0  # updates logged so far
        self._copied = 0  # updates covered by the last copy issued
        self._buf = 0
        self.staleness_max = 0
        self.host_waits = 0  # copies the host had to wait for (buffer reuse, drain)

    def _host_buffers(self, pin) -> list[torch.Tensor]:
        """Pinned host twins of :meth:`_device_buffers`, in the same order."""
        return [pin(torch.empty(t.shape, dtype=t.dtype)) for t in self._device_buffers()]

    def _device_buffers(self) -> list[torch.Tensor]:
        return [self.losses, self.ok, self.stale] + ([self.stats] if self.stats is not None else [])

    def next_row(self) -> int:
        """The ring row of the next update batch; copies the ring first if it would wrap
        over rows not yet copied."""
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
        """Copy the ring to the host without blocking, ordered after the updates logged."""
        if self._next == self._copied:
            return
        buf = self._buf
        self._buf ^= 1
        for b, _, _ in self._flight:
            if b == buf:  # the previous copy into this buffer must have been read
                self._wait_first()
        ev = torch.cuda.Event()
        with torch.cuda.stream(stream):
            for host, dev in zip(self._host[buf], self._device_buffers(), strict=True):
                host.copy_(dev, non_blocking=True)
            ev.record(stream)
        self._flight.append((buf, ev, self._next))
        self._copied = self._next

    def _wait_first(self) -> None:
        buf, ev, serial = self._flight[0]
        if not ev.query():
            self.host_waits += 1
            ev.synchronize()
        self.poll()

    def poll(self) -> None:
        """Hand out every result whose copy has arrived (no waiting)."""
        while self._flight and self._flight[0][1].query():
            buf, _, serial = self._flight.pop(0)
            self._read(self._host[buf], serial)

    def drain(self, stream) -> None:
        """Copy and wait for every result logged (a host sync)."""
        self.copy(stream)
        while self._flight:
            self._wait_first()

    def _read(self, host: list[torch.Tensor], serial: int) -> None:
        losses, ok, stale = host[0], host[1], host[2]
        stats = host[3] if self.stats is not None else None
        self.staleness_max = max(self.staleness_max, int(stale[0]))
        while self._pending and self._pending[0].serial <= serial:
            p = self._pending.pop(0)
            for row, groups in p.parts:
                k = len(groups)
                idx = torch.from_numpy(groups)
                p.losses[idx] = losses[row, :k]
                p.updated[idx] = ok[row, :k] > 0
                if p.stats is not None and stats is not None:
                    p.stats[idx] = stats[row, :k]
            p.done.set()

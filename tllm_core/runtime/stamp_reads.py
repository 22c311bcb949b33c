"""A step's tap stamps and edit counts, read without making the host wait for the device.

At the end of a step the runtime needs, on the host, which taps the forward wrote (their
stamps) and how many rows each edit changed. On a GPU a plain read of those values waits
for the forward and the sampler to finish: every step, before the next forward is queued
(under async scheduling the overlap it exists for is lost). :class:`StampReader` instead
gathers them into one device buffer, copies it into pinned host memory without blocking and
records an event; the values are read once the event has completed (:class:`StampRead`).
On CPU the copy is done before :meth:`StampReader.start` returns.

The device buffer and a small ring of pinned buffers are allocated once per set of keys:
a step allocates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tllm_core.api.host_copies import async_copies

# Pinned buffers in rotation; a read still pending when its buffer comes round again is
# waited for (that many steps later the device has long finished it).
RING = 4


@dataclass
class StampRead:
    """One step's stamps then edit counts, in :attr:`keys` order (``n_stamps`` stamps)."""

    keys: tuple[str, ...]
    n_stamps: int
    host: torch.Tensor
    event: Any | None  # recorded after the copy; None: ``host`` already holds the values
    _values: list[int] | None = None

    def ready(self) -> bool:
        """Whether the values can be read without waiting for the device."""
        return self._values is not None or self.event is None or bool(self.event.query())

    def values(self) -> list[int]:
        """The values (waits for the copy if it has not completed)."""
        if self._values is None:
            if self.event is not None and not self.event.query():
                self.event.synchronize()
            self._values = self.host.tolist()
        return self._values


class StampReader:
    """Starts :class:`StampRead` s of steps with the same stamp and edit keys."""

    def __init__(self) -> None:
        self._keys: tuple[str, ...] | None = None
        self._device: torch.Tensor | None = None
        self._ring: list[torch.Tensor] = []
        self._reads: list[StampRead | None] = []
        self._next = 0
        self._async = False

    def start(self, stamps: dict[str, torch.Tensor], edited: dict[str, torch.Tensor]) -> StampRead:
        """Queue the copy of ``stamps`` then ``edited`` (one-element tensors on one device)."""
        keys = (*stamps, *edited)
        parts = [t.reshape(1) for t in (*stamps.values(), *edited.values())]
        if not parts:
            return StampRead(keys, 0, torch.zeros(0, dtype=torch.int64), None)
        device = parts[0].device
        if keys != self._keys or self._device is None or self._device.device != device:
            self._allocate(keys, device)
        assert self._device is not None
        torch.cat(parts, out=self._device)
        i = self._next
        self._next = (i + 1) % RING
        old = self._reads[i]
        if old is not None:
            old.values()  # this buffer's last read: settled before the buffer is rewritten
        host = self._ring[i]
        if device.type == "cpu":
            host.copy_(self._device)
            read = StampRead(keys, len(stamps), host, None)
        elif not self._async:
            # A device without CUDA's streams and events: one blocking read.
            read = StampRead(keys, len(stamps), self._device.cpu(), None)
        else:
            host.copy_(self._device, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            read = StampRead(keys, len(stamps), host, event)
        self._reads[i] = read
        return read

    def _allocate(self, keys: tuple[str, ...], device: torch.device) -> None:
        self._keys = keys
        self._device = torch.empty(len(keys), dtype=torch.int64, device=device)
        self._async = async_copies(device)  # then into pinned memory
        self._ring = [
            torch.empty(len(keys), dtype=torch.int64, pin_memory=self._async) for _ in range(RING)
        ]
        self._reads = [None] * RING
        self._next = 0

"""A step's tap stamps and edit counts, copied to the host in one buffer without the host
waiting for the device (a plain read would wait for the forward every step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tllm_core.api.transfers import HostCopyRing

# Host buffers in rotation (a read pending when its buffer comes round again is waited for).
RING = 4


@dataclass(eq=False)  # by identity: the ring hands reads back by their tag
class StampRead:
    """One step's stamps then edit counts, in :attr:`keys` order (``n_stamps`` stamps)."""

    keys: tuple[str, ...]
    n_stamps: int
    _ring: HostCopyRing | None  # the copy's ring; None: no values to copy
    _values: list[int] | None = None

    def ready(self) -> bool:
        """Whether the values can be read without waiting for the device."""
        if self._values is None and self._ring is not None:
            self._ring.arrived()
        return self._values is not None

    def values(self) -> list[int]:
        """The values (waits for the copy if it has not arrived)."""
        if self._values is None and self._ring is not None:
            self._ring.arrived(wait=True, until=self)
        assert self._values is not None
        return self._values


def _settle(read: StampRead, host: torch.Tensor) -> None:
    read._values = host.tolist()


class StampReader:
    def __init__(self) -> None:
        self._keys: tuple[str, ...] | None = None
        self._device: torch.Tensor | None = None
        self._ring: HostCopyRing | None = None

    def start(self, stamps: dict[str, torch.Tensor], edited: dict[str, torch.Tensor]) -> StampRead:
        """Queue the copy of ``stamps`` then ``edited`` (one-element tensors on one device)."""
        keys = (*stamps, *edited)
        parts = [t.reshape(1) for t in (*stamps.values(), *edited.values())]
        if not parts:
            return StampRead(keys, 0, None, [])
        device = parts[0].device
        if keys != self._keys or self._device is None or self._device.device != device:
            self._keys = keys
            self._device = torch.empty(len(keys), dtype=torch.int64, device=device)
            self._ring = HostCopyRing(self._device, RING, read=_settle)
        assert self._ring is not None
        torch.cat(parts, out=self._device)
        read = StampRead(keys, len(stamps), self._ring)
        self._ring.send(self._device, tag=read)
        return read

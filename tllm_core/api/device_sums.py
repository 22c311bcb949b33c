"""Sums kept on the device and counted on the host without making the host wait: a copy back
is queued (:class:`~tllm_core.api.transfers.HostCopyRing`), the sums zeroed after it, and each
copy handed out once it has arrived::

    sums = DeviceSums(torch.zeros(3, device="cuda"))
    ...                      # each step: sums.add(step_counts)
    sums.send()              # from time to time: nothing waits (nothing sent if nothing added)
    for part in sums.arrived():          # the copies that are back (lists of numbers)
        total += part[0]
    sums.send(); sums.arrived(wait=True)  # at the end: everything, waiting for it

On CPU the copy is made at once (and so has arrived).
"""

from __future__ import annotations

from typing import Any

import torch

from tllm_core.api.transfers import HostCopyRing


class DeviceSums:
    """``values``: the device tensor the sums are kept in. ``ring``: copies that may be in
    flight at once (:meth:`send` skips while all are)."""

    def __init__(self, values: torch.Tensor, ring: int = 2) -> None:
        self.values = values
        self._copies = HostCopyRing(values.reshape(-1), ring)
        self._added = False  # something was added since the last copy

    def add(self, x: torch.Tensor) -> None:
        """Add ``x`` to the sums (on the device, current stream)."""
        self.values.add_(x)
        self._added = True

    def send(self) -> bool:
        """Queue a copy of the sums to the host and their reset; False when nothing was added
        or every host buffer is in flight (the sums go with a later copy)."""
        if not self._added or self._copies.full:
            return False
        self._copies.send(self.values.reshape(-1))
        self.values.zero_()
        self._added = False
        return True

    def arrived(self, wait: bool = False) -> list[list[Any]]:
        """The copies that have arrived, oldest first, as lists (``wait``: every copy)."""
        return [values for _, values in self._copies.arrived(wait)]

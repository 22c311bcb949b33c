"""A step's row indices sent to the device in one pinned copy (equal ones once), and the
runtime's gathers into reused buffers (:mod:`.buffer_pool`)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from tllm_core.api.transfers import StagingRing, async_copies, index_to
from tllm_core.runtime.buffer_pool import BufferPool

RING = 16  # slots of a few KB; editors not in the step's plan take one each


class StepIndices:
    """The runtime's per-step device indices and gathered rows. ``copies``: index copies
    queued; ``waits``: staging buffers the host waited for."""

    def __init__(self, pool: BufferPool | None = None, ring: int = RING) -> None:
        self.pool = pool or BufferPool()
        self._ring = ring
        self._staging: StagingRing | None = None  # made for the first device planned
        # The step's indices on the device, by device and their bytes (as int64).
        self._index: dict[tuple[torch.device, bytes], torch.Tensor] = {}

    @property
    def copies(self) -> int:
        return self._staging.copies if self._staging else 0

    @property
    def waits(self) -> int:
        return self._staging.waits if self._staging else 0

    def plan(self, arrays: Iterable[np.ndarray], device: torch.device) -> None:
        """Send ``arrays`` (the step's host indices) in one copy; the previous plan's go."""
        self.release()
        self.send(arrays, device)

    def send(self, arrays: Iterable[np.ndarray], device: torch.device) -> None:
        """Send ``arrays`` to ``device`` in one copy, beside the step's other indices."""
        if not async_copies(device):
            return  # index() makes each index on the device as it is needed
        new: dict[tuple[torch.device, bytes], np.ndarray] = {}
        for x in arrays:
            a = np.ascontiguousarray(x, dtype=np.int64)
            key = (device, a.tobytes())
            if key not in self._index:
                new.setdefault(key, a)
        total = sum(a.size for a in new.values())
        if total == 0:
            for key in new:
                self._index[key] = self.pool.take((0,), torch.int64, device)
            return
        dev = self.pool.take((total,), torch.int64, device)
        self._staging = self._staging or StagingRing(device, self._ring)
        i, host = self._staging.take(total)
        np.concatenate(list(new.values()), out=host.numpy())  # straight into the pinned buffer
        self._staging.send(i, dev)
        off = 0
        for key, a in new.items():
            self._index[key] = dev[off : off + a.size]
            off += a.size

    def release(self) -> None:
        """Let the step's device indices go (their buffer is reused by a later plan)."""
        self._index.clear()

    def index(self, idx: np.ndarray, device: torch.device) -> torch.Tensor:
        """``idx`` as an int64 tensor on ``device`` (the planned copy's view, else sent alone),
        valid until the next :meth:`plan`."""
        if not async_copies(device):
            return index_to(idx, device)
        key = (device, np.ascontiguousarray(idx, dtype=np.int64).tobytes())
        if key not in self._index:
            self.send([idx], device)
        return self._index[key]

    def gather(self, t: torch.Tensor, idx: np.ndarray) -> torch.Tensor:
        """``t.index_select(0, idx)`` into a pooled buffer."""
        out = self.pool.take((len(idx), *t.shape[1:]), t.dtype, t.device)
        return torch.index_select(t, 0, self.index(idx, t.device), out=out)

"""Device buffers reused from step to step (a steady decode step allocates nothing), the step's
row indices sent in one pinned copy, and the guided counts summed on the device. A buffer is
reused only when nothing outside the pool holds it, after the work queued on its last stream."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tllm_core.api.transfers import StagingRing, async_copies, index_to, pow2_rows

# Where torch lacks it, nothing is reused (every take allocates, as without a pool).
_use_count = getattr(torch._C, "_storage_Use_Count", None)
RING = 16  # index staging slots of a few KB; editors not in the step's plan take one each


def storage_uses(t: torch.Tensor) -> int:
    """How many holders ``t``'s storage has (each tensor or view over it counts one)."""
    assert _use_count is not None
    return int(_use_count(t.untyped_storage()._cdata))


@dataclass(eq=False)  # by identity (a tensor field has no truth value)
class _Buffer:
    data: torch.Tensor
    uses: int  # the storage's use count while only the pool holds it
    stream: Any  # the stream it was last handed out on (None: no streams)


class BufferPool:
    """Reusable device buffers. ``allocations``: buffers made so far, pooled or not;
    ``unpooled``: those made because ``keep`` buffers were all held."""

    def __init__(self, keep: int = 16) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.keep = keep
        self._buffers: dict[tuple[Any, ...], list[_Buffer]] = {}
        self.allocations = 0
        self.unpooled = 0

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An uninitialised tensor, a view of a pooled buffer kept from reuse while alive."""
        n, rest = int(shape[0]), tuple(int(s) for s in shape[1:])
        stream = torch.cuda.current_stream(device) if async_copies(device) else None
        bufs = self._buffers.setdefault((dtype, device, rest), [])
        small = None
        for b in bufs:
            if storage_uses(b.data) != b.uses:
                continue  # held outside the pool
            if b.data.shape[0] >= n:
                if stream is not None and b.stream is not None and b.stream != stream:
                    event = torch.cuda.Event()  # reused after the work queued on its last stream
                    event.record(b.stream)
                    stream.wait_event(event)
                b.stream = stream
                return b.data[:n]
            small = small or b
        if small is not None:
            bufs.remove(small)  # grown: the smaller one is let go
            if small.stream is not None:  # freed after the work queued on its last stream
                small.data.record_stream(small.stream)
        elif len(bufs) >= self.keep or _use_count is None:
            self.unpooled += 1
            return self._empty((n, *rest), dtype, device)
        data = self._empty((pow2_rows(n), *rest), dtype, device)
        bufs.append(_Buffer(data, storage_uses(data), stream))
        return data[:n]

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.allocations += 1
        # Not an inference tensor: written in place outside inference mode too.
        with torch.inference_mode(False):
            return torch.empty(shape, dtype=dtype, device=device)


class StepIndices:
    """The runtime's per-step device indices and gathered rows. ``copies``: index copies
    queued; ``waits``: staging buffers the host waited for."""

    def __init__(self, ring: int = RING) -> None:
        self.pool = BufferPool()
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
        """``idx`` on ``device`` (the planned copy's view, else sent alone) until the next plan."""
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


class GuidedCounts:
    """``rows_guided``, ``candidates_guided`` and ``rows_without_candidates`` summed per device
    without a host read (one per step would stall the host until the step's kernels finish);
    read at :meth:`drain`."""

    def __init__(self, pool: BufferPool | None = None) -> None:
        self._pool = pool
        # Per device: the three totals, then a scratch sum per total.
        self._totals: dict[torch.device, torch.Tensor] = {}

    def _total(self, device: torch.device) -> torch.Tensor:
        total = self._totals.get(device)
        if total is None:
            total = self._totals[device] = torch.zeros(6, dtype=torch.long, device=device)
        return total

    def _mask(self, like: torch.Tensor) -> torch.Tensor | None:
        return None if self._pool is None else self._pool.take(like.shape, torch.bool, like.device)

    def add(self, changed_per_row: torch.Tensor) -> None:
        """Add one view's ``changed_per_row`` (int64 ``[R]``, on its device)."""
        c, total = changed_per_row, self._total(changed_per_row.device)
        torch.sum(torch.gt(c, 0, out=self._mask(c)), 0, out=total[3])
        torch.sum(c, 0, out=total[4])
        total[:2].add_(total[3:5])

    def add_empty(self, row_max: torch.Tensor) -> None:
        """Add the rows whose largest logit ``row_max`` (``[R]``, after the guides) is not
        finite: every logit ``-inf``, or a NaN or ``+inf`` (``row_max`` is overwritten)."""
        total = self._total(row_max.device)
        finite = torch.lt(row_max.abs_(), float("inf"), out=self._mask(row_max))
        torch.sum(finite.logical_not_(), 0, out=total[5])
        total[2].add_(total[5])

    def drain(self) -> tuple[int, int, int]:
        """``(rows_guided, candidates_guided, rows_without_candidates)`` since the last drain
        (a host read per device)."""
        sums = [0, 0, 0]
        for total in self._totals.values():
            sums = [a + b for a, b in zip(sums, total[:3].cpu().tolist(), strict=True)]
        # Dropped, not zeroed: a total made in the sampler is an inference tensor, which
        # may not be changed in place outside inference mode.
        self._totals.clear()
        return sums[0], sums[1], sums[2]

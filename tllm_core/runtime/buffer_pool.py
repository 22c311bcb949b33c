"""Device buffers reused from step to step (a steady decode step allocates nothing): one is
handed out again only when nothing outside the pool holds its storage, and after the work
queued on the stream it was last handed out on (work on a consumer's own stream must hold
the tensor until it ran)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tllm_core.api.transfers import async_copies, pow2_rows

# Where torch lacks it, nothing is reused (every take allocates, as without a pool).
_use_count = getattr(torch._C, "_storage_Use_Count", None)


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
        """An uninitialised tensor of ``shape`` on ``device``, a view of a pooled buffer kept
        from reuse while it (or a view) is alive."""
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

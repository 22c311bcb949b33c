"""Device tensors copied to the host without making the host wait: a ring of host buffers
(pinned where the device is CUDA), each copy queued without blocking with an event and
handed out, in order, once the event says it has arrived. The building block of
:class:`~tllm_core.api.device_sums.DeviceSums` and of ESamp's diagnostics ring."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch


def async_copies(device: torch.device) -> bool:
    """Whether copies between the host and ``device`` are queued without blocking (from or
    into pinned memory, ordered by events): CUDA, and the test kit's fake CUDA."""
    return device.type != "cpu" and torch.cuda.is_available()


class HostCopies:
    """Copies of device tensors shaped like ``like`` into a ring of ``ring`` host buffers
    (pinned where the device is CUDA), each queued without blocking with an event, and
    handed out in order once arrived (on CPU a copy has arrived at once). ``tag``: what the
    sender keeps with its copy. ``waits``: copies :meth:`arrived` had to wait for."""

    def __init__(self, like: torch.Tensor, ring: int = 2) -> None:
        self._async = async_copies(like.device)
        # Not inference tensors, though often made in a step: written again outside one too
        # (a closing read).
        with torch.inference_mode(False):
            self._host = [
                torch.empty(like.shape, dtype=like.dtype, pin_memory=self._async)
                for _ in range(ring)
            ]
        self._free = deque(range(ring))
        self._flight: deque[tuple[int, Any, Any]] = deque()
        self.waits = 0

    @property
    def full(self) -> bool:
        """Whether every host buffer holds a copy not yet handed out (:meth:`send` needs one)."""
        return not self._free

    def send(self, src: torch.Tensor, tag: Any = None) -> None:
        """Queue a copy of ``src`` (current stream) into a free host buffer."""
        i = self._free.popleft()
        event = None
        if not self._async:
            self._host[i].copy_(src)
        else:
            self._host[i].copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._flight.append((i, event, tag))

    def arrived(self, wait: bool = False) -> list[tuple[Any, list[Any]]]:
        """``(tag, values as lists)`` of the copies that have arrived, oldest first (``wait``:
        every copy sent, waiting for those still in flight); their buffers are free again."""
        out = []
        while self._flight:
            i, event, tag = self._flight[0]
            if event is not None and not event.query():
                if not wait:
                    break
                self.waits += 1
                event.synchronize()
            self._flight.popleft()
            out.append((tag, self._host[i].tolist()))
            self._free.append(i)
        return out

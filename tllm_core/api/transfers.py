"""Copies between host and device that make the host wait in no steady step (docs/ports.md).
Imports torch and numpy only: the GPU image has neither pydantic nor vLLM."""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

Read = Callable[[Any, Any], Any]


def async_copies(device: torch.device) -> bool:
    """Whether copies between the host and ``device`` are queued without blocking."""
    return device.type != "cpu" and torch.cuda.is_available()


def pow2_rows(n: int) -> int:
    """The power of two at or above ``n`` (at least 1): the rows a grown buffer gets."""
    return 1 << max(0, n - 1).bit_length()


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``t`` on ``device`` without making the host wait: copied from pinned
    memory (the caching host allocator keeps the block until the copy ran)."""
    if device.type == "cpu":
        return t
    if async_copies(device):
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def index_to(idx: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host indices ``idx`` as an int64 index tensor on ``device`` (:func:`host_to_device`)."""
    return host_to_device(torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64)), device)


def _host_empty(numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    # Not an inference tensor: the buffer is written outside inference mode too, and its
    # views keep their base (by which the fake CUDA tells pinned memory).
    with torch.inference_mode(False):
        return torch.zeros(numel, dtype=dtype, pin_memory=pinned)


def _wait(event: Any | None) -> bool:
    """Whether the host had to wait for ``event``."""
    if event is None or event.query():
        return False
    event.synchronize()
    return True


class StagingRing:
    """Host-to-device staging through ``slots`` flat host buffers of ``dtype`` in rotation
    (each grown to :func:`pow2_rows` elements as needed; ``numel``: allocated at once)."""

    def __init__(
        self, device: torch.device, slots: int, dtype: torch.dtype = torch.int64, numel: int = 0
    ) -> None:
        self.pinned = async_copies(torch.device(device))
        self.dtype = dtype
        self.buffers: list[torch.Tensor | None] = [
            _host_empty(numel, dtype, self.pinned) if numel else None for _ in range(slots)
        ]
        self._events: list[Any | None] = [None] * slots
        self._next = 0
        self.waits = 0
        self.copies = 0

    def take(self, numel: int) -> tuple[int, torch.Tensor]:
        """The next slot and its first ``numel`` elements, free once its last copy ran."""
        i = self._next
        self._next = (i + 1) % len(self.buffers)
        self.waits += _wait(self._events[i])
        buf = self.buffers[i]
        if buf is None or buf.numel() < numel:
            buf = self.buffers[i] = _host_empty(pow2_rows(numel), self.dtype, self.pinned)
        return i, buf[:numel]

    def send(self, slot: int, dst: torch.Tensor, stream: Any | None = None) -> None:
        """Queue the copy of ``slot`` into ``dst``; its event recorded on ``stream``."""
        buf = self.buffers[slot]
        assert buf is not None, "send() of a slot not taken"
        dst.copy_(buf[: dst.numel()].view(dst.shape), non_blocking=self.pinned)
        if self.pinned:  # Event.record(None): on the current stream
            event = self._events[slot] = self._events[slot] or torch.cuda.Event()
            event.record(stream)
        self.copies += 1


def _as_lists(tag: Any, host: Any) -> Any:
    return host.tolist() if isinstance(host, torch.Tensor) else [t.tolist() for t in host]


class HostCopyRing:
    """Device-to-host copies into ``ring`` host buffers shaped like ``like`` (tensors copied
    together), handed out in order once arrived as ``read(tag, host)`` (default: lists)."""

    def __init__(
        self, like: torch.Tensor | Sequence[torch.Tensor], ring: int = 2, read: Read = _as_lists
    ) -> None:
        self._single = isinstance(like, torch.Tensor)
        likes = [like] if self._single else list(like)
        self._async = async_copies(likes[0].device)
        self._host = [
            [_host_empty(t.numel(), t.dtype, self._async).view(t.shape) for t in likes]
            for _ in range(ring)
        ]
        self._read = read
        self._free = deque(range(ring))
        self._flight: deque[tuple[int, Any, Any]] = deque()  # (buffer, event, tag)
        self._out: list[tuple[Any, Any]] = []  # read early (a full ring), not yet handed out
        self.waits = 0

    @property
    def full(self) -> bool:
        """Whether :meth:`send` would wait for the oldest copy."""
        return not self._free

    @property
    def in_flight(self) -> int:
        """Copies sent and not yet handed out."""
        return len(self._flight)

    def send(
        self, src: torch.Tensor | Sequence[torch.Tensor], tag: Any = None, stream: Any = None
    ) -> None:
        """Queue a copy of ``src`` on ``stream`` (None: the current one); a full ring first
        waits for its oldest copy."""
        if not self._free:
            self._take_oldest(wait=True)
        i = self._free.popleft()
        srcs = [src] if isinstance(src, torch.Tensor) else list(src)
        event = None
        if not self._async:  # one blocking read per tensor (``Tensor.cpu`` off the CPU)
            for host, s in zip(self._host[i], srcs, strict=True):
                host.copy_(s if s.device.type == "cpu" else s.cpu())
        else:
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                for host, s in zip(self._host[i], srcs, strict=True):
                    host.copy_(s, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._flight.append((i, event, tag))

    def arrived(self, wait: bool = False, until: Any = None) -> list[tuple[Any, Any]]:
        """``(tag, read(tag, host))`` of the copies that have arrived, oldest first.
        ``wait``: every copy, waiting for those in flight (``until``: up to that tag's)."""
        while self._flight:
            tag = self._flight[0][2]
            if not self._take_oldest(wait):
                break
            if until is not None and tag is until:
                wait = False
        out, self._out = self._out, []
        return out

    def _take_oldest(self, wait: bool) -> bool:
        i, event, tag = self._flight[0]
        if not wait and event is not None and not event.query():
            return False
        self.waits += _wait(event)
        self._flight.popleft()
        host = self._host[i][0] if self._single else self._host[i]
        self._out.append((tag, self._read(tag, host)))
        self._free.append(i)
        return True


class DeviceSums:
    """Sums kept on the device (``values``), read on the host without a wait (docs/ports.md)."""

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
        or the ring is full."""
        if not self._added or self._copies.full:
            return False
        self._copies.send(self.values.reshape(-1))
        self.values.zero_()
        self._added = False
        return True

    def arrived(self, wait: bool = False) -> list[list[Any]]:
        """The copies that have arrived, oldest first, as lists (``wait``: every copy)."""
        return [values for _, values in self._copies.arrived(wait)]


class HostCopies(HostCopyRing):
    """Deprecated name of :class:`HostCopyRing` (the same class)."""

    def __init__(self, like: torch.Tensor, ring: int = 2) -> None:
        warnings.warn(
            "tllm_core.HostCopies is deprecated: use tllm_core.HostCopyRing (the same "
            "arguments and methods)",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(like, ring)

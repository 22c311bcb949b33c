"""An edit tap's values on its device: a consumer's edit vector moved (or, for an ablation,
normalised) once, not every step.

A 1-D value is kept by the tensor's identity and version (a host vector is also compared
with a copy of itself: a write through ``.numpy()`` is seen); a device vector must change
through torch operations. 2-D values and inference tensors (no version) are prepared every
step: make vectors at construction or under ``torch.inference_mode(False)``. ``prepared``
counts the values prepared.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

KEEP = 32  # values kept per tap; the oldest goes first


class EditValues:
    """Values of one tap's edits, as its buffers hold them (``device``, ``dtype``)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, keep: int = KEEP) -> None:
        self.device = device
        self.dtype = dtype
        self.keep = keep
        # (id, version, ablate) -> (the consumer's tensor, kept alive so its id is not
        # reused; the prepared value; its tag; a host copy to compare a host tensor with)
        self._kept: dict[tuple[int, int, bool], tuple[Any, ...]] = {}
        self._tags = 0
        self._warned = False
        self.prepared = 0

    def get(self, value: torch.Tensor, ablate: bool) -> tuple[torch.Tensor, int]:
        """``value`` on the device in the dtype (an ablation's normalised), and a tag: equal
        tags are the same prepared value."""
        if value.dim() != 1 or value.is_inference():
            self._warn(value)
            return self._prepare(value, ablate), self._tag()
        key = (id(value), value._version, ablate)
        hit = self._kept.get(key)
        if hit is not None and hit[0] is value and _unchanged(value, hit[3]):
            return hit[1], hit[2]
        if len(self._kept) >= self.keep:
            del self._kept[next(iter(self._kept))]
        prepared, tag = self._prepare(value, ablate), self._tag()
        # A host vector can change without a new version (through ``.numpy()``).
        snapshot = value.clone() if value.device.type == "cpu" and prepared is not value else None
        self._kept[key] = (value, prepared, tag, snapshot)
        return prepared, tag

    def _tag(self) -> int:
        self._tags += 1
        return self._tags

    def _warn(self, value: torch.Tensor) -> None:
        if value.device.type == "cpu" and self.device.type != "cpu" and not self._warned:
            self._warned = True
            warnings.warn(
                f"edit values of shape {tuple(value.shape)} on the CPU are copied to "
                f"{self.device} every step (from pageable memory: the host waits); make "
                f"per-row edit values on the model's device",
                stacklevel=4,
            )

    def _prepare(self, value: torch.Tensor, ablate: bool) -> torch.Tensor:
        self.prepared += 1
        if ablate:
            d = value.float()
            value = d / d.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return value.to(device=self.device, dtype=self.dtype)


def _unchanged(value: torch.Tensor, snapshot: torch.Tensor | None) -> bool:
    return snapshot is None or torch.equal(value, snapshot)

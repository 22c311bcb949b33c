"""An edit tap's values on its device: a consumer's edit vector moved (or, for an ablation,
normalised) once, not every step.

A 1-D value (a steering vector, a direction) is prepared once and kept, by the tensor's
identity and version (an in-place change through torch makes it new; a host vector is also
compared with a copy of itself, so a write through ``.numpy()`` is seen too; a device vector
must be changed through torch operations, not ``.data`` or DLPack), so a consumer that plans the same
vector step after step costs no copy and no allocation after the first step. A 2-D value
(one row per edited row) is prepared every step: on a GPU a CPU one is copied from pageable
memory (the host waits) into a new tensor, so a consumer that plans per-row values should
make them on the model's device (a warning says so once). Inference tensors have no version:
they are prepared every step too, so make a vector when the consumer is built or under
``torch.inference_mode(False)`` (vLLM runs ``edit`` in inference mode). ``prepared`` counts
the values prepared (``benchmarks/edit_fake_step.py`` reports it per steady step).
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
        """``value`` on the device in the dtype (for an ablation: normalised first), and a
        tag: equal tags are the same prepared value (a new tag for every value not kept)."""
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
        # A host vector can change without a new version (written through ``.numpy()`` or a
        # shared numpy array): compared with a copy of itself (cheap, on the host) where the
        # prepared value is not the vector itself.
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
        # The same operations as before values were kept: the same values, bit for bit.
        self.prepared += 1
        if ablate:
            d = value.float()
            value = d / d.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return value.to(device=self.device, dtype=self.dtype)


def _unchanged(value: torch.Tensor, snapshot: torch.Tensor | None) -> bool:
    return snapshot is None or torch.equal(value, snapshot)

"""``beta_schedule: "fit"``: each row's beta scaled by how well its group's distiller
predicts, ``clamp(1 - e, 0, 1)`` of the group's recent relative error ``e``.

The errors live on the device, one per distiller slot, and are updated there: a guided step
reads nothing back (on CUDA a read would make the host wait for the GPU). A slot's error
starts at 1 when a new group takes it (told by the group's serial, host-side)."""

from __future__ import annotations

import torch

from algorithms.esamp.guidance import fit_scale
from algorithms.esamp.lifecycle import Group
from algorithms.esamp.shared import host_to
from tllm_core import Counters


class FitScale:
    def __init__(self, decay: float, counters: Counters):
        self.decay, self.counters = decay, counters
        self._err: torch.Tensor | None = None  # [slots] recent relative error
        self._serial: dict[int, int] = {}  # slot -> serial of the group whose error it holds
        self._n = 0
        self._sum = 0.0
        self._pending: torch.Tensor | None = None  # scale sums not yet read (device)

    def _errors(self, slots: list[int], groups: list[Group], device: torch.device) -> None:
        size = max(slots) + 1
        if self._err is None or self._err.shape[0] < size or self._err.device != device:
            grown = torch.ones(max(size, 8), device=device)
            if self._err is not None and self._err.device == device:
                grown[: self._err.shape[0]].copy_(self._err)
            self._err = grown
        fresh = sorted(
            {s for s, g in zip(slots, groups, strict=True) if self._serial.get(s) != g.serial}
        )
        if fresh:
            self._err.index_fill_(0, host_to(torch.tensor(fresh), device), 1.0)
            for s, g in zip(slots, groups, strict=True):
                self._serial[s] = g.serial

    def __call__(self, slots: list[int], groups: list[Group], rel: torch.Tensor) -> torch.Tensor:
        """Each row's factor from its group's error average *before* this step; then the
        averages updated with this step's finite errors (their mean per group)."""
        dev = rel.device
        self._errors(slots, groups, dev)
        err = self._err
        idx = host_to(torch.tensor(slots, dtype=torch.long), dev)
        scale = fit_scale(err.index_select(0, idx))
        finite = torch.isfinite(rel)
        sums = torch.zeros_like(err).index_add_(0, idx, torch.where(finite, rel.float(), 0.0))
        count = torch.zeros_like(err).index_add_(0, idx, finite.float())
        mean = sums / count.clamp(min=1.0)
        d = self.decay
        err.copy_(torch.where(count > 0, d * err + (1 - d) * mean, err))
        self._n += len(slots)
        self.counters.add("fit_rows", len(slots))
        total = scale.sum()
        self._pending = total if self._pending is None else self._pending + total
        return scale

    def read(self) -> None:
        """Count fit_scale_mean from the device sums (a host read: on CPU after each call,
        on CUDA where a sync is paid anyway)."""
        if self._pending is not None:
            self._sum += float(self._pending)
            self._pending = None
        if self._n:
            self.counters.set("fit_scale_mean", self._sum / self._n)

"""``beta_schedule: "fit"``: each row's beta scaled by how well its group's distiller
predicts, ``clamp(1 - e, 0, 1)`` of the group's recent relative error ``e``.

The errors live on the device, one per distiller slot, and are updated there: a guided step
reads nothing back (on CUDA a read would make the host wait for the GPU). A slot's error
starts at 1 when a new group takes it (told by the group's serial, host-side).

On CUDA (:meth:`FitScale.scale_into`) the same operations write into the guidance
workspace (:mod:`algorithms.esamp.guide_workspace`): the step allocates nothing."""

from __future__ import annotations

import torch

from algorithms.esamp.guidance import fit_scale
from algorithms.esamp.guide_workspace import GuideWorkspace
from algorithms.esamp.lifecycle import Group
from algorithms.esamp.shared import host_to
from tllm_core import Counters, DeviceSums


class FitScale:
    def __init__(self, decay: float, counters: Counters):
        self.decay, self.counters = decay, counters
        self._err: torch.Tensor | None = None  # [slots] recent relative error
        self._serial: dict[int, int] = {}  # slot -> serial of the group whose error it holds
        self._n = 0
        self._sum = 0.0
        self._pending: torch.Tensor | None = None  # scale sums not yet read (device)
        self._ws_sums: DeviceSums | None = None  # CUDA: the workspace's scale sum

    def fresh(self, slots: list[int], groups: list[Group]) -> list[int]:
        """The slots a new group has taken since their error was last set (host-side:
        their error restarts at 1); records the groups as seen."""
        fresh = sorted(
            {s for s, g in zip(slots, groups, strict=True) if self._serial.get(s) != g.serial}
        )
        for s, g in zip(slots, groups, strict=True):
            self._serial[s] = g.serial
        return fresh

    def _errors(self, slots: list[int], groups: list[Group], device: torch.device) -> None:
        size = max(slots) + 1
        if self._err is None or self._err.shape[0] < size or self._err.device != device:
            grown = torch.ones(max(size, 8), device=device)
            if self._err is not None and self._err.device == device:
                grown[: self._err.shape[0]].copy_(self._err)
            self._err = grown
        fresh = self.fresh(slots, groups)
        if fresh:
            self._err.index_fill_(0, host_to(torch.tensor(fresh), device), 1.0)

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

    def scale_into(
        self,
        ws: GuideWorkspace,
        slots: torch.Tensor,
        fresh: torch.Tensor,
        rel: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`__call__` on the device, every temporary a view of ``ws`` (its errors
        per slot included): ``slots`` (device, one per row) and ``fresh`` (device, from
        :meth:`fresh`) as staged by the workspace. The same operations, ``out=`` and in
        place, so the same values."""
        n, d = slots.numel(), self.decay
        err = ws.parts["err"]
        if fresh.numel():
            err.index_fill_(0, fresh, 1.0)
        scale = torch.index_select(err, 0, slots, out=ws.take("scale", n))
        scale.neg_().add_(1.0).clamp_(0.0, 1.0)  # fit_scale: (1 - e).clamp(0, 1)
        ok = torch.lt(
            torch.abs(rel, out=ws.take("fit_abs", n)), float("inf"), out=ws.take("fit_ok", n)
        )
        val = torch.where(ok, rel, ws.parts["zero"], out=ws.take("fit_val", n))
        sums = ws.parts["sums"].zero_().index_add_(0, slots, val)
        count = ws.parts["cnt"].zero_().index_add_(0, slots, ws.take("fit_okf", n).copy_(ok))
        mean = sums.div_(torch.clamp(count, min=1.0, out=ws.parts["upd"]))
        upd = torch.mul(err, d, out=ws.parts["upd"]).add_(mean.mul_(1 - d))
        torch.where(torch.gt(count, 0, out=ws.parts["smask"]), upd, err, out=err)
        self._n += n
        self.counters.add("fit_rows", n)
        pending = ws.parts["pending"]
        if self._ws_sums is None or self._ws_sums.values is not pending:
            self._ws_sums = DeviceSums(pending)
        self._ws_sums.add(torch.sum(scale, 0, out=ws.parts["total"]))
        return scale

    def read(self, wait: bool = True) -> None:
        """Count fit_scale_mean from the device sums (on CPU after each call). The CUDA
        path's sum goes to the host without waiting and is counted once there (``wait``:
        everything now, a host wait where a sync is paid anyway)."""
        if self._pending is not None and wait:
            self._sum += float(self._pending)
            self._pending = None
        if self._ws_sums is not None:
            self._ws_sums.send()
            for (total,) in self._ws_sums.arrived(wait):
                self._sum += total
        if self._n:
            self.counters.set("fit_scale_mean", self._sum / self._n)

"""``beta_schedule: "fit"``: each row's beta scaled by ``clamp(1 - e, 0, 1)`` of its group's
recent relative error ``e``, kept per slot on the device (a step reads nothing back)."""

from __future__ import annotations

import torch

from algorithms.esamp.guidance import fit_scale, take
from algorithms.esamp.guide_workspace import GuideWorkspace
from algorithms.esamp.lifecycle import Group
from tllm_core import Counters, DeviceSums


class FitScale:
    def __init__(
        self,
        decay: float,
        counters: Counters,
        device: torch.device,
        ws: GuideWorkspace | None = None,
    ):
        """``ws``: the CUDA guidance's workspace (else the errors grow with the slots)."""
        self.decay, self.counters, self.device, self.ws = decay, counters, device, ws
        # [slots] recent relative error
        self._err: torch.Tensor | None = None if ws is None else ws.parts["err"]
        self._serial: dict[int, int] = {}  # slot -> serial of the group whose error it holds
        self._n = 0
        self._sum = 0.0
        # The scales' sum, sent to the host without a wait.
        sums = torch.zeros((), device=device) if ws is None else ws.parts["pending"]
        self._sums = DeviceSums(sums)

    def fresh(self, slots: list[int], groups: list[Group]) -> list[int]:
        """The slots a new group has taken since their error was last set (it restarts at 1)."""
        if self.ws is None and (self._err is None or self._err.shape[0] <= max(slots)):
            grown = torch.ones(max(max(slots) + 1, 8), device=self.device)
            if self._err is not None:
                grown[: self._err.shape[0]].copy_(self._err)
            self._err = grown
        fresh = sorted(
            {s for s, g in zip(slots, groups, strict=True) if self._serial.get(s) != g.serial}
        )
        for s, g in zip(slots, groups, strict=True):
            self._serial[s] = g.serial
        return fresh

    def scale(self, slots: torch.Tensor, fresh: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
        """Each row's factor from its group's error *before* this step; then the averages
        updated with this step's finite errors."""
        ws, n, d, dev, f32 = self.ws, slots.numel(), self.decay, rel.device, torch.float32
        err = self._err
        if fresh.numel():
            err.index_fill_(0, fresh, 1.0)
        scale = torch.index_select(err, 0, slots, out=take(ws, "scale", (n,), f32, dev))
        fit_scale(scale, out=scale)
        ok = torch.lt(
            torch.abs(rel, out=take(ws, "fit_abs", (n,), f32, dev)),
            float("inf"),
            out=take(ws, "fit_ok", (n,), torch.bool, dev),
        )
        zero = torch.zeros((), device=dev) if ws is None else ws.parts["zero"]
        val = torch.where(ok, rel, zero, out=take(ws, "fit_val", (n,), f32, dev))
        shape = tuple(err.shape)
        sums = take(ws, "sums", shape, f32, dev).zero_().index_add_(0, slots, val)
        okf = take(ws, "fit_okf", (n,), f32, dev).copy_(ok)
        count = take(ws, "cnt", shape, f32, dev).zero_().index_add_(0, slots, okf)
        upd = take(ws, "upd", shape, f32, dev)
        mean = sums.div_(torch.clamp(count, min=1.0, out=upd))
        upd = torch.mul(err, d, out=upd).add_(mean.mul_(1 - d))
        has = torch.gt(count, 0, out=take(ws, "smask", shape, torch.bool, dev))
        torch.where(has, upd, err, out=err)
        self._n += n
        self.counters.add("fit_rows", n)
        self._sums.add(torch.sum(scale, 0, out=take(ws, "total", (), f32, dev)))
        return scale

    def read(self, wait: bool = True) -> None:
        """Count fit_scale_mean from the sums that reached the host (``wait``: all)."""
        self._sums.send()
        for (total,) in self._sums.arrived(wait):
            self._sum += total
        if self._n:
            self.counters.set("fit_scale_mean", self._sum / self._n)

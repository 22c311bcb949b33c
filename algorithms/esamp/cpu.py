"""The CPU grouped distiller: all groups of a step in one batched computation."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from algorithms.esamp.host_trainer import HostTrainer
from algorithms.esamp.mlp import Activations, forward_acts
from algorithms.esamp.packing import HostBatch, Packing, make_packing
from algorithms.esamp.params import block_weights
from algorithms.esamp.side_thread import SideThread
from algorithms.esamp.slots import SlotDistiller, TrainResult


class GroupedDistiller(SlotDistiller):
    """Slots of independent distillers, CPU path. With ``side_thread=True`` train steps and
    slot resets run in order on a side thread that readers wait for (strict staleness). A
    train step on the last prediction's rows and parameters reuses its forward."""

    def __init__(self, hidden_size: int, *, side_thread: bool = False, **kwargs: Any):
        device = torch.device(kwargs.get("device", "cpu"))
        if kwargs.get("moments_dtype", torch.float32) != torch.float32:
            raise ValueError("bfloat16 Adam moments are a CUDA option (cuda_adam_moments)")
        if device.type not in ("cpu", "meta"):  # meta: the front end's dry build
            raise ValueError(
                f"GroupedDistiller is the CPU path and got device {str(device)!r}; for a GPU "
                "use CudaGroupedDistiller (algorithms.esamp.factory.distiller_for picks it)"
            )
        # Set before the base class allocates the state (growth drains the side thread).
        self._side = SideThread("tllm-esamp-update") if side_thread else None
        # The last prediction: (version, slots [G], x fp32 [R, H], packed (f, activations)).
        self._saved: tuple[int, np.ndarray, torch.Tensor, tuple] | None = None
        super().__init__(hidden_size, **kwargs)
        self._host = HostTrainer(self.shape, self.hp)

    @property
    def asynchronous(self) -> bool:
        return self._side is not None

    def _wait_side(self) -> None:
        if self._side is not None:
            self._side.wait()  # bounded: SideThread.wait's default timeout

    def _drain(self) -> None:
        self._wait_side()

    def _ordered(self, change) -> None:
        self._side.submit(change) if self._side is not None else change()

    def close(self) -> None:
        """Finish pending work and stop the side thread (if any)."""
        if self._side is not None:
            self._side.wait()  # bounded: SideThread.wait's default timeout
            self._side.close()
            self._side = None

    # -- math -----------------------------------------------------------------------
    def predict(self, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        pk = make_packing(slots)
        if not pk.slots.size:
            return torch.zeros(0, self.shape.hidden_size, device=x.device)
        self._check_live(pk)
        self._wait_side()
        lag = self._submitted[pk.slots] - self.applied.numpy()[pk.slots]
        self._staleness_max = max(self._staleness_max, int(lag.max()))
        with torch.no_grad():
            # A copy: x may be a view of a capture buffer that the next step overwrites.
            x = x.to(torch.float32, copy=True)
            batch = HostBatch.plan(pk.slots)
            fwd = forward_acts(block_weights(batch.take(self.theta), self.shape), batch.pack(pk, x))
            self._saved = (self._version, pk.slots, x, fwd)
            return batch.unpack(pk, fwd[0])

    def _saved_forward(
        self, pk: Packing, x: torch.Tensor
    ) -> tuple[torch.Tensor, Activations] | None:
        """The last prediction's packed forward if it was on exactly these rows and parameters."""
        saved, self._saved = self._saved, None
        if saved is None:
            return None
        version, slots, x_saved, fwd = saved
        if (
            version != self._version
            or not np.array_equal(slots, pk.slots)
            or x.shape != x_saved.shape
            or not torch.equal(x.float(), x_saved)
        ):
            return None
        return fwd

    def _train(
        self, pk: Packing, x: torch.Tensor, target: torch.Tensor, row_errors: bool = False
    ) -> TrainResult:
        """One in-place update of all packed groups, inline or on the side thread; the
        results are filled when it has run."""
        forward = self._saved_forward(pk, x)
        self._version += 1
        errors = torch.full((x.shape[0],), float("nan")) if row_errors else None
        res = TrainResult.unfilled(pk, self.hp.stats, row_errors=errors)

        def run() -> None:
            state = (self.theta, self.m, self.v, self.step)
            batch = HostBatch.plan(pk.slots)
            loss, ok, st = self._host.step(state, pk, batch, x, target, forward, errors)
            self.applied[torch.from_numpy(pk.slots)] += 1
            res.losses.copy_(torch.tensor(loss))
            res.updated.copy_(torch.tensor(ok))
            if res.stats is not None:
                res.stats.copy_(st)
            res.done.set()

        self._ordered(run)
        return res

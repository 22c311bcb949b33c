"""The CPU grouped distiller: a step's groups in one batched computation, updated in place on
views of the state (``train_groups``' slot gathers were 2.7x slower at 8 x 16, hidden 576)."""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from algorithms.esamp import kernels
from algorithms.esamp.kernels.op_loss_dy import loss_per_row
from algorithms.esamp.mlp import Activations, backward_factors, forward_acts
from algorithms.esamp.params import CLIP_EPS, adam_stats, block_weights, fused_adam_
from algorithms.esamp.slots import Packing, SlotDistiller, TrainResult, make_packing
from tllm_core import allowed_cpus

log = logging.getLogger("tllm")

_STOP = object()
# Longest wait for the jobs: past it the engine thread fails (consumer switched off), not hangs.
WAIT_TIMEOUT_S = 300.0


def _widen_affinity() -> str:
    """Widen the calling thread to every allowed core (it inherits vLLM's pin); for the log."""
    try:  # Linux: the affinity of the calling thread only.
        os.sched_setaffinity(0, allowed_cpus())
        return f"cpus {sorted(os.sched_getaffinity(0))}"
    except (AttributeError, OSError):
        return "inherited affinity"


class SideThread:
    """The CUDA side stream's counterpart: ordered jobs on one normal-priority thread (they are
    on the next prediction's path) that readers wait for."""

    def __init__(self, name: str = "tllm-side"):
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job``; it runs after every job submitted before it."""
        self._raise()
        self._jobs.put(job)

    def wait(self, timeout: float = WAIT_TIMEOUT_S) -> None:
        """Block until every submitted job has run (at most ``timeout``); re-raise a job's error."""
        q = self._jobs
        with q.all_tasks_done:
            done = q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout)
        if not done:
            raise RuntimeError(
                f"side thread {self._thread.name!r} has not finished its jobs after "
                f"{timeout:.0f} s ({q.unfinished_tasks} still queued or running)"
            )
        self._raise()

    def close(self, timeout: float = WAIT_TIMEOUT_S) -> None:
        """Stop the thread after its queued jobs, waiting at most ``timeout`` seconds."""
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("tllm: side thread %r did not stop in %.0f s", self._thread.name, timeout)

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"side-thread job failed: {type(err).__name__}: {err}") from err

    def _loop(self) -> None:
        log.debug("tllm: side thread started (%s)", _widen_affinity())
        while True:
            # bounded: an idle worker; every wait on its jobs has a timeout (wait, close)
            job = self._jobs.get()
            try:
                if job is _STOP:
                    return
                if self._error is None:  # after a failure, skip until the owner has seen it
                    job()
            except BaseException as e:  # noqa: BLE001 - handed to the engine thread
                self._error = e
            finally:
                self._jobs.task_done()


@dataclass
class HostBatch:
    """A step's packed groups in the state: a slice of rows (views) when the slots fill a short
    range, else the slots (gathered); ``pos [G]``: each group's batch index."""

    rows: slice | torch.Tensor
    pos: np.ndarray
    size: int

    @classmethod
    def plan(cls, slots: np.ndarray) -> HostBatch:
        lo, hi = int(slots[0]), int(slots[-1]) + 1  # slots: sorted, unique
        if hi - lo <= 2 * len(slots):
            return cls(slice(lo, hi), slots - lo, hi - lo)
        return cls(torch.from_numpy(slots), np.arange(len(slots)), len(slots))

    def take(self, state: torch.Tensor) -> torch.Tensor:
        return (
            state[self.rows] if isinstance(self.rows, slice) else state.index_select(0, self.rows)
        )

    def pack(self, pk: Packing, x: torch.Tensor) -> torch.Tensor:
        """``x [R, H]`` -> zero-padded fp32 ``[size, max_rows, H]``."""
        xp = torch.zeros(self.size, pk.max_rows, x.shape[-1], device=x.device)
        xp[self._index(pk)] = x.float()
        return xp

    def unpack(self, pk: Packing, yp: torch.Tensor) -> torch.Tensor:
        return yp[self._index(pk)]

    def _index(self, pk: Packing) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(self.pos[pk.row_group]), torch.from_numpy(pk.row_pos)


class GroupedDistiller(SlotDistiller):
    """The CPU path; ``side_thread``: updates and slot resets run in order on a side thread
    that predictions wait for. An update of the last prediction's rows reuses its forward."""

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
        self._scratch = torch.empty(0)  # each weight's clipped gradients, for fused Adam
        # Per slot: its weight matrices in theta, m and v (flat, index 3 * block + matrix),
        # kept while the state tensors are the same storage (they change only on growth).
        self._views: dict[int, tuple[list[torch.Tensor], ...]] = {}
        self._views_key: tuple[int, ...] = ()

    @property
    def asynchronous(self) -> bool:
        return self._side is not None

    def _wait_side(self) -> None:  # what a prediction waits for (tests break it)
        if self._side is not None:
            self._side.wait()  # bounded: SideThread.wait's default timeout

    def _drain(self) -> None:
        self._wait_side()

    def _ordered(self, change) -> None:
        self._side.submit(change) if self._side is not None else change()

    def close(self) -> None:
        self._drain()
        if self._side is not None:
            self._side.close()
            self._side = None

    def predict(self, slots: torch.Tensor, x: torch.Tensor, rows_id: object = None) -> torch.Tensor:
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
            f = batch.unpack(pk, fwd[0])
            return f - x if self.zero_output else f

    def _saved_forward(
        self, pk: Packing, x: torch.Tensor
    ) -> tuple[torch.Tensor, Activations] | None:
        """The last prediction's packed forward if it was on exactly these rows and parameters."""
        saved, self._saved = self._saved, None
        if saved is None:
            return None
        version, slots, x_saved, fwd = saved
        same = version == self._version and np.array_equal(slots, pk.slots)
        return fwd if same and torch.equal(x.float(), x_saved) else None  # False on a shape change

    def _train(
        self, pk: Packing, x: torch.Tensor, target: torch.Tensor, rows_id: object, row_errors: bool
    ) -> TrainResult:
        """One in-place update of all packed groups (inline or queued), results filled after."""
        self._submitted[pk.slots] += 1
        # vLLM samples under inference mode: the state and results are made outside it.
        with torch.inference_mode(False):
            x, target = x.clone(), target.clone()
            forward = self._saved_forward(pk, x)
            if self.zero_output:
                target = target.float() + x.float()
            self._version += 1
            errors = torch.full((x.shape[0],), float("nan")) if row_errors else None
            res = TrainResult.unfilled(pk, self.hp.stats, row_errors=errors)

            def run() -> None:
                self._step(pk, x, target, forward, res)
                self.applied[torch.from_numpy(pk.slots)] += 1
                res.done.set()

            self._ordered(run)
            return res

    def _step(
        self,
        pk: Packing,
        x: torch.Tensor,
        target: torch.Tensor,
        forward: tuple[torch.Tensor, Activations] | None,
        res: TrainResult,
    ) -> None:
        """One update of each packed group, batched, into ``res`` (``forward``: if computed)."""
        m, v, step, shape, hp = self.m, self.v, self.step, self.shape, self.hp
        batch = HostBatch.plan(pk.slots)
        weights = block_weights(batch.take(self.theta), shape)
        if forward is None:
            forward = forward_acts(weights, batch.pack(pk, x))
        h, acts = forward
        pos = torch.from_numpy(batch.pos)
        # Batch entries that are no packed group: no slot, no rows (nothing read or updated).
        group_slot = torch.full((batch.size,), -1, dtype=torch.int64)
        group_slot[pos] = torch.from_numpy(pk.slots)
        mask = torch.zeros(batch.size, h.shape[1], dtype=torch.bool)
        mask[batch.pos[pk.row_group], pk.row_pos] = True
        loss_parts, dy = h.new_empty(batch.size, 1), torch.empty_like(h)
        tp = batch.pack(pk, target)
        kernels.loss_dy(h, tp, mask, loss_parts, dy, reduction=hp.loss_reduction)
        if res.row_errors is not None:  # each row's term of its group's loss, times its rows
            diff = batch.unpack(pk, h) - batch.unpack(pk, tp)
            per_row = loss_per_row(shape.hidden_size, hp.loss_reduction)
            res.row_errors.copy_(diff.square_().sum(-1).div_(per_row))
        factors, sq = backward_factors(weights, acts, dy)
        ok_b = torch.empty(batch.size, dtype=torch.bool)
        losses, coef, norm = (h.new_empty(batch.size) for _ in range(3))
        kernels.update_tail(
            loss_parts, sq[:, None], group_slot, mask, step, None, losses, ok_b, coef, norm,
            grad_clip=hp.grad_clip, clip_eps=CLIP_EPS,
        )  # fmt: skip
        ok = ok_b[pos].tolist()
        todo = [(int(batch.pos[gi]), int(slot)) for gi, slot in enumerate(pk.slots) if ok[gi]]
        if todo:
            self._update(factors, coef, todo, batch.size)
        res.losses.copy_(losses[pos])
        res.updated.copy_(ok_b[pos])
        done = [gi for gi, good in enumerate(ok) if good]
        if res.stats is not None and done:  # NaN where not updated (as unfilled)
            sl = torch.from_numpy(pk.slots[done])
            res.stats[done] = adam_stats(m[sl], v[sl], step[sl], norm[pos[done]], hp)

    def _update(self, factors, coef, todo, size) -> None:
        """Each weight's clipped gradient for all groups, then Adam on ``todo`` (index, slot)."""
        steps = [self.step[slot] for _, slot in todo]  # counted by update_tail
        rows = [self._slot_views(slot) for _, slot in todo]
        numel = self.shape.intermediate_size * self.shape.hidden_size
        if self._scratch.numel() < size * numel:
            self._scratch = torch.empty(size * numel)
        for f in factors:
            j = 3 * f[0] + f[1]
            grad = self._scratch[: size * numel].view(size, *rows[0][0][j].shape)
            # Each group's gradient A^T B times its clip coefficient (folded into A).
            torch.bmm((f[2] * coef[:, None, None]).transpose(1, 2), f[3], out=grad)
            ws, ms, vs = ([r[k][j] for r in rows] for k in range(3))  # theta, m, v
            fused_adam_(ws, [grad[i] for i, _ in todo], ms, vs, steps, self.hp)

    def _slot_views(self, slot: int) -> tuple[list[torch.Tensor], ...]:
        # Capacity only grows, so a row count names one allocation of the state.
        theta, m, v = self.theta, self.m, self.v
        key = (theta.data_ptr(), theta.shape[0], m.data_ptr(), v.data_ptr())
        if key != self._views_key:
            self._views, self._views_key = {}, key
        views = self._views.get(slot)
        if views is None:
            views = tuple(
                [w[0] for blk in block_weights(t[slot][None], self.shape) for w in blk]
                for t in (theta, m, v)
            )
            self._views[slot] = views
        return views

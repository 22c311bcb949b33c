"""Slots of independent distillers (base class; the math in ``cpu`` and ``cuda``): the stacked
state, the slot lifecycle, the staleness bookkeeping and the packing of a step's rows."""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from algorithms.esamp.params import STATS, AdamHyper, DistillerShape, init_params


@dataclass
class Packing:
    """Host-side plan mapping R rows onto ``[G, M]`` packed positions."""

    slots: np.ndarray  # int64 [G]: slot of each packed group (sorted, unique)
    row_group: np.ndarray  # int64 [R]: packed group of each row
    row_pos: np.ndarray  # int64 [R]: position of each row inside its group
    counts: np.ndarray  # int64 [G]
    max_rows: int


def make_packing(slots: torch.Tensor | np.ndarray) -> Packing:
    """Plan the per-group packing of rows; computed on the host so no device sync is needed."""
    s = slots.cpu().numpy() if isinstance(slots, torch.Tensor) else np.asarray(slots)
    s = s.astype(np.int64).reshape(-1)
    uniq, inv, counts = np.unique(s, return_inverse=True, return_counts=True)
    inv = inv.reshape(-1)
    order = np.argsort(inv, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    pos = np.empty_like(inv)
    pos[order] = np.arange(s.size, dtype=np.int64) - np.repeat(starts, counts)
    max_rows = int(counts.max()) if counts.size else 0
    return Packing(uniq, inv.astype(np.int64), pos, counts.astype(np.int64), max_rows)


@dataclass
class TrainResult:
    """Outcome of one train step. ``losses``/``updated`` stay on the device (no host sync)."""

    slots: np.ndarray  # int64 [G] (host)
    losses: torch.Tensor  # fp32 [G]: MSE of each group before the update
    updated: torch.Tensor  # bool [G]: False where the loss/grad was non-finite (skipped)
    # Set once the values are final (CPU side thread); None: final after synchronize().
    done: threading.Event | None = None
    counts: np.ndarray | None = None  # int64 [G] (host): rows of each group in the step
    stats: torch.Tensor | None = None  # fp32 [G, 4] with optimizer_stats (params.STATS)
    # fp32 [R] (host), train_step(row_errors=True): each row's loss term before the update
    row_errors: torch.Tensor | None = None

    def ready(self) -> bool:
        """True when ``losses``/``updated`` can be read without waiting."""
        return self.done is None or self.done.is_set()

    @classmethod
    def unfilled(cls, pk: Packing, stats: bool, **kw) -> TrainResult:
        """A result filled in when its queued update has run (NaN until then)."""
        n = len(pk.slots)
        nan = float("nan")
        st = torch.full((n, len(STATS)), nan) if stats else None
        return cls(pk.slots, torch.full((n,), nan), torch.zeros(n, dtype=torch.bool),
                   threading.Event(), counts=pk.counts, stats=st, **kw)  # fmt: skip


class SlotDistiller:
    """Stacked state of ``capacity`` distiller slots and their lifecycle. Staleness: a
    prediction compares ``_submitted`` (host) with ``applied`` (where updates run)."""

    growable = True  # False: alloc() never reallocates the state (fixed capacity)
    max_step_rows: int | None = None  # rows one train_step takes at most (None: any)
    graph_failures = 0  # CUDA only: update graphs whose capture failed
    eager_updates = 0  # CUDA only: update steps run without a captured graph
    updates_reusing_prediction = 0  # CUDA only: update runs on the prediction's forward

    def __init__(
        self,
        hidden_size: int,
        *,
        intermediate_size: int = 384,
        num_blocks: int = 2,
        lr: float = 4e-4,
        eps: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float | None = 0.5,
        loss_reduction: str = "mean",
        optimizer_stats: bool = False,
        init: str = "paper",
        seed: int = 0,
        capacity: int = 4,
        device: torch.device | str = "cpu",
        moments_dtype: torch.dtype = torch.float32,
        zero_output: bool = False,
    ):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.shape = DistillerShape(hidden_size, intermediate_size, num_blocks)
        self.hp = AdamHyper(lr, eps, tuple(betas), grad_clip, loss_reduction, optimizer_stats)
        self.moments_dtype = moments_dtype  # Adam's m and v (bf16: CUDA only, opt-in)
        self.zero_output = zero_output  # predict blocks(x) - x, trained toward target + x
        self.device = torch.device(device)
        self.template = init_params(self.shape, init, seed).to(self.device)
        self.capacity = self._staleness_max = 0
        self._free: list[int] = []
        self._live: set[int] = set()
        self._version = 0  # bumped by every change of the parameters (update, reset, growth)
        self._grow(capacity)  # allocates theta, m, v, step, applied, _submitted

    asynchronous = False  # True: train steps return before they have run

    def _drain(self) -> None:
        """Wait for pending work that uses the state (before it is reallocated)."""

    def _ordered(self, change: Callable[[], None]) -> None:
        """Apply a state change after every update queued before it."""
        change()

    def synchronize(self) -> None:
        self._drain()

    def poll(self) -> None:
        """Make results of finished updates ready without waiting (queued paths)."""

    def close(self) -> None:
        """Finish pending work and release helpers (threads, streams)."""
        self._drain()

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def live_slots(self) -> list[int]:
        return sorted(self._live)

    def _grow(self, new_capacity: int) -> None:
        """Reallocate the stacked state; new slots start from the template."""
        self._drain()  # pending jobs hold views of the old storage
        self._version += 1
        rows, p, dev, old = new_capacity, self.shape.num_params, self.device, self.capacity
        new = {
            "theta": self.template.expand(rows, p).clone(),
            "m": torch.zeros(rows, p, device=dev, dtype=self.moments_dtype),
            "v": torch.zeros(rows, p, device=dev, dtype=self.moments_dtype),
            "step": torch.zeros(rows, device=dev),
            "applied": torch.zeros(rows, dtype=torch.long, device=dev),
            "_submitted": np.zeros(rows, dtype=np.int64),
        }
        for name, t in new.items():
            if old:
                t[:old] = getattr(self, name)[:old]
            setattr(self, name, t)
        for s in range(old, new_capacity):
            heapq.heappush(self._free, s)
        self.capacity = new_capacity

    def alloc(self) -> int:
        """A fresh slot; doubles the capacity when all are live (fixed capacity: raises)."""
        if not self._free:
            if not self.growable:
                raise RuntimeError(
                    f"all {self.capacity} distiller slots are live and this distiller's "
                    "capacity is fixed"
                )
            with torch.inference_mode(False):  # else the state could not be trained in place
                self._grow(2 * self.capacity)
        slot = heapq.heappop(self._free)
        self._live.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Release ``slot``: its parameters go back to init and its Adam state to zero."""
        if slot not in self._live:
            raise ValueError(f"slot {slot} is not live (live: {self.live_slots})")

        def reset() -> None:
            self.theta[slot].copy_(self.template)
            for t in (self.m, self.v, self.step, self.applied):
                t[slot].zero_()

        self._version += 1
        self._submitted[slot] = 0
        self._ordered(reset)  # after the slot's pending updates, before any later use of it
        self._live.remove(slot)
        heapq.heappush(self._free, slot)

    def _check_live(self, pk: Packing) -> None:
        dead = [int(s) for s in pk.slots if int(s) not in self._live]
        if dead:
            raise ValueError(f"slots {dead} are not live (live: {self.live_slots})")

    def predict(self, slots: torch.Tensor, x: torch.Tensor, rows_id: object = None) -> torch.Tensor:
        """``f_slot(x)`` per row, fp32 ``[R, H]``; a same-``rows_id`` update may reuse it."""
        raise NotImplementedError

    def train_step(
        self,
        slots: torch.Tensor,
        x: torch.Tensor,
        target: torch.Tensor,
        rows_id: object = None,
        row_errors: bool = False,
    ) -> TrainResult:
        """One Adam step per group present (non-finite ones skipped), measuring ``row_errors``."""
        pk = make_packing(slots)
        if not pk.slots.size:
            empty = torch.zeros(0)
            return TrainResult(pk.slots, empty, empty.bool(), counts=pk.counts)
        self._check_live(pk)
        return self._train(pk, x, target, rows_id, row_errors)

    def _train(
        self, pk: Packing, x: torch.Tensor, target: torch.Tensor, rows_id: object, row_errors: bool
    ) -> TrainResult:
        raise NotImplementedError

    def staleness_max(self) -> int:
        """The largest lag of submitted over applied updates a prediction saw (0: strict)."""
        return self._staleness_max

    def memory_bytes_per_group(self) -> int:
        """Parameters + Adam moments + step counter of one slot, in bytes."""
        return self.shape.num_params * (4 + 2 * self.moments_dtype.itemsize) + 4

    def memory_bytes(self) -> int:
        """Bytes held by the stacked state (all slots, live or not) plus the template."""
        return self.capacity * self.memory_bytes_per_group() + self.shape.num_params * 4

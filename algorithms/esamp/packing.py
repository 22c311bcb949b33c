"""Packing a step's rows per group into ``[G, M, H]`` (zero-padded), planned on the host."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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
class HostBatch:
    """Where the packed groups of one step live in the stacked state (CPU path): a slice of
    rows (weights are views) when the slots fill a short range, else the slots (gathered);
    ``pos [G]``: each group's batch index (other entries get zero rows, never updated)."""

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

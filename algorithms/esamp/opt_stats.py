"""ESamp's optimizer statistics (``optimizer_stats``): the per-update measurements of the
update code (:func:`algorithms.esamp.adam.adam_stats`), read back with the losses, turned
into counters and a curve by a group's step index."""

from __future__ import annotations

from typing import Any

import numpy as np

from algorithms.esamp.adam import STATS
from tllm_core import Counters

_CURVE_POINTS = 64
_K = len(STATS)  # clipped, eps share, update size, gradient norm


class OptStats:
    def __init__(self, counters: Counters):
        self.counters = counters
        # Per step index within a group: the sums of the STATS columns, then the updates.
        self._by_age: list[list[float]] = []
        self._tot = [0.0] * (_K + 1)

    def add(self, age: int, row: list[float]) -> None:
        """One decode update's statistics (a row in :data:`STATS` order)."""
        while len(self._by_age) <= age:
            self._by_age.append([0.0] * (_K + 1))
        for acc in (self._by_age[age], self._tot):
            for i in range(_K):
                acc[i] += row[i]
            acc[_K] += 1

    def publish(self) -> None:
        """Set the counters from everything measured so far."""
        clipped, share, size, norm, n = self._tot
        if not n:
            return
        self.counters.set("optimizer_updates_measured", n)
        self.counters.set("optimizer_clipped_updates", int(clipped))
        self.counters.set("optimizer_clip_rate", clipped / n)
        self.counters.set("optimizer_eps_share", share / n)
        self.counters.set("optimizer_update_size", size / n)
        self.counters.set("optimizer_grad_norm", norm / n)

    def summary(self) -> dict[str, Any]:
        """``optimizer_curve``: [step index, clip rate, eps share, update size, gradient norm,
        updates] for at most 64 step indices (empty without ``optimizer_stats``)."""
        ages = [a for a, acc in enumerate(self._by_age) if acc[_K]]
        if len(ages) > _CURVE_POINTS:
            picks = np.unique(np.linspace(0, len(ages) - 1, _CURVE_POINTS).round().astype(int))
            ages = [ages[i] for i in picks]
        curve = []
        for a in ages:
            acc = self._by_age[a]
            curve.append([a, *(x / acc[_K] for x in acc[:_K]), acc[_K]])
        return {"optimizer_curve": curve}

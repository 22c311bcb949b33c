"""ESamp's optimizer statistics (``optimizer_stats``): the per-update measurements of the
update code (:func:`algorithms.esamp.adam.adam_stats`), read back with the losses, turned
into counters and a curve by a group's step index."""

from __future__ import annotations

from typing import Any

import numpy as np

from tllm_core.counters import Counters

_CURVE_POINTS = 64


class OptStats:
    def __init__(self, counters: Counters):
        self.counters = counters
        # Per step index within a group: [clipped, eps share, update size, updates].
        self._by_age: list[list[float]] = []
        self._tot = [0.0, 0.0, 0.0, 0]

    def add(self, age: int, row: list[float]) -> None:
        """One decode update's statistics ``(clipped, eps_share, update_size)``."""
        while len(self._by_age) <= age:
            self._by_age.append([0.0, 0.0, 0.0, 0])
        for acc in (self._by_age[age], self._tot):
            for i in range(3):
                acc[i] += row[i]
            acc[3] += 1

    def publish(self) -> None:
        """Set the counters from everything measured so far."""
        clipped, share, size, n = self._tot
        if not n:
            return
        self.counters.set("optimizer_updates_measured", n)
        self.counters.set("optimizer_clipped_updates", int(clipped))
        self.counters.set("optimizer_clip_rate", clipped / n)
        self.counters.set("optimizer_eps_share", share / n)
        self.counters.set("optimizer_update_size", size / n)

    def summary(self) -> dict[str, Any]:
        """``optimizer_curve``: [step index, clip rate, eps share, update size, updates] for at
        most 64 step indices (empty without ``optimizer_stats``)."""
        ages = [a for a, acc in enumerate(self._by_age) if acc[3]]
        if len(ages) > _CURVE_POINTS:
            picks = np.unique(np.linspace(0, len(ages) - 1, _CURVE_POINTS).round().astype(int))
            ages = [ages[i] for i in picks]
        curve = []
        for a in ages:
            c, s, z, n = self._by_age[a]
            curve.append([a, c / n, s / n, z / n, n])
        return {"optimizer_curve": curve}

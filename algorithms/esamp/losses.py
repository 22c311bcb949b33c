"""ESamp's loss bookkeeping: read-back train results turned into the loss counters and
curves (and with ``optimizer_stats`` the update statistics)."""

from __future__ import annotations

from typing import Any

import numpy as np

from algorithms.esamp.adam import STATS
from algorithms.esamp.slots import TrainResult
from tllm_core import Counters

_CURVE_POINTS = 64
_K = len(STATS)  # clipped, eps share, update size, gradient norm

# One submitted train step: the groups' serials and ages (steps before it), its result.
Submitted = tuple[list[int], list[int], TrainResult]


def _curve_ages(counts: list[float]) -> list[int]:
    """The step indices with data (``counts[a] > 0``), at most 64 spread evenly."""
    ages = [a for a, n in enumerate(counts) if n]
    if len(ages) > _CURVE_POINTS:
        picks = np.unique(np.linspace(0, len(ages) - 1, _CURVE_POINTS).round().astype(int))
        ages = [ages[i] for i in picks]
    return ages


def final_prefix(results: list[TrainResult], block: bool) -> int:
    """How many results, oldest first, can be read now (``block``: all, after a sync)."""
    n = 0
    while n < len(results) and (block or results[n].ready()):
        n += 1
    return n


class OptStats:
    """``optimizer_stats``: the update statistics read back with the losses."""

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
        updates] for at most 64 step indices."""
        curve = []
        for a in _curve_ages([acc[_K] for acc in self._by_age]):
            acc = self._by_age[a]
            curve.append([a, *(x / acc[_K] for x in acc[:_K]), acc[_K]])
        return {"optimizer_curve": curve}


class LossBook:
    def __init__(self, counters: Counters):
        self.counters = counters
        self.opt = OptStats(counters)
        self._sum, self._n = 0.0, 0
        self._first: float | None = None
        self._last: float | None = None
        self._age_sum: list[float] = []
        self._age_n: list[int] = []
        # Per-group first and last losses, as sums over every group so far (a server runs
        # for ever: a last loss is kept only for groups that may still report one).
        self._group_last: dict[int, float] = {}  # serial -> last loss
        self._freed: set[int] = set()  # freed groups whose losses may still be read back
        self._gfirst_sum = self._glast_sum = 0.0
        self._g_n = 0

    def add(self, ready: list[Submitted]) -> None:
        """Count final train steps: a group's update whose loss was non-finite did not run."""
        steps = bad = rows = train_steps = 0
        for serials, ages, res in ready:
            losses = res.losses.cpu().tolist()
            ok = res.updated.cpu().tolist()
            counts = res.counts.tolist()
            stats = res.stats.cpu().tolist() if res.stats is not None else None
            train_steps += any(ok)
            for i, (serial, age, loss, good, n) in enumerate(
                zip(serials, ages, losses, ok, counts, strict=True)
            ):
                if not good:
                    bad += 1
                    continue
                steps += 1
                rows += n
                self._add_loss(serial, age, loss)
                if stats is not None:
                    self.opt.add(age, stats[i])
        self.opt.publish()
        self.counters.add("optimizer_steps", steps)
        self.counters.add("rows_trained", rows)
        self.counters.add("decode_steps", train_steps)
        self.counters.add("nonfinite_losses_skipped", bad)
        if self._n:
            self.counters.set("loss_first", self._first)
            self.counters.set("loss_last", self._last)
            self.counters.set("loss_mean", self._sum / self._n)

    def _add_loss(self, serial: int, age: int, loss: float) -> None:
        self._sum += loss
        self._n += 1
        if self._first is None:
            self._first = loss
        self._last = loss
        while len(self._age_sum) <= age:
            self._age_sum.append(0.0)
            self._age_n.append(0)
        self._age_sum[age] += loss
        self._age_n[age] += 1
        last = self._group_last.get(serial)
        if last is None:  # the group's first loss
            self._g_n += 1
            self._gfirst_sum += loss
            self._glast_sum += loss
        else:
            self._glast_sum += loss - last
        self._group_last[serial] = loss

    def freed(self, serial: int) -> None:
        """Group ``serial`` will train no more (its last losses may still be in flight)."""
        self._freed.add(serial)

    def prune(self, waiting: set[int]) -> None:
        """Forget the last loss of freed groups with no submitted update still ``waiting``."""
        for s in self._freed - waiting:
            self._group_last.pop(s, None)
            self._freed.discard(s)

    def _curve(self) -> list[list[float]]:
        """Mean loss by a group's optimizer step index (its learning curve), <= 64 points."""
        ages = _curve_ages(self._age_n)
        return [[a, self._age_sum[a] / self._age_n[a], self._age_n[a]] for a in ages]

    def summary(self) -> dict[str, Any]:
        return {
            "loss_first": self._first,
            "loss_last": self._last,
            "loss_mean": self._sum / self._n if self._n else None,
            "group_loss_first_mean": self._gfirst_sum / self._g_n if self._g_n else None,
            "group_loss_last_mean": self._glast_sum / self._g_n if self._g_n else None,
            # [step index within a group, mean loss over groups, number of groups]
            "loss_curve": self._curve(),
            **self.opt.summary(),
        }

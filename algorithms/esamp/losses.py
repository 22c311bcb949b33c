"""ESamp's loss bookkeeping: read-back train results turned into the loss counters and
curves (and with ``optimizer_stats`` the update statistics)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from algorithms.esamp.slots import TrainResult
from tllm_core import Counters

_CURVE_POINTS = 64
T = TypeVar("T")

# One submitted train step: the groups' serials and ages (steps before it), its result.
Submitted = tuple[list[int], list[int], TrainResult]


class ByAge:
    """Per step index within a group: the sums of some values and how many were added."""

    def __init__(self) -> None:
        self.sums: list[list[float]] = []
        self.counts: list[int] = []

    def add(self, age: int, values: list[float]) -> None:
        while len(self.counts) <= age:
            self.sums.append([0.0] * len(values))
            self.counts.append(0)
        self.sums[age] = [s + v for s, v in zip(self.sums[age], values, strict=True)]
        self.counts[age] += 1

    def curve(self, points: int | None = _CURVE_POINTS) -> list[list[float]]:
        """``[step index, the means, count]`` per index with data (at most ``points``, evenly)."""
        ages = [a for a, n in enumerate(self.counts) if n]
        if points is not None and len(ages) > points:
            picks = np.unique(np.linspace(0, len(ages) - 1, points).round().astype(int))
            ages = [ages[i] for i in picks]
        return [[a, *(s / self.counts[a] for s in self.sums[a]), self.counts[a]] for a in ages]


def split_final(items: list[T], block: bool, result: Callable[[T], TrainResult]) -> tuple:
    """``items`` (oldest first) whose ``result`` can be read now (``block``: all, after a
    sync), and the rest."""
    n = 0
    while n < len(items) and (block or result(items[n]).ready()):
        n += 1
    return items[:n], items[n:]


class LossBook:
    def __init__(self, counters: Counters):
        self.counters = counters
        # optimizer_stats: each decode update's statistics (rows in STATS order), by step
        # index and in total (all at index 0).
        self._opt_by_age, self._opt_total = ByAge(), ByAge()
        self._sum, self._n = 0.0, 0
        self._first: float | None = None
        self._last: float | None = None
        self._by_age = ByAge()
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
                    self._opt_by_age.add(age, stats[i])
                    self._opt_total.add(0, stats[i])
        if self._opt_total.counts:
            (clipped, share, size, norm), n = self._opt_total.sums[0], self._opt_total.counts[0]
            self.counters.set("optimizer_updates_measured", n)
            self.counters.set("optimizer_clipped_updates", int(clipped))
            self.counters.set("optimizer_clip_rate", clipped / n)
            self.counters.set("optimizer_eps_share", share / n)
            self.counters.set("optimizer_update_size", size / n)
            self.counters.set("optimizer_grad_norm", norm / n)
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
        self._by_age.add(age, [loss])
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

    def summary(self) -> dict[str, Any]:
        return {
            "loss_first": self._first,
            "loss_last": self._last,
            "loss_mean": self._sum / self._n if self._n else None,
            "group_loss_first_mean": self._gfirst_sum / self._g_n if self._g_n else None,
            "group_loss_last_mean": self._glast_sum / self._g_n if self._g_n else None,
            # [step index within a group, mean loss over groups, number of groups]
            "loss_curve": self._by_age.curve(),
            # [step index, clip rate, eps share, update size, gradient norm, updates]
            "optimizer_curve": self._opt_by_age.curve(),
        }

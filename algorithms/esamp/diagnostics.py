"""ESamp's opt-in diagnostics: per mixed row, how far the guidance moved the candidates; the
prediction's relative error by a group's step index."""

from __future__ import annotations

import math
from typing import Any

import torch

from algorithms.esamp.training import ByAge
from tllm_core import Counters, HostCopyRing

_DIAG_CAP = 50000  # records kept (the counters go on counting)
# A guided row's values, in order (a DeviceRecords ring row; CudaGuide writes them).
RING_COLUMNS = ("rel_err", "candidates", "top_ref", "top_new", "tv", "beta")
_INT_COLUMNS = ("candidates", "top_ref", "top_new")


class Diagnostics:
    def __init__(self, counters: Counters):
        self.counters = counters
        self._diag: dict[str, list] = {k: [] for k in ("age", *RING_COLUMNS)}
        self._err_age = ByAge()

    def record_error(self, ages: list[int], rel: torch.Tensor | list[float]) -> None:
        """The prediction's relative error by the group's step index."""
        rel = rel.cpu().tolist() if isinstance(rel, torch.Tensor) else rel
        for age, e in zip(ages, rel, strict=True):
            if math.isfinite(e):
                self._err_age.add(age, [e])

    def add_shift(self, ages: list[int], values: list[list[float]]) -> None:
        """Records of guided rows whose candidate shift was measured (:data:`RING_COLUMNS`):
        those with candidates are kept (up to the cap) and counted."""
        cols = {
            "age": ages,
            **{name: [r[j] for r in values] for j, name in enumerate(RING_COLUMNS)},
        }
        for name in _INT_COLUMNS:
            cols[name] = [int(v) for v in cols[name]]
        rows = [i for i, c in enumerate(cols["candidates"]) if c > 0]
        self.counters.add("diag_rows", len(rows))
        self.counters.add(
            "diag_top_changed", sum(cols["top_ref"][i] != cols["top_new"][i] for i in rows)
        )
        room = _DIAG_CAP - len(self._diag["age"])
        for k, v in cols.items():
            self._diag[k].extend([v[i] for i in rows[: max(room, 0)]])

    def as_result(self) -> dict[str, Any]:
        return {
            **self._diag,
            # [group step index, mean relative error, rows]
            "rel_err_curve": self._err_age.curve(points=None),
        }


class DeviceRecords:
    """CUDA: each guided step's per-row values in a device ring used in two halves; a full
    half is copied to the host without a wait while the steps go on in the other."""

    def __init__(self, diagnostics: Diagnostics, ring: torch.Tensor):
        self.diagnostics = diagnostics
        half = max(ring.shape[0] // 2, 1)
        self._halves = [ring[:half], ring[half : 2 * half]]
        self._copies = HostCopyRing(self._halves[0], 2)
        self._cur = 0
        self._steps: list[tuple[list[int], bool]] = []  # per row of the current half
        self.halves_sent = 0

    @property
    def waits(self) -> int:
        """Steps that waited for a half's copy (a host wait each; not expected)."""
        return self._copies.waits

    def begin(self, ages: list[int], shift: bool) -> torch.Tensor:
        """The ring row of a guided step (``shift``: its candidate columns are written)."""
        self._hand_arrived(wait=False)
        if len(self._steps) == self._halves[self._cur].shape[0]:
            # Copy the full half to the host (no waiting) and go on in the other.
            if self._copies.full:  # both host buffers hold copies not yet handed over
                self._hand_arrived(wait=True)
            self._copies.send(self._halves[self._cur], tag=self._steps)
            self.halves_sent += 1
            self._steps = []
            self._cur = 1 - self._cur
        self._steps.append((ages, shift))
        return self._halves[self._cur][len(self._steps) - 1]

    def _hand_arrived(self, wait: bool) -> None:
        """Hand the copies that have arrived to the diagnostics, in order (``wait``: all)."""
        for steps, values in self._copies.arrived(wait):
            self._hand(steps, values)

    def read(self) -> None:
        """Hand every step recorded so far to the diagnostics (a host read)."""
        self._hand_arrived(wait=True)
        if self._steps:
            self._hand(self._steps, self._halves[self._cur][: len(self._steps)].tolist())
            self._steps = []

    def _hand(self, steps: list[tuple[list[int], bool]], values: list) -> None:
        for (ages, shift), rows in zip(steps, values, strict=False):
            rows = rows[: len(ages)]
            self.diagnostics.record_error(ages, [r[0] for r in rows])
            if shift:
                self.diagnostics.add_shift(ages, rows)

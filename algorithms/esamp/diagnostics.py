"""ESamp's opt-in diagnostics (``ESampConfig.diagnostics``): per mixed row, how far the
guidance moved the candidates; the prediction's relative error by a group's step index."""

from __future__ import annotations

import math
from typing import Any

import torch

from algorithms.esamp.guidance import candidate_shift
from tllm_core import Counters

_DIAG_CAP = 50000  # records kept (the counters go on counting)
_DIAG_FIELDS = ("age", "rel_err", "candidates", "top_ref", "top_new", "tv", "beta")


class Diagnostics:
    def __init__(self, counters: Counters):
        self.counters = counters
        self._diag: dict[str, list] = {k: [] for k in _DIAG_FIELDS}
        self._err_age: list[list[float]] = []  # per group step index: [sum, count]

    def record_error(self, ages: list[int], rel: torch.Tensor) -> None:
        """The prediction's relative error by the group's step index."""
        for age, e in zip(ages, rel.cpu().tolist(), strict=True):
            while len(self._err_age) <= age:
                self._err_age.append([0.0, 0])
            if math.isfinite(e):
                self._err_age[age][0] += e
                self._err_age[age][1] += 1

    def record_shift(
        self,
        ages: list[int],
        rel: torch.Tensor,
        tokens: torch.Tensor,
        ref: torch.Tensor,
        new: torch.Tensor,
        p: torch.Tensor,
        betas: torch.Tensor,
    ) -> None:
        """One record per mixed row with candidates: ``tokens``/``ref``/``new`` are the
        candidates' ids and logits before and after, ``p`` their row's position in
        ``ages``."""
        n = len(ages)
        tv, top_ref, top_new, count = candidate_shift(p, tokens, ref, new, n)
        has = (count > 0).cpu().tolist()
        cols = {
            "age": ages,
            "rel_err": rel.cpu().tolist(),
            "candidates": count.cpu().tolist(),
            "top_ref": top_ref.cpu().tolist(),
            "top_new": top_new.cpu().tolist(),
            "tv": tv.cpu().tolist(),
            "beta": betas.cpu().tolist(),
        }
        rows = [i for i in range(n) if has[i]]
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
            "rel_err_curve": [[a, s / n, n] for a, (s, n) in enumerate(self._err_age) if n],
        }

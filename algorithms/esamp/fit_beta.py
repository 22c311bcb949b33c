"""``beta_schedule: "fit"``: each row's beta scaled by how well its group's distiller
predicts, ``clamp(1 - e, 0, 1)`` of the group's recent relative error ``e``."""

from __future__ import annotations

import math

import numpy as np
import torch

from algorithms.esamp.guidance import fit_scale
from algorithms.esamp.lifecycle import Group
from tllm_core import Counters


class FitScale:
    def __init__(self, decay: float, counters: Counters):
        self.decay, self.counters = decay, counters
        self._n, self._sum = 0, 0.0

    def __call__(self, groups: list[Group], rel: torch.Tensor) -> torch.Tensor:
        """Each row's factor from its group's error average *before* this step; then the
        averages updated with this step's finite errors."""
        errs = rel.cpu().tolist()
        scale = fit_scale(torch.tensor([g.fit_err for g in groups], dtype=torch.float32))
        d = self.decay
        step: dict[int, list[float]] = {}
        for g, e in zip(groups, errs, strict=True):
            if math.isfinite(e):
                step.setdefault(id(g), []).append(e)
        for g in {id(g): g for g in groups}.values():
            if id(g) in step:
                g.fit_err = d * g.fit_err + (1 - d) * float(np.mean(step[id(g)]))
        self._n += len(errs)
        self._sum += float(scale.sum())
        self.counters.add("fit_rows", len(errs))
        self.counters.set("fit_scale_mean", self._sum / self._n)
        return scale

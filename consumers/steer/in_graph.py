"""steer's edits that depend on the row's own value (a clamp, a probe gate), run inside the
forward as the transform of ``Edit(HiddenStates(layer))``: tensor operations on buffers made at
construction, so they trace into vLLM's compiled graph and read nothing back per step."""

from __future__ import annotations

import torch
from torch import nn


class SteerTransform(nn.Module):
    """One vector's ``add`` (already scaled), ``ablate`` or ``clamp`` at a layer, optionally
    gated by ``s . probe > threshold`` (``above=False``: ``<``); ``gated`` counts the rows it
    edited, on the device."""

    def __init__(
        self,
        vector: torch.Tensor,
        mode: str,
        *,
        lo: float | None = None,
        hi: float | None = None,
        target: float | None = None,
        probe: torch.Tensor | None = None,
        threshold: float = 0.0,
        above: bool = True,
    ) -> None:
        super().__init__()
        v = vector.float()
        self.mode = mode
        self.lo, self.hi, self.target = lo, hi, target
        self.threshold, self.above = float(threshold), bool(above)
        self.register_buffer("vector", v if mode == "add" else v / v.norm())
        self.register_buffer("probe", None if probe is None else probe.float().to(v.device))
        self.register_buffer("gated", torch.zeros(1, dtype=torch.int64, device=v.device))

    def edited(self, x: torch.Tensor) -> torch.Tensor:
        """The edit on float32 rows ``x`` ``[n, H]``, ungated (the reference of the math)."""
        if self.mode == "add":
            return x + self.vector
        u = self.vector
        p = x @ u
        if self.mode == "ablate":
            return x - p[:, None] * u
        if self.target is not None:
            q = torch.full_like(p, self.target)
        else:
            q = torch.clamp(p, min=self.lo, max=self.hi)
        return x + (q - p)[:, None] * u

    def fires(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, 1]`` bool: rows where the gate fires (all rows without a gate)."""
        if self.probe is None:
            return torch.ones(x.shape[0], 1, dtype=torch.bool, device=x.device)
        score = x @ self.probe
        hit = score > self.threshold if self.above else score < self.threshold
        return hit[:, None]

    def forward(self, s: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        x = s.float()
        fire = self.fires(x) & rows
        self.gated.add_(fire.sum())
        return torch.where(fire, self.edited(x), x).to(s.dtype)

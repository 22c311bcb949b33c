"""Decoder-layer wrappers that capture and edit the residual stream, graph-safely.

They are installed right after ``load_model`` and before the first forward, so
vLLM's compiler traces them in. Inside traced code only tensor operations on
preallocated buffers happen (no Python side effects, no allocation that depends on
host state): values written into the edit buffers before a step change that step's
forward without recompilation, and the same holds under CUDA graphs.
"""

from __future__ import annotations

import torch
from torch import nn

from tllm_core.bundles import EditPlan


class EditBuffers:
    """Per-row edit state of one layer: ``s' = keep·s + add − (s·u)u`` on masked rows."""

    def __init__(self, max_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device):
        self.mask = torch.zeros(max_tokens, 1, dtype=torch.bool, device=device)
        self.keep = torch.ones(max_tokens, 1, dtype=dtype, device=device)
        self.add = torch.zeros(max_tokens, hidden, dtype=dtype, device=device)
        self.dir = torch.zeros(max_tokens, hidden, dtype=dtype, device=device)
        self._dirty = 0  # rows [0, dirty) may hold non-identity values

    def reset(self) -> None:
        n = self._dirty
        if n:
            self.mask[:n].fill_(False)
            self.keep[:n].fill_(1)
            self.add[:n].zero_()
            self.dir[:n].zero_()
            self._dirty = 0

    def apply(self, layer: int, plans: list[EditPlan]) -> int:
        """Write the plans' ops for ``layer``; returns rows selected."""
        selected = torch.zeros(self.mask.shape[0], dtype=torch.bool)
        dev = self.add.device
        for plan in plans:
            for rows, kind, value in plan.ops.get(layer, []):
                idx = torch.from_numpy(rows).to(dev)
                v = value.to(device=dev, dtype=self.add.dtype)
                if kind == "add":
                    self.add[idx] += v
                elif kind == "replace":
                    self.keep[idx] = 0
                    self.dir[idx] = 0
                    self.add[idx] = v if v.dim() == 2 else v.expand(len(rows), -1)
                elif kind == "ablate":
                    self.dir[idx] = v if v.dim() == 2 else v.expand(len(rows), -1)
                self.mask[idx] = True
                selected[torch.from_numpy(rows)] = True
                self._dirty = max(self._dirty, int(rows.max()) + 1)
        return int(selected.sum())


class LayerTap(nn.Module):
    """Wraps one decoder layer (``(positions, h, residual) -> (h, residual)``).

    The residual stream after the layer is ``h + residual``.
    """

    def __init__(
        self,
        layer: nn.Module,
        capture: torch.Tensor | None,
        edit: EditBuffers | None,
    ):
        super().__init__()
        self.inner = layer
        self.capture = capture
        self.edit = edit

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        h, r = out
        n = h.shape[0]
        if self.edit is not None:
            e = self.edit
            s = h + r
            u = e.dir[:n]
            edited = s * e.keep[:n] + e.add[:n] - (s * u).sum(-1, keepdim=True) * u - r
            # torch.where keeps unselected rows bit for bit.
            h = torch.where(e.mask[:n], edited, h)
        if self.capture is not None:
            # Copy now: on GPU the next layer's fused add-norm overwrites h and r in place.
            self.capture[:n].copy_(h + r)
        return h, r

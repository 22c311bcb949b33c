"""The distiller's loss, defined once for both update paths (the CPU host trainer and the
graph-capturable update): a group's summed squared error ``sum ||f(x) - target||^2`` over
its rows, divided by :func:`loss_denominator`."""

from __future__ import annotations

from typing import Literal

import torch

LossReduction = Literal["mean", "sum"]


def loss_denominator(rows: torch.Tensor, hidden_size: int, reduction: str) -> torch.Tensor:
    """What each group's summed squared error is divided by (fp32, at least 1).

    ``rows``: each group's row count. ``"mean"``: rows x hidden size (the mean over rows and
    hidden dims, as ``F.mse_loss``); ``"sum"``: rows (the paper's loss: summed over hidden
    dims, averaged over rows), so loss and gradient are ``hidden_size`` times the mean's.
    """
    return (rows.to(torch.float32) * loss_per_row(hidden_size, reduction)).clamp_min(1.0)


def loss_per_row(hidden_size: int, reduction: str) -> float:
    """What each row adds to :func:`loss_denominator` (the Triton loss kernel's scalar)."""
    if reduction == "mean":
        return float(hidden_size)
    if reduction == "sum":
        return 1.0
    raise ValueError(f"loss reduction must be 'mean' or 'sum', got {reduction!r}")

"""The op ``tllm_esamp::loss_dy``: each group's loss (in parts) and its gradient with respect
to ``h``, in one pass; and the loss's denominator rule, defined once for every update path
(the CPU trainer, the update graph, the Triton kernel)."""

from __future__ import annotations

import torch

from algorithms.esamp.kernels.checks import FP32, _expect, _fp32, _same_device
from algorithms.esamp.kernels.launch import Launch, bool_bytes, cdiv, runner
from tllm_core import pow2_rows


def loss_denominator(rows: torch.Tensor, hidden_size: int, reduction: str) -> torch.Tensor:
    """What each group's summed squared error is divided by (fp32, at least 1): rows x
    hidden size for ``"mean"`` (``F.mse_loss``), rows for ``"sum"`` (the paper's loss)."""
    return (rows.to(torch.float32) * loss_per_row(hidden_size, reduction)).clamp_min(1.0)


def loss_per_row(hidden_size: int, reduction: str) -> float:
    """What each row adds to :func:`loss_denominator` (the Triton kernel's scalar)."""
    if reduction == "mean":
        return float(hidden_size)
    if reduction == "sum":
        return 1.0
    raise ValueError(f"loss reduction must be 'mean' or 'sum', got {reduction!r}")


SCHEMA = (
    "loss_dy(Tensor h, Tensor tp, Tensor mask, Tensor(a!) parts, Tensor(b!) dy, "
    "str reduction) -> ()"
)


def loss_dy(
    h: torch.Tensor,
    tp: torch.Tensor,
    mask: torch.Tensor,
    parts: torch.Tensor,
    dy: torch.Tensor,
    *,
    reduction: str = "mean",
) -> None:
    """Each group's loss (in parts) and its gradient with respect to ``h``, in one pass.
    ``h``, ``tp``, ``dy`` ``[G, M, H]`` fp32, ``mask [G, M]`` bool, ``parts [G, L]`` fp32.
    With ``diff = h - tp`` on marked rows (else 0) and ``denom`` (:func:`loss_denominator`):
    ``parts[g]`` sums to ``sum(diff[g]^2) / denom`` and ``dy[g] = diff[g] * (2 / denom)``."""
    torch.ops.tllm_esamp.loss_dy(h, tp, mask, parts, dy, reduction)


def check_loss_dy(h, tp, mask, parts, dy, reduction) -> None:
    """Raise ``ValueError`` naming the bad argument and what is allowed."""
    _same_device(h=h, tp=tp, mask=mask, parts=parts, dy=dy)
    _expect("h", h, h.dim() == 3 and h.dtype == torch.float32, "[G, M, H] fp32")
    g, rows, hidden = h.shape
    _fp32("tp", tp, tuple(h.shape), "h's shape")
    _fp32("dy", dy, tuple(h.shape), "h's shape")
    ok = parts.dim() == 2 and parts.shape[0] == g and parts.shape[1] >= 1
    want = "[{}, L >= 1] fp32 (the loss parts)"
    _expect("parts", parts, ok and parts.dtype == torch.float32, want, g)
    ok = tuple(mask.shape) == (g, rows) and mask.dtype == torch.bool
    _expect("mask", mask, ok, "[{}, {}] bool", g, rows)
    loss_per_row(hidden, reduction)  # raises for another reduction


def reference(h, tp, mask, parts, dy, reduction) -> None:
    """The PyTorch reference of :func:`loss_dy`: the whole loss in ``parts[:, 0]`` (the other
    columns 0)."""
    diff = torch.where(mask[..., None], h - tp, 0.0)
    denom = loss_denominator(mask.sum(1), h.shape[2], reduction)
    parts.zero_()
    parts[:, 0] = diff.square().sum((1, 2)) / denom
    torch.mul(diff, (2.0 / denom)[:, None, None], out=dy)


def loss_dy_launch(h, tp, mask, parts, dy, reduction, *, block_h=128, num_warps=4) -> Launch | None:
    """The loss + dy kernel's launch: per group one program per column of ``parts``."""
    groups, rows, hidden = h.shape
    if groups == 0:
        return None
    per_row = loss_per_row(hidden, reduction)
    block_m = min(16, pow2_rows(max(rows, 1)))
    chunk = cdiv(hidden, parts.shape[1])
    args = (
        h, tp, bool_bytes(mask), parts, dy,
        rows, hidden, chunk,
        *h.stride(), *tp.stride(), *mask.stride(), *dy.stride(), *parts.stride(),
        per_row,
    )  # fmt: skip
    consts = dict(BLOCK_M=block_m, BLOCK_H=block_h)
    return Launch("loss_dy", (parts.shape[1], groups), args, consts, num_warps)


run_triton = runner(loss_dy_launch)


def loss_dy_bytes(groups: int, rows: int, hidden: int, parts: int = 1) -> int:
    """``loss_dy``: ``h`` and ``tp`` read, ``dy`` written, the mask and the parts."""
    return 3 * groups * rows * hidden * FP32 + groups * parts * (rows + FP32)


def _traffic(h, tp, mask, parts, *args, **kwargs) -> int:
    return loss_dy_bytes(*h.shape, parts.shape[1])

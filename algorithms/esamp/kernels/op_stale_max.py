"""The op ``tllm_esamp::stale_max``: the prediction's staleness measurement, the largest
lag of its groups' slots."""

from __future__ import annotations

import torch

from algorithms.esamp.kernels.checks import _expect, _same_device, _slot_vector
from algorithms.esamp.kernels.launch import Launch, runner

SCHEMA = "stale_max(Tensor submitted, Tensor applied, Tensor group_slot, Tensor(a!) stale) -> ()"


def stale_max(
    submitted: torch.Tensor, applied: torch.Tensor, group_slot: torch.Tensor, stale: torch.Tensor
) -> None:
    """``stale[0] = max(stale[0], submitted[g] - applied[group_slot[g]])`` over the groups
    with a slot (all int64 but ``group_slot``)."""
    torch.ops.tllm_esamp.stale_max(submitted, applied, group_slot, stale)


def check_stale_max(submitted, applied, group_slot, stale) -> None:
    """Raise ``ValueError`` naming the bad argument and what is allowed."""
    _same_device(submitted=submitted, applied=applied, group_slot=group_slot, stale=stale)
    ok = submitted.dim() == 1 and submitted.dtype == torch.int64
    _expect("submitted", submitted, ok, "[G] int64")
    _slot_vector(group_slot, submitted.shape[0])
    _expect("applied", applied, applied.dim() == 1 and applied.dtype == torch.int64, "[S] int64")
    ok = tuple(stale.shape) == (1,) and stale.dtype == torch.int64
    _expect("stale", stale, ok, "[1] int64")


def reference(submitted, applied, group_slot, stale) -> None:
    """The PyTorch reference of :func:`stale_max`."""
    if not submitted.shape[0]:
        return
    lag = submitted - applied.index_select(0, group_slot.clamp(min=0))
    lag = torch.where(group_slot >= 0, lag, stale)
    torch.maximum(stale, lag.max(), out=stale)


def stale_max_launch(
    submitted, applied, group_slot, stale, *, block_g=64, num_warps=1
) -> Launch | None:
    """The staleness kernel's launch, one program (None: no groups)."""
    groups = submitted.shape[0]
    if groups == 0:
        return None
    args = (
        submitted, applied, group_slot, stale,
        groups, submitted.stride(0), applied.stride(0), group_slot.stride(0),
    )  # fmt: skip
    return Launch("stale_max", (1,), args, dict(BLOCK_G=block_g), num_warps)


run_triton = runner(stale_max_launch)


def _traffic(submitted, *args, **kwargs) -> int:
    """``stale_max``'s bytes: three int64 per group read, the maximum read and written."""
    return submitted.shape[0] * 3 * 8 + 2 * 8

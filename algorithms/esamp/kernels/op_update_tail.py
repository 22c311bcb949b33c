"""The op ``tllm_esamp::update_tail``: after the backward, each group's loss, gradient norm,
finite check and clip coefficient, and its slot's step and applied counts."""

from __future__ import annotations

import torch

from algorithms.esamp.kernels.checks import (
    FP32,
    _expect,
    _fp32,
    _same_device,
    _slot_vector,
)
from algorithms.esamp.kernels.launch import Launch, bool_bytes, cdiv, runner
from tllm_core import pow2_rows

SCHEMA = (
    "update_tail(Tensor loss_parts, Tensor parts, Tensor group_slot, Tensor mask, "
    "Tensor(a!) step, Tensor(b!)? applied, Tensor(c!) losses, Tensor(d!) ok, "
    "Tensor(e!) scale, Tensor(f!) norm, float grad_clip, float clip_eps) -> ()"
)


def update_tail(
    loss_parts: torch.Tensor,
    parts: torch.Tensor,
    group_slot: torch.Tensor,
    mask: torch.Tensor,
    step: torch.Tensor,
    applied: torch.Tensor | None,
    losses: torch.Tensor,
    ok: torch.Tensor,
    scale: torch.Tensor,
    norm: torch.Tensor,
    *,
    grad_clip: float | None,
    clip_eps: float,
) -> None:
    """Per group, after the backward: ``losses = sum(loss_parts)``, ``norm =
    sqrt(sum(parts))``, ``ok`` = a slot, rows and a finite loss and norm, ``scale = min(1,
    grad_clip / (norm + clip_eps))``; ``step[s] += ok`` and ``applied[s] += valid`` at its
    slot ``s`` (a slot in at most one group)."""
    clip = -1.0 if grad_clip is None else float(grad_clip)
    if grad_clip is not None and not grad_clip >= 0:
        raise ValueError(f"grad_clip must be >= 0 or None, got {grad_clip}")
    torch.ops.tllm_esamp.update_tail(
        loss_parts, parts, group_slot, mask, step, applied, losses, ok, scale, norm, clip,
        clip_eps,
    )  # fmt: skip


def check_update_tail(
    loss_parts, parts, group_slot, mask, step, applied, losses, ok, scale, norm, grad_clip, clip_eps
) -> None:
    """Raise ``ValueError`` naming the bad argument and what is allowed."""
    tensors = dict(loss_parts=loss_parts, parts=parts, group_slot=group_slot, mask=mask)
    tensors.update(step=step, losses=losses, ok=ok, scale=scale, norm=norm)
    if applied is not None:
        tensors["applied"] = applied
    _same_device(**tensors)
    _expect("mask", mask, mask.dim() == 2 and mask.dtype == torch.bool, "[G, M] bool")
    g = mask.shape[0]
    for name, t in (("loss_parts", loss_parts), ("parts", parts)):
        ok_t = t.dim() == 2 and t.shape[0] == g and t.dtype == torch.float32
        _expect(name, t, ok_t, "[{}, K] fp32", g)
    _slot_vector(group_slot, g)
    _expect("step", step, step.dim() == 1 and step.dtype == torch.float32, "[S] fp32")
    if applied is not None:
        same = tuple(applied.shape) == tuple(step.shape) and applied.dtype == torch.int64
        _expect("applied", applied, same, "{} int64 (step's)", step.shape)
    _expect("ok", ok, tuple(ok.shape) == (g,) and ok.dtype == torch.bool, "[{}] bool", g)
    for name, t in (("losses", losses), ("scale", scale), ("norm", norm)):
        _fp32(name, t, (g,), "one per group")
    if not clip_eps >= 0:
        raise ValueError(f"clip_eps must be >= 0, got {clip_eps}")


def reference(
    loss_parts, parts, group_slot, mask, step, applied, losses, ok, scale, norm, grad_clip, clip_eps
) -> None:
    """The PyTorch reference of :func:`update_tail` (``grad_clip < 0``: no clipping)."""
    torch.sum(loss_parts, 1, out=losses)
    torch.sqrt(parts.sum(1), out=norm)
    valid = (group_slot >= 0) & mask.any(1)
    # Finite iff x * 0 == 0 (inf * 0 and NaN * 0 are NaN).
    ok.copy_(valid & (losses * 0 + norm * 0 == 0))
    if grad_clip < 0:
        scale.fill_(1.0)
    else:
        scale.copy_((grad_clip / (norm + clip_eps)).clamp(max=1.0))
    idx = group_slot.clamp(min=0)
    step.index_add_(0, idx, ok.to(step.dtype))
    if applied is not None:
        applied.index_add_(0, idx, valid.to(applied.dtype))


def update_tail_launch(
    loss_parts, parts, group_slot, mask, step, applied, losses, ok, scale, norm, grad_clip,
    clip_eps,
    *, block_g: int = 64, num_warps: int = 4,
) -> Launch | None:  # fmt: skip
    """The update tail kernel's launch (None: no groups)."""
    groups, rows = mask.shape
    if groups == 0:
        return None
    has_applied = applied is not None
    app = applied if has_applied else step  # a placeholder pointer, never read
    args = (
        loss_parts, parts, group_slot, bool_bytes(mask), step, app, bool_bytes(ok), scale,
        norm, losses,
        groups, loss_parts.shape[1], parts.shape[1], rows,
        *loss_parts.stride(), *parts.stride(), group_slot.stride(0), *mask.stride(),
        step.stride(0), app.stride(0), ok.stride(0), scale.stride(0), norm.stride(0),
        losses.stride(0),
        float(grad_clip), float(clip_eps),
    )  # fmt: skip
    consts = dict(
        BLOCK_G=block_g,
        BLOCK_M=min(64, pow2_rows(max(rows, 1))),
        HAS_CLIP=grad_clip >= 0,
        HAS_APPLIED=has_applied,
    )
    return Launch("update_tail", (cdiv(groups, block_g),), args, consts, num_warps)


run_triton = runner(update_tail_launch)


def _traffic(loss_parts, parts, group_slot, mask, step, applied, *args, **kwargs) -> int:
    """``update_tail``'s bytes: per group its parts, slot and mask row read, four results
    written, its slot's counts read and written."""
    groups, rows = mask.shape
    cols = loss_parts.shape[1] + parts.shape[1]
    counts = 16 if applied is not None else 0
    return groups * (FP32 * cols + 8 + rows + 3 * FP32 + 1 + 2 * FP32 + counts)

"""The two slot-indexed operations of the CUDA path: a batched product with each packed
group's own slot of the stacked weights, and the clipped gradient + Adam step of each group's
slot, with the gradient formed inside the step.

Packed group ``g`` uses slot ``group_slot[g]`` of the ``[S, ...]`` state; ``-1`` marks a
padding group (no slot: zero output, no update). Only the step's slots are read, so the cost
follows the live groups, not the capacity. Both work on strided views into the flat ``[S, P]``
state rows (:func:`~algorithms.esamp.params.split_params`).

These are the PyTorch forms (any device, used on CPU and as the reference);
:mod:`algorithms.esamp.kernels` replaces them with Triton kernels on CUDA when available.
"""

from __future__ import annotations

import torch

from algorithms.esamp.params import AdamHyper


def slot_matmul(
    x: torch.Tensor, w: torch.Tensor, group_slot: torch.Tensor, transpose_w: bool
) -> torch.Tensor:
    """``x[g] @ w[group_slot[g]]^T`` (``w [S, N, K]``) or, with ``transpose_w=False``,
    ``x[g] @ w[group_slot[g]]`` (``w [S, K, N]``); ``x [G, M, K]``; padding groups give 0."""
    ws = w.index_select(0, group_slot.clamp(min=0))
    y = torch.bmm(x, ws.transpose(1, 2) if transpose_w else ws)
    return y.mul_((group_slot >= 0).to(y.dtype)[:, None, None])


def slot_grad_adam_(
    w: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    group_slot: torch.Tensor,
    step: torch.Tensor,
    ok: torch.Tensor,
    scale: torch.Tensor,
    hp: AdamHyper,
) -> None:
    """For each group with a slot and ``ok``: gradient ``scale[g] * a[g]^T b[g]`` (``a [G, M,
    N]``, ``b [G, M, K]``), then one Adam step of ``w``/``m``/``v`` ``[S, N, K]`` at the slot
    with its count ``step[slot]`` (already incremented). Same formulas as
    ``torch._fused_adam_``; other slots, and groups not ``ok``, are left bit for bit."""
    b1, b2 = hp.betas
    idx = group_slot.clamp(min=0)
    live = ((group_slot >= 0) & ok.bool())[:, None, None]
    g = torch.bmm((a * scale[:, None, None]).transpose(1, 2), b)
    t = step.index_select(0, idx)[:, None, None]
    w0, m0, v0 = (s.index_select(0, idx) for s in (w, m, v))
    m1 = torch.lerp(m0.float(), g, 1 - b1)
    v1 = v0.float().mul(b2).addcmul_(g, g, value=1 - b2)
    bc1, bc2 = 1 - torch.pow(b1, t), 1 - torch.pow(b2, t)
    denom = (v1.sqrt() / bc2.sqrt()).add_(hp.eps)
    w1 = w0 - (hp.lr / bc1) * m1 / denom
    # Deltas added (duplicates of padding's clamped slot add exactly 0): a skipped group's
    # state is untouched bit for bit.
    for s, old, new in ((w, w0, w1), (m, m0, m1), (v, v0, v1)):
        delta = torch.where(live, new.to(s.dtype) - old, torch.zeros((), dtype=s.dtype))
        s.index_put_((idx,), delta, accumulate=True)

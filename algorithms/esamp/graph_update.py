"""The update step, fixed shapes and no host sync (a CUDA graph's body; runs anywhere), on two
slot-indexed operations: a product with each group's weights, Adam forming the gradients."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from algorithms.esamp import kernels
from algorithms.esamp.mlp import Activations, MatMul, factor_weights, forward_slots, fused_backward
from algorithms.esamp.params import CLIP_EPS, AdamHyper, DistillerShape, adam_stats

LOSS_CHUNK = 256  # hidden columns per loss-kernel program: a few long groups still spread


def slot_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    group_slot: torch.Tensor,
    transpose_w: bool,
    precision: str = "ieee",
    out: torch.Tensor | None = None,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """The update's MatMul: ``kernels.slot_matmul`` into ``out`` (``precision``: ieee, tf32)."""
    if out is None:
        n = w.shape[-2] if transpose_w else w.shape[-1]
        per_matrix = w.dim() == 4 and x.dim() == 3
        lead = (x.shape[0], w.shape[1]) if per_matrix else (x.shape[0],)
        out = torch.empty(*lead, x.shape[-2], n, device=x.device, dtype=torch.float32)
    return kernels.slot_matmul(
        x, w, group_slot, out, transpose_w=transpose_w, input_precision=precision, add=add
    )


def slots_bound(mm: Callable[..., torch.Tensor], group_slot: torch.Tensor) -> MatMul:
    """``mm`` (as :func:`slot_matmul`) with ``group_slot`` bound: a :data:`MatMul`."""
    return lambda x, w, transpose_w, **kw: mm(x, w, group_slot, transpose_w, **kw)


def train_groups(
    theta: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    group_slot: torch.Tensor,
    xp: torch.Tensor,
    tp: torch.Tensor,
    mask: torch.Tensor,
    shape: DistillerShape,
    hp: AdamHyper,
    applied: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
    ops=None,
    forward: tuple[torch.Tensor, Activations] | None = None,
    precision: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Adam step per packed group, in place in slot ``group_slot[g]`` (-1: padding; non-finite
    groups kept): ``(losses, updated)``. ``ops``: (slot product, Adam) to use instead."""
    mm, grad_adam = ops or (partial(slot_matmul, precision=precision), kernels.grad_adam)
    adam = dict(lr=hp.lr, betas=hp.betas, eps=hp.eps, input_precision=precision)
    with torch.no_grad():
        gs = group_slot
        slot_mm = slots_bound(mm, gs)
        if forward is None:
            forward = forward_slots(theta, shape, xp, slot_mm)
        h, acts = forward
        g_n, rows, hidden = xp.shape  # allocations below: the graph's pool on CUDA
        loss_parts = xp.new_empty(g_n, max(1, -(-hidden // LOSS_CHUNK)))
        dys = xp.new_empty(shape.num_blocks, g_n, rows, hidden)  # each block's output grad
        kernels.loss_dy(h, tp, mask, loss_parts, dys[-1], reduction=hp.loss_reduction)
        factors, parts = fused_backward(theta, shape, acts, dys, slot_mm, precision)
        ok = torch.empty(g_n, dtype=torch.bool, device=xp.device)
        losses, scale, norm = (xp.new_empty(g_n) for _ in range(3))
        kernels.update_tail(
            loss_parts, parts, gs, mask, step, applied, losses, ok, scale, norm,
            grad_clip=hp.grad_clip, clip_eps=CLIP_EPS,
        )  # fmt: skip
        for blk, k, a_f, b_f in factors:
            w, mm_, vv = (factor_weights(t, shape, blk, k) for t in (theta, m, v))
            grad_adam(a_f, b_f, scale, gs, ok, step, w, mm_, vv, **adam)
        if stats is not None and hp.stats:
            idx = gs.clamp(min=0)
            mo, vo = (t.index_select(0, idx).float() for t in (m, v))
            st = adam_stats(mo, vo, step[idx], norm, hp)
            stats.copy_(torch.where(ok[:, None], st, float("nan")))
    return losses, ok

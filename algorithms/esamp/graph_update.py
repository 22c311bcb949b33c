"""The update step with fixed shapes and no host sync, captured as a CUDA graph; each weight's
clipped gradient is formed inside its Adam step. Runs on any device (tests use CPU)."""

from __future__ import annotations

from functools import partial

import torch

from algorithms.esamp import kernels
from algorithms.esamp.adam import CLIP_EPS, adam_stats
from algorithms.esamp.backward import factor_weights, fused_backward
from algorithms.esamp.mlp import Activations, forward_slots
from algorithms.esamp.params import AdamHyper, DistillerShape
from algorithms.esamp.slot_ops import slot_grad_adam_, slot_matmul, slots_bound

# Hidden columns per program of the loss kernel (a group's loss in that many parts), so
# that a few long groups still spread over the GPU.
LOSS_CHUNK = 256


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
    """One Adam step for every packed group with rows, in place in its slot ``group_slot[g]``
    (-1: padding) of ``theta``/``m``/``v``/``step``; returns ``(losses [G], updated [G])``.
    ``xp``/``tp [G, M, H]`` hold the rows ``mask`` marks; non-finite groups keep their state.
    ``applied``: counted per slot; ``stats``: filled with ``hp.stats``; ``ops``: the slot
    product and Adam; ``forward``: the prediction's, when kept."""
    mm, grad_adam_ = ops or (
        partial(slot_matmul, precision=precision),
        partial(slot_grad_adam_, precision=precision),
    )
    with torch.no_grad():
        gs = group_slot
        slot_mm = slots_bound(mm, gs)
        if forward is None:
            forward = forward_slots(theta, shape, xp, slot_mm)
        h, acts = forward
        # Allocated here: the graph's pool on CUDA (nothing per replay).
        g_n, rows, hidden = xp.shape
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
            grad_adam_(w, mm_, vv, a_f, b_f, gs, step, ok, scale, hp)
        if stats is not None and hp.stats:
            idx = gs.clamp(min=0)
            mo, vo = (t.index_select(0, idx).float() for t in (m, v))
            st = adam_stats(mo, vo, step[idx], norm, hp)
            stats.copy_(torch.where(ok[:, None], st, float("nan")))
    return losses, ok

"""The update step with fixed shapes and no host sync, so it can be captured as a CUDA graph
(the CUDA path replays it; the CPU path uses :mod:`algorithms.esamp.host_trainer`). The
backward is written out (:mod:`algorithms.esamp.backward`) in a few fused kernels
(:mod:`algorithms.esamp.kernels`: loss and its gradient, per block the elementwise backward
with the Gram-matrix norm, the clip / finite check / step counts); each weight's clipped
gradient is formed inside its Adam step (:mod:`algorithms.esamp.slot_ops`, Triton on CUDA),
so no gradient is ever written to memory, and one Adam launch covers the same matrix of
every block. On the kept forward the whole update is 9 launches at 2 blocks. Runs on any
device (CPU: the kernels' PyTorch reference): the CPU tests check it against the CPU
trainer's math.

Over the step's groups only: packed group ``g`` trains slot ``group_slot[g]`` (``-1``: a
padding group) directly in the stacked state, so nothing is gathered or scattered and slots
without rows are not read. Groups with a non-finite loss or gradient keep their state bit for
bit (``ok`` False)."""

from __future__ import annotations

from functools import partial

import torch

from algorithms.esamp import kernels
from algorithms.esamp.adam import CLIP_EPS, adam_stats
from algorithms.esamp.backward import factor_weights, fused_backward
from algorithms.esamp.mlp import Activations, forward_slots
from algorithms.esamp.params import AdamHyper, DistillerShape
from algorithms.esamp.slot_ops import slot_grad_adam_, slot_matmul


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
    """One Adam step for every packed group with rows, written in place into its slot.

    ``theta``/``m``/``v`` ``[S, P]``, ``step`` ``[S]``; ``group_slot [G]`` (int64, ``-1``:
    padding); ``xp``/``tp`` ``[G, M, H]`` hold group ``g``'s rows at ``[g, :count]``, ``mask
    [G, M]`` marks them. Loss of a group: its summed ``(f(x) - target)^2`` over the loss
    denominator (``hp.loss_reduction``). ``applied`` (int64 per slot, optional): incremented
    for every group with rows once its update has been processed (applied, or skipped as
    non-finite): what staleness is measured against. ``stats [G, len(STATS)]`` (optional,
    with ``hp.stats``): written with each group's update statistics (NaN where not updated).
    ``ops``: the slot operations (default :mod:`~algorithms.esamp.slot_ops`; the Triton ones
    on CUDA). ``forward``: :func:`~algorithms.esamp.mlp.forward_acts` of these parameters
    on ``xp``, already computed (the CUDA prediction's, kept for its update: the weights are
    then not read for a forward). ``precision``: the Gram products' of the gradient norm
    (:data:`~algorithms.esamp.kernels.INPUT_PRECISIONS`). Returns ``(losses [G], updated
    [G])``.

    Launches: the forward (unless given; :func:`~algorithms.esamp.mlp.forward_slots`), one
    for the loss and its gradient, per block the product with ``down``, the elementwise
    backward with its share of the norm (:func:`~algorithms.esamp.backward.fused_backward`)
    and (but the first block) the gradient carried to its input, one for norm / finite
    check / clip / step counts, and two Adam kernels (gate and up of every block, down of
    every block; per block where the activations are not equally spaced buffers).
    """
    mm, grad_adam_ = ops or (slot_matmul, slot_grad_adam_)
    with torch.no_grad():
        gs = group_slot
        slot_mm = partial(_mm, mm, gs)
        if forward is None:
            forward = forward_slots(theta, shape, xp, slot_mm)
        h, acts = forward
        # Allocated here: the graph's pool on CUDA (nothing per replay).
        g_n, rows, hidden = xp.shape
        loss_parts = xp.new_empty(g_n, loss_parts_for(hidden))
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


# Hidden columns per program of the loss kernel (a group's loss in that many parts), so
# that a few long groups still spread over the GPU.
LOSS_CHUNK = 256


def loss_parts_for(hidden: int) -> int:
    """Columns of the loss parts for groups of hidden size ``hidden``."""
    return max(1, -(-hidden // LOSS_CHUNK))


def _mm(
    mm, group_slot: torch.Tensor, x: torch.Tensor, w: torch.Tensor, transpose_w: bool, **kw
) -> torch.Tensor:
    return mm(x, w, group_slot, transpose_w, **kw)

"""The update step with fixed shapes and no host sync, so it can be captured as a CUDA graph
(the CUDA path replays it; the CPU path uses :mod:`algorithms.esamp.host_trainer`). Gradients
come from autograd; clipping and Adam from :func:`~algorithms.esamp.adam.adam_clip_`.
Runs on any device: the CPU tests check it against the CPU trainer.

Dense over slots: the step computes every slot of the stacked state (live or not) on its own
rows, directly on the state tensors, so nothing is gathered or scattered: the only full-size
temporaries are the gradients of all slots and one slot block of Adam scratch. Slots with no
row in the step (``valid`` False) keep their state bit for bit."""

from __future__ import annotations

import torch

from algorithms.esamp.adam import adam_clip_, adam_stats
from algorithms.esamp.mlp import forward_acts
from algorithms.esamp.objective import loss_denominator
from algorithms.esamp.params import AdamHyper, DistillerShape, split_params


def losses_and_grads(
    theta: torch.Tensor,
    xp: torch.Tensor,
    tp: torch.Tensor,
    mask: torch.Tensor,
    shape: DistillerShape,
    reduction: str = "mean",
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Per-slot loss (:mod:`~algorithms.esamp.objective`, ``reduction``) and its gradient per weight matrix, in the flat row's order (gate blocks,
    up blocks, down blocks; each ``[S, ., .]``).

    Leaves are views of ``theta`` (no copy). The gradient is taken per weight matrix:
    differentiating through slices of one flat tensor would zero-fill a full ``[S, P]``
    buffer for every slice.
    """
    gate, up, down = split_params(theta.detach(), shape)
    nb = shape.num_blocks
    leaves = [w[:, b].detach().requires_grad_(True) for w in (gate, up, down) for b in range(nb)]
    with torch.enable_grad():
        blocks = list(zip(leaves[:nb], leaves[nb : 2 * nb], leaves[2 * nb :], strict=True))
        y = forward_acts(blocks, xp)[0]
        err = torch.where(mask[..., None], (y - tp).square(), torch.zeros_like(y))
        n = loss_denominator(mask.sum(1), shape.hidden_size, reduction).to(y.dtype)
        losses = err.sum((1, 2)) / n
        grads = torch.autograd.grad(losses.sum(), leaves)
    return losses.detach(), list(grads)


def train_dense(
    theta: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    valid: torch.Tensor,
    xp: torch.Tensor,
    tp: torch.Tensor,
    mask: torch.Tensor,
    shape: DistillerShape,
    hp: AdamHyper,
    applied: torch.Tensor | None = None,
    chunk: int = 1,
    stats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Adam step for every slot with rows, written in place into the slot state.

    ``theta``/``m``/``v`` ``[S, P]``, ``step``/``valid`` ``[S]``; ``xp``/``tp`` ``[S, M, H]``
    hold slot ``s``'s rows at ``[s, :count]``, ``mask [S, M]`` marks them. Loss of slot s: its
    summed ``(f(x) - target)^2`` over the loss denominator (``hp.loss_reduction``). Adam runs ``chunk`` slots at
    a time (the scratch is ``chunk x P``). ``applied`` (int64 per slot, optional):
    incremented for every valid slot once its update has been processed (applied, or
    skipped as non-finite): what staleness is measured against. ``stats [S, len(STATS)]``
    (optional, with ``hp.stats``): written in place with each slot's update statistics
    (:func:`~algorithms.esamp.adam.adam_stats`; NaN for slots not updated). Returns
    ``(losses [S], updated [S])``.
    """
    losses, grads = losses_and_grads(theta, xp, tp, mask, shape, hp.loss_reduction)
    s_total = theta.shape[0]
    with torch.no_grad():
        # Each slot's gradient norm, one reduction per weight (no temporaries: isfinite on
        # the gradients would allocate a copy of them); non-finite anywhere -> non-finite.
        sq = torch.zeros_like(losses)
        for g in grads:
            sq += torch.linalg.vector_norm(g, dim=tuple(range(1, g.dim()))).square()
        norm = sq.sqrt()
        ok = valid & torch.isfinite(losses) & torch.isfinite(norm)
        for c0 in range(0, s_total, chunk):
            c1 = min(s_total, c0 + chunk)
            block = torch.cat([g[c0:c1].reshape(c1 - c0, -1) for g in grads], dim=1)
            adam_clip_(
                theta[c0:c1],
                block,
                m[c0:c1],
                v[c0:c1],
                step[c0:c1],
                ok[c0:c1],
                hp,
                norm=norm[c0:c1],
            )
            del block  # else the next block is allocated while this one is still held
            if stats is not None and hp.stats:
                st = adam_stats(m[c0:c1], v[c0:c1], step[c0:c1], norm[c0:c1], hp)
                stats[c0:c1] = torch.where(ok[c0:c1, None], st, torch.full_like(st, float("nan")))
        if applied is not None:
            applied.add_(valid.to(applied.dtype))
    return losses, ok

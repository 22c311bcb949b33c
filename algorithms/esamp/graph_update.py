"""The update step with fixed shapes and no host sync, so it can be captured as a CUDA graph
(the CUDA path replays it; the CPU path uses :mod:`algorithms.esamp.host_trainer`). Gradients
come from autograd; clipping and Adam from :func:`~algorithms.esamp.adam.adam_clip_update`.
Runs on any device: the CPU tests check it against the CPU trainer."""

from __future__ import annotations

import torch

from algorithms.esamp.adam import adam_clip_update
from algorithms.esamp.mlp import forward_acts
from algorithms.esamp.params import AdamHyper, DistillerShape, split_params


def losses_and_grads(
    theta_g: torch.Tensor,
    xp: torch.Tensor,
    tp: torch.Tensor,
    mask: torch.Tensor,
    shape: DistillerShape,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group MSE and its gradient, flat ``[G, P]`` like ``theta_g``.

    The gradient is taken per weight matrix: differentiating through slices of one flat
    tensor would zero-fill a full ``[G, P]`` buffer for every slice.
    """
    gate, up, down = split_params(theta_g, shape)
    nb, g = shape.num_blocks, theta_g.shape[0]
    leaves = [w[:, b].detach().requires_grad_(True) for w in (gate, up, down) for b in range(nb)]
    with torch.enable_grad():
        blocks = list(zip(leaves[:nb], leaves[nb : 2 * nb], leaves[2 * nb :], strict=True))
        y = forward_acts(blocks, xp)[0]
        err = torch.where(mask[..., None], (y - tp).square(), torch.zeros_like(y))
        n = (mask.sum(1) * shape.hidden_size).clamp_min(1).to(y.dtype)
        losses = err.sum((1, 2)) / n
        grads = torch.autograd.grad(losses.sum(), leaves)
    grad = torch.cat(
        [torch.stack(grads[k * nb : (k + 1) * nb], 1).reshape(g, -1) for k in range(3)], dim=1
    )
    return losses.detach(), grad


def train_packed(
    theta: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    gslots: torch.Tensor,
    gvalid: torch.Tensor,
    xp: torch.Tensor,
    tp: torch.Tensor,
    mask: torch.Tensor,
    shape: DistillerShape,
    hp: AdamHyper,
    applied: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Adam step per packed group, written in place into the slot state.

    ``gslots [G]`` must be distinct except for padding groups (``gvalid`` False), which may
    all point at one scratch slot. Loss of group g: mean over its rows (``mask``) and hidden
    dims of ``(f(x) - target)^2``. Fixed shapes and no host sync, so it can be graph-captured.
    ``applied`` (int64 per slot, optional): incremented for every valid group once its update
    has been processed (applied, or skipped as non-finite): what staleness is measured
    against. Returns ``(losses [G], updated [G])``.
    """
    theta_g = theta.index_select(0, gslots)
    losses, grad = losses_and_grads(theta_g, xp, tp, mask, shape)
    with torch.no_grad():
        ok = gvalid & torch.isfinite(losses) & torch.isfinite(grad).all(1)
        t, m_n, v_n, s_n = adam_clip_update(
            theta_g.detach(),
            grad,
            m.index_select(0, gslots),
            v.index_select(0, gslots),
            step.index_select(0, gslots),
            ok,
            hp,
        )
        theta.index_copy_(0, gslots, t)
        m.index_copy_(0, gslots, m_n)
        v.index_copy_(0, gslots, v_n)
        step.index_copy_(0, gslots, s_n)
        if applied is not None:
            applied.index_add_(0, gslots, gvalid.to(applied.dtype))
    return losses, ok

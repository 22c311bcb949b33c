"""Row-wise gradient clipping + Adam, in place over ``[c, P]`` row blocks (one row per slot):
the optimizer of the graph-capturable update (:mod:`algorithms.esamp.graph_update`). Same
formulas as ``torch.nn.utils.clip_grad_norm_`` + ``torch.optim.Adam``.

In place so that the update's memory is the state itself plus one gradient block: the
out-of-place form held about a dozen ``[G, P]`` temporaries at once (see the memory plan,
:mod:`algorithms.esamp.memory_plan`)."""

from __future__ import annotations

import torch

from algorithms.esamp.params import AdamHyper

# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing.
CLIP_EPS = 1e-6


def adam_clip_(
    theta: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    ok: torch.Tensor,
    hp: AdamHyper,
    norm: torch.Tensor | None = None,
) -> None:
    """Row-wise clip + Adam, writing ``theta``, ``m``, ``v``, ``step`` in place.

    All tensors are ``[c, P]`` except ``step``/``ok`` ``[c]``. ``grad`` is scratch: it is
    overwritten. ``norm [c]``: each row's gradient norm when already known (else computed
    here). Rows with ``ok`` False keep their parameters and state bit for bit (their
    learning rate and moment weights are zero, their gradient is zeroed first). No host sync
    and fixed shapes, so it can be captured in a CUDA graph.
    """
    b1, b2 = hp.betas
    grad.masked_fill_(~ok[:, None], 0.0)  # a where, not a product: nan * 0 is nan
    if hp.grad_clip is not None:
        if norm is None:
            norm = torch.linalg.vector_norm(grad, dim=1)
        norm = torch.where(ok, norm, torch.zeros_like(norm))  # as after the zeroing above
        grad.mul_((hp.grad_clip / (norm + CLIP_EPS)).clamp(max=1.0)[:, None])
    step.add_(ok.to(step.dtype))
    one = torch.ones_like(step)
    m.lerp_(grad, torch.where(ok, (1 - b1) * one, 0 * one)[:, None])
    v.mul_(torch.where(ok, b2 * one, one)[:, None]).addcmul_(grad, grad, value=1 - b2)
    # Skipped rows may still be at step 0: clamp so their (unused) corrections stay finite.
    t = step.clamp(min=1)
    bc1 = 1 - torch.pow(b1, t)
    bc2_sqrt = torch.sqrt(1 - torch.pow(b2, t))
    denom = torch.sqrt(v, out=grad)  # the gradient is no longer needed: reuse its block
    denom.div_(bc2_sqrt[:, None]).add_(hp.eps)
    upd = torch.div(m, denom, out=denom)
    theta.addcmul_(upd, torch.where(ok, hp.lr / bc1, 0 * one)[:, None], value=-1)


# Columns of a step's optimizer statistics, one row per group update (adam_stats).
STATS = ("clipped", "eps_share", "update_size", "grad_norm")


def clipped(norm: torch.Tensor, hp: AdamHyper) -> torch.Tensor:
    """Per row: 1.0 where clipping scaled the gradient down (``grad_clip / (norm + eps) < 1``,
    the test :func:`adam_clip_` and the host trainer apply), else 0.0."""
    if hp.grad_clip is None:
        return torch.zeros_like(norm)
    return (norm + CLIP_EPS > hp.grad_clip).to(norm.dtype)


def adam_stats(
    m: torch.Tensor, v: torch.Tensor, step: torch.Tensor, norm: torch.Tensor, hp: AdamHyper
) -> torch.Tensor:
    """Statistics of the Adam update just applied to rows ``m``/``v`` ``[c, P]`` (their state
    after it; ``step [c]`` already counts it; ``norm [c]`` the gradient norms before
    clipping). Returns ``[c, 4]`` in :data:`STATS` order: clipped (0/1); the share of
    parameters whose denominator is dominated by eps (``sqrt(v_hat) < eps``); the update's
    mean ``|delta theta| / lr`` = mean of ``|m_hat| / (sqrt(v_hat) + eps)`` (exactly the
    step Adam took, in units of lr); the gradient norm before clipping."""
    b1, b2 = hp.betas
    t = step.clamp(min=1).to(m.dtype)[:, None]
    v_hat_sqrt = (v / (1 - torch.pow(b2, t))).sqrt_()
    share = (v_hat_sqrt < hp.eps).to(m.dtype).mean(1)
    size = (m.abs() / (1 - torch.pow(b1, t))).div_(v_hat_sqrt.add_(hp.eps)).mean(1)
    return torch.stack([clipped(norm, hp), share, size, norm.to(m.dtype)], dim=1)

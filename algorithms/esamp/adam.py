"""Row-wise gradient clipping + Adam as plain tensor formulas over ``[G, P]`` (one row per
group): the optimizer of the graph-capturable update (:mod:`algorithms.esamp.graph_update`).
Same formulas as ``torch.nn.utils.clip_grad_norm_`` + ``torch.optim.Adam``."""

from __future__ import annotations

import torch

from algorithms.esamp.params import AdamHyper

# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing.
CLIP_EPS = 1e-6


def adam_clip_update(
    theta: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    ok: torch.Tensor,
    hp: AdamHyper,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-wise clip + Adam (same formulas as clip_grad_norm_ + torch.optim.Adam).

    All tensors are ``[G, P]`` except ``step``/``ok`` ``[G]``. Rows with ``ok`` False keep
    their parameters and state unchanged. Returns new ``(theta, m, v, step)``.
    """
    b1, b2 = hp.betas
    grad = torch.where(ok[:, None], grad, torch.zeros_like(grad))
    if hp.grad_clip is not None:
        norm = torch.linalg.vector_norm(grad, dim=1)
        coef = (hp.grad_clip / (norm + CLIP_EPS)).clamp(max=1.0)
        grad = grad * coef[:, None]
    step_n = step + 1
    m_n = m.lerp(grad, 1 - b1)
    v_n = v * b2 + (1 - b2) * grad * grad
    bc1 = 1 - torch.pow(b1, step_n)
    bc2_sqrt = torch.sqrt(1 - torch.pow(b2, step_n))
    denom = v_n.sqrt() / bc2_sqrt[:, None] + hp.eps
    theta_n = theta - (hp.lr / bc1)[:, None] * (m_n / denom)
    keep = ok[:, None]
    return (
        torch.where(keep, theta_n, theta),
        torch.where(keep, m_n, m),
        torch.where(keep, v_n, v),
        torch.where(ok, step_n, step),
    )

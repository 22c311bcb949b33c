"""Adam for the distiller's updates (``torch.optim.Adam``'s fused kernel, clipping as
``clip_grad_norm_``) and the statistics of an update."""

from __future__ import annotations

import torch

from algorithms.esamp.params import AdamHyper

# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing.
CLIP_EPS = 1e-6


def fused_adam_(
    ws: list[torch.Tensor],
    grads: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    steps: list[torch.Tensor],
    hp: AdamHyper,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One Adam step of each ``ws[i]`` in place (``steps`` already incremented): the step
    every path runs. ``found_inf`` holding 1.0: nothing is touched (no host sync)."""
    b1, b2 = hp.betas
    torch._fused_adam_(
        ws, grads, ms, vs, [], steps,
        lr=hp.lr, beta1=b1, beta2=b2, weight_decay=0.0, eps=hp.eps,
        amsgrad=False, maximize=False, found_inf=found_inf,
    )  # fmt: skip


# Columns of a step's optimizer statistics, one row per group update (adam_stats).
STATS = ("clipped", "eps_share", "update_size", "grad_norm")


def adam_stats(
    m: torch.Tensor, v: torch.Tensor, step: torch.Tensor, norm: torch.Tensor, hp: AdamHyper
) -> torch.Tensor:
    """Statistics ``[c, 4]`` (:data:`STATS`) of the Adam update just applied to rows
    ``m``/``v``: clipped, share with ``sqrt(v_hat) < eps``, mean ``|delta theta| / lr``, and
    the gradient norm before clipping."""
    clipped = torch.zeros_like(norm)  # 1.0 where clipping scaled the gradient down
    if hp.grad_clip is not None:
        clipped = (norm + CLIP_EPS > hp.grad_clip).to(norm.dtype)
    b1, b2 = hp.betas
    t = step.clamp(min=1).to(m.dtype)[:, None]
    v_hat_sqrt = (v / (1 - torch.pow(b2, t))).sqrt_()
    share = (v_hat_sqrt < hp.eps).to(m.dtype).mean(1)
    size = (m.abs() / (1 - torch.pow(b1, t))).div_(v_hat_sqrt.add_(hp.eps)).mean(1)
    return torch.stack([clipped, share, size, norm.to(m.dtype)], dim=1)

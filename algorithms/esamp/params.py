"""The distiller's parameters, one flat fp32 row per group (``m``, ``v`` alike): gate ``[NB, I,
H]``, up ``[NB, I, H]``, down ``[NB, H, I]``; and its Adam (torch's fused kernel)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DistillerShape:
    hidden_size: int
    intermediate_size: int = 384
    num_blocks: int = 2

    @property
    def block_numel(self) -> int:
        return self.num_blocks * self.intermediate_size * self.hidden_size

    @property
    def num_params(self) -> int:
        return 3 * self.block_numel


@dataclass(frozen=True)
class AdamHyper:
    lr: float = 4e-4
    eps: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float | None = 0.5
    loss_reduction: str = "mean"  # "mean" or "sum" (kernels.op_loss_dy)
    stats: bool = False  # measure each update (adam_stats)


def split_params(
    theta: torch.Tensor, shape: DistillerShape
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views ``(gate [G,NB,I,H], up [G,NB,I,H], down [G,NB,H,I])`` into ``theta [G, P]``."""
    g, n = theta.shape[0], shape.block_numel
    nb, i, h = shape.num_blocks, shape.intermediate_size, shape.hidden_size
    return (
        theta[:, :n].reshape(g, nb, i, h),
        theta[:, n : 2 * n].reshape(g, nb, i, h),
        theta[:, 2 * n :].reshape(g, nb, h, i),
    )


def block_weights(theta: torch.Tensor, shape: DistillerShape) -> list[tuple[torch.Tensor, ...]]:
    """Per block ``(gate [B,I,H], up [B,I,H], down [B,H,I])``: views into ``theta [B, P]``."""
    gate, up, down = split_params(theta, shape)
    return [(gate[:, b], up[:, b], down[:, b]) for b in range(shape.num_blocks)]


def init_params(shape: DistillerShape, init: str, seed: int) -> torch.Tensor:
    """One group's initial flat parameters (CPU, fp32), reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    n = shape.block_numel

    def uniform(fan_in: int) -> torch.Tensor:
        # nn.Linear's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        bound = 1.0 / math.sqrt(fan_in)
        return torch.rand(n, generator=gen, dtype=torch.float32).mul_(2 * bound).sub_(bound)

    gate, up = uniform(shape.hidden_size), uniform(shape.hidden_size)
    down = uniform(shape.intermediate_size)
    if init == "zero":
        down.zero_()  # every block starts as the identity residual: f(x) = x
    elif init != "paper":
        raise ValueError(f"unknown init {init!r} (expected 'paper' or 'zero')")
    return torch.cat([gate, up, down])


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
    """Every path's Adam step, in place (``steps`` already incremented; ``found_inf`` 1: none)."""
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
    """:data:`STATS` ``[c, 4]`` of the Adam update just applied to rows ``m``/``v``: clipped,
    share with ``sqrt(v_hat) < eps``, mean ``|delta theta| / lr``, gradient norm."""
    clipped = torch.zeros_like(norm)  # 1.0 where clipping scaled the gradient down
    if hp.grad_clip is not None:
        clipped = (norm + CLIP_EPS > hp.grad_clip).to(norm.dtype)
    b1, b2 = hp.betas
    t = step.clamp(min=1).to(m.dtype)[:, None]
    v_hat_sqrt = (v / (1 - torch.pow(b2, t))).sqrt_()
    share = (v_hat_sqrt < hp.eps).to(m.dtype).mean(1)
    size = (m.abs() / (1 - torch.pow(b1, t))).div_(v_hat_sqrt.add_(hp.eps)).mean(1)
    return torch.stack([clipped, share, size, norm.to(m.dtype)], dim=1)

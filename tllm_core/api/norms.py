"""The gain of a plain RMSNorm, read from what the norm computes, not from its weight."""

from __future__ import annotations

from collections.abc import Callable

import torch


def norm_eps(norm: object) -> float:
    """A norm module's epsilon (``variance_epsilon`` or ``eps``; 1e-6 when it names none)."""
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def rmsnorm_gain(
    norm: Callable[[torch.Tensor], torch.Tensor],
    width: int,
    eps: float,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """The gain ``g`` with ``norm(h) == h / sqrt(mean(h**2) + eps) * g`` for every ``h``, or None
    when ``norm`` is not of that form (checked on a second, random input)."""
    ones = torch.ones(1, width, dtype=dtype, device=device)
    g = (norm(ones)[0].float() * (1.0 + eps) ** 0.5).to(dtype)  # rms(ones) = 1
    h = torch.randn(2, width, generator=torch.Generator().manual_seed(0)).to(dtype).to(device)
    want = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps) * g.float()
    if not torch.allclose(norm(h).float(), want, rtol=1e-3, atol=1e-3):
        return None
    return g.detach()

"""The model's final norm described for consumers: the gain of a plain RMSNorm, read from the
norm itself (engine and test kit alike), so that a family's convention (Gemma's ``1 + w``) is
what the module computes, not what its weight stores."""

from __future__ import annotations

from collections.abc import Callable

import torch


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

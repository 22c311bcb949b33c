"""The distiller's function ``f``: residual gated-SwiGLU blocks, batched over groups.

``x <- x + down(silu(gate x) * up x)`` per block, no biases, fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from algorithms.esamp.params import DistillerShape, block_weights

# Per block (h_in, a = h_in gate^T, u = h_in up^T, s = silu(a), p = s * u), each [B, M, .]:
# what the backward needs from the forward.
Activations = list[tuple[torch.Tensor, ...]]


def forward_acts(
    weights: list[tuple[torch.Tensor, ...]], xp: torch.Tensor
) -> tuple[torch.Tensor, Activations]:
    """``f`` of packed rows ``xp [B, M, H]`` (fp32; one batch entry per group) and the
    activations its backward needs. All-zero padding rows stay exactly zero (no biases)."""
    acts = []
    h = xp
    for gate, up, down in weights:
        a = torch.bmm(h, gate.transpose(1, 2))
        u = torch.bmm(h, up.transpose(1, 2))
        s = F.silu(a)
        p = s * u
        acts.append((h, a, u, s, p))
        h = h + torch.bmm(p, down.transpose(1, 2))
    return h, acts


def forward_packed(theta: torch.Tensor, xp: torch.Tensor, shape: DistillerShape) -> torch.Tensor:
    """``f`` for packed rows: ``theta [G, P]``, ``xp [G, M, H]`` -> ``[G, M, H]``."""
    return forward_acts(block_weights(theta, shape), xp)[0]

"""What the tests of ESamp's kernels share: the Triton kernels decorated for Triton's
interpreter (so their launchers run on CPU tensors), and the update's loss and gradient
written out as before the fused kernels."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch


def interpreted_kernels() -> SimpleNamespace:
    """ESamp's kernels (``triton_impl.jit_kernels``) decorated with ``TRITON_INTERPRET=1``
    set (Triton reads it when a kernel is decorated), the variable then put back as it
    was; skips the test without Triton."""
    pytest.importorskip("triton", reason="Triton is not installed here")
    from algorithms.esamp.kernels import triton_impl

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        return triton_impl.jit_kernels()


def written_out_backward(
    weights: list, xp: torch.Tensor, tp: torch.Tensor, mask: torch.Tensor, hidden: int, hp: Any
) -> tuple[torch.Tensor, list, torch.Tensor, torch.Tensor]:
    """The update's loss and gradient written out as before the fused kernels, for groups of
    rows ``xp``/``tp`` ``[G, M, H]`` marked by ``mask`` on each group's ``weights``:
    ``forward_acts``, the masked difference, the loss over ``loss_denominator``,
    ``backward_factors`` and torch's clip coefficient. Returns ``(losses, factors, norm,
    scale)``."""
    from algorithms.esamp.adam import clip_scale
    from algorithms.esamp.backward import backward_factors
    from algorithms.esamp.mlp import forward_acts
    from algorithms.esamp.objective import loss_denominator

    h, acts = forward_acts(weights, xp)
    diff = torch.where(mask[..., None], h - tp, 0.0)
    denom = loss_denominator(mask.sum(1), hidden, hp.loss_reduction)
    losses = diff.square().sum((1, 2)) / denom
    factors, sq = backward_factors(weights, acts, diff.mul_((2.0 / denom)[:, None, None]))
    norm = sq.sqrt()
    return losses, factors, norm, clip_scale(norm, hp)

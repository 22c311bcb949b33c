"""The distiller's backward written out (no autograd), shared by both update paths.

Each weight's gradient is a product ``A^T B`` of two thin ``[B, M, .]`` factors, so its
squared norm is ``sum((A A^T) * (B B^T))``: each group's gradient norm (for clipping) comes
from ``M x M`` Gram matrices before any gradient exists, and each gradient can then be
formed once, already clipped, right before Adam reads it."""

from __future__ import annotations

import torch

from algorithms.esamp import kernels
from algorithms.esamp.mlp import Activations, MatMul, batched_mm, gate_up_pairs
from algorithms.esamp.params import DistillerShape, block_weights

# (block, matrix 0/1/2 = gate/up/down, A, B): that matrix's gradient is A^T B.
Factor = tuple[int, int, torch.Tensor, torch.Tensor]
# fused_backward's matrix index for gate and up of a block together.
GATE_UP = -1


def backward_factors(
    weights: list[tuple[torch.Tensor, ...]],
    acts: Activations,
    dy: torch.Tensor,
    mm: MatMul = batched_mm,
) -> tuple[list[Factor], torch.Tensor]:
    """The gradient factors of every weight matrix and each group's squared gradient norm
    ``[B]``, from the forward's activations (:func:`~algorithms.esamp.mlp.forward_acts`) and
    the loss's gradient ``dy [B, M, H]`` with respect to the output (``mm``: as in
    :func:`~algorithms.esamp.mlp.forward_acts`)."""
    factors: list[Factor] = []
    sq = torch.zeros(dy.shape[0], dtype=dy.dtype, device=dy.device)
    for b in reversed(range(len(weights))):
        gate, up, down = weights[b]
        h_in, a, u, s, p = acts[b]
        dp = mm(dy, down, False)
        du = dp * s
        sig = torch.sigmoid(a)
        da = dp * u * sig * (1 + a * (1 - sig))
        factors += [(b, 2, dy, p), (b, 1, du, h_in), (b, 0, da, h_in)]
        # Gate and up share B = h_in.
        gram_in = torch.bmm(h_in, h_in.transpose(1, 2))
        gram_g = torch.bmm(du, du.transpose(1, 2)) + torch.bmm(da, da.transpose(1, 2))
        sq += (torch.bmm(dy, dy.transpose(1, 2)) * torch.bmm(p, p.transpose(1, 2))).sum((1, 2))
        sq += (gram_g * gram_in).sum((1, 2))
        if b:
            dy = dy + mm(du, up, False) + mm(da, gate, False)
    return factors, sq


def fused_backward(
    theta: torch.Tensor,
    shape: DistillerShape,
    acts: Activations,
    dy: torch.Tensor,
    mm: MatMul,
    precision: str = "ieee",
) -> tuple[list[Factor], torch.Tensor]:
    """:func:`backward_factors` in fewer launches (the update graph's), for a ``mm`` that
    takes ``[S, 2, ., .]`` weights and ``add=`` (as :func:`~algorithms.esamp.mlp.
    forward_slots`): per block the product with ``down``, one
    :func:`~algorithms.esamp.kernels.block_backward` (``da``, ``du`` into one ``[B, 2, M,
    I]`` buffer, and the block's share of the norm) and one product carrying the gradient
    to the block's input (``dy + da @ gate + du @ up``). Returns the factors (gate and up of
    a block as one, matrix :data:`GATE_UP`: ``A = [B, 2, M, I]``, gradient ``A[:, e]^T B``
    for :func:`~algorithms.esamp.mlp.gate_up_pairs` index ``e``) and the norm parts ``[B, NB
    * T]`` (a group's squared gradient norm is the sum of its row:
    :func:`~algorithms.esamp.kernels.update_tail` sums it)."""
    pairs = gate_up_pairs(theta, shape)
    downs = [w[2] for w in block_weights(theta, shape)]
    groups, rows, _ = dy.shape
    parts = dy.new_empty(groups, len(acts), kernels.norm_parts(rows))
    factors: list[Factor] = []
    for b in reversed(range(len(acts))):
        h_in, a, u, s, p = acts[b]
        dp = mm(dy, downs[b], False)
        dz = dp.new_empty(groups, 2, rows, dp.shape[2])  # (da, du): gate's, up's
        kernels.block_backward(
            dp, a, u, s, p, h_in, dy, dz[:, 1], dz[:, 0], parts[:, b], input_precision=precision
        )
        factors += [(b, 2, dy, p), (b, GATE_UP, dz, h_in)]
        if b:
            dy = mm(dz, pairs[b], False, out=torch.empty_like(dy), add=dy)
    return factors, parts.view(groups, -1)


def clipped_grad(factor: Factor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out [B, ., .]`` <- each group's gradient of the factor's matrix times ``scale [B]``
    (the clip coefficient folded into the thin factor: ``(c A)^T B = c (A^T B)``)."""
    _, _, a_f, b_f = factor
    return torch.bmm((a_f * scale[:, None, None]).transpose(1, 2), b_f, out=out)

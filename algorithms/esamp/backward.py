"""The distiller's backward written out on the kernels' ops. Each weight's gradient is
``A^T B`` of two thin factors, so its squared norm ``sum((A A^T) * (B B^T))`` comes from
``M x M`` Gram matrices before any gradient exists (clipping first, gradients formed once)."""

from __future__ import annotations

import torch

from algorithms.esamp import kernels
from algorithms.esamp.mlp import Activations, MatMul, batched_mm, gate_up_pairs, stack_view
from algorithms.esamp.params import DistillerShape, block_weights, split_params

# (block, matrix 0/1/2 = gate/up/down, A, B): that matrix's gradient is A^T B.
Factor = tuple[int, int, torch.Tensor, torch.Tensor]
# fused_backward's matrix index for gate and up together, and block index for every block.
GATE_UP = -1
ALL_BLOCKS = -1


def backward_factors(
    weights: list[tuple[torch.Tensor, ...]],
    acts: Activations,
    dy: torch.Tensor,
    mm: MatMul = batched_mm,
) -> tuple[list[Factor], torch.Tensor]:
    """The gradient factors of every weight matrix and each group's squared gradient norm
    ``[B]``, from the forward's activations and the output gradient ``dy [B, M, H]``."""
    factors: list[Factor] = []
    groups, rows, _ = dy.shape
    parts = dy.new_empty(len(weights), groups, kernels.norm_parts(rows))
    for b in reversed(range(len(weights))):
        gate, up, down = weights[b]
        h_in, a, u, s, p = acts[b]
        dp = mm(dy, down, False)
        du, da = torch.empty_like(dp), torch.empty_like(dp)
        kernels.block_backward(dp, a, u, s, p, h_in, dy, du, da, parts[b])
        factors += [(b, 2, dy, p), (b, 1, du, h_in), (b, 0, da, h_in)]
        if b:
            dy = dy + mm(du, up, False) + mm(da, gate, False)
    return factors, parts.sum((0, 2))


def fused_backward(
    theta: torch.Tensor,
    shape: DistillerShape,
    acts: Activations,
    dys: torch.Tensor,
    mm: MatMul,
    precision: str = "ieee",
) -> tuple[list[Factor], torch.Tensor]:
    """:func:`backward_factors` in fewer launches (the update graph's), for a slot-indexed
    ``mm``. ``dys [NB, B, M, H]``: ``dys[-1]`` the output gradient; block ``b``'s is written
    to ``dys[b]``. Returns the factors (one of :data:`ALL_BLOCKS` / :data:`GATE_UP` where the
    activations are equally spaced) and the norm parts ``[B, NB * T]``."""
    pairs = gate_up_pairs(theta, shape)
    downs = [w[2] for w in block_weights(theta, shape)]
    nb, groups, rows, _ = dys.shape
    parts = dys.new_empty(groups, nb, kernels.norm_parts(rows, dys.shape[3]))
    dz = dys.new_empty(groups, 2, nb, rows, shape.intermediate_size)  # (da, du) per block
    for b in reversed(range(nb)):
        h_in, a, u, s, p = acts[b]
        dp = mm(dys[b], downs[b], False)
        da, du = dz[:, 0, b], dz[:, 1, b]
        kernels.block_backward(
            dp, a, u, s, p, h_in, dys[b], du, da, parts[:, b], input_precision=precision
        )
        if b:
            mm(dz[:, :, b], pairs[b], False, out=dys[b - 1], add=dys[b])
    p_all = stack_view([x[4] for x in acts])
    h_all = stack_view([x[0] for x in acts])
    factors: list[Factor] = []
    if p_all is not None:
        factors.append((ALL_BLOCKS, 2, dys.transpose(0, 1), p_all))
    else:
        factors += [(b, 2, dys[b], acts[b][4]) for b in range(nb)]
    if h_all is not None:
        factors.append((ALL_BLOCKS, GATE_UP, dz.view(groups, 2 * nb, rows, -1), h_all))
    else:
        factors += [(b, GATE_UP, dz[:, :, b], acts[b][0]) for b in range(nb)]
    return factors, parts.view(groups, -1)


def factor_weights(t: torch.Tensor, shape: DistillerShape, block: int, matrix: int) -> torch.Tensor:
    """The matrices of ``t [S, P]`` (``theta``, ``m`` or ``v``) a :func:`fused_backward`
    factor's gradient belongs to."""
    if block == ALL_BLOCKS:
        if matrix == GATE_UP:
            n, i, h = shape.block_numel, shape.intermediate_size, shape.hidden_size
            return t[:, : 2 * n].view(t.shape[0], 2 * shape.num_blocks, i, h)
        return split_params(t, shape)[matrix]
    if matrix == GATE_UP:
        return gate_up_pairs(t, shape)[block]
    return block_weights(t, shape)[block][matrix]

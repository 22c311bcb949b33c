"""The distiller's ``f``: residual gated-SwiGLU blocks ``x <- x + down(silu(gate x) * up x)``
(no biases, fp32) batched over groups, and its backward. Each weight's gradient ``A^T B`` has
its squared norm from ``M x M`` Gram matrices, so clipping comes before any gradient exists."""

from __future__ import annotations

from collections.abc import Callable

import torch

from algorithms.esamp import kernels
from algorithms.esamp.params import DistillerShape, block_weights, split_params

# Per block (h_in, a = h_in gate^T, u = h_in up^T, s = silu(a), p = s * u), each [B, M, .]
Activations = list[tuple[torch.Tensor, ...]]
# mm(x, w, transpose_w) -> x @ w^T or x @ w per batch entry (slot-indexed: out=, add= too)
MatMul = Callable[..., torch.Tensor]
# Per block (h_out, a, u, s, p) [B, M, .]: where forward_slots writes (CUDA keeps them)
ActBuffers = list[tuple[torch.Tensor, ...]]


def batched_mm(x: torch.Tensor, w: torch.Tensor, transpose_w: bool) -> torch.Tensor:
    """The dense form of :data:`MatMul`: batch entry ``i`` of ``x`` with weight ``w[i]``."""
    return torch.bmm(x, w.transpose(1, 2) if transpose_w else w)


def forward_acts(
    weights: list[tuple[torch.Tensor, ...]], xp: torch.Tensor, mm: MatMul = batched_mm
) -> tuple[torch.Tensor, Activations]:
    """``f`` of packed rows ``xp [B, M, H]`` (zero rows stay zero) and its backward's inputs."""
    acts, h = [], xp
    for gate, up, down in weights:
        a, u = mm(h, gate, True), mm(h, up, True)
        s, p = torch.empty_like(a), torch.empty_like(a)
        kernels.silu_mul(a, u, s, p)
        acts.append((h, a, u, s, p))
        h = h + mm(p, down, True)
    return h, acts


def saved_forward(xp: torch.Tensor, out: ActBuffers) -> tuple[torch.Tensor, Activations]:
    """What :func:`forward_slots` returned when it wrote ``out`` from ``xp`` (no compute)."""
    acts, h = [], xp
    for h_out, a, u, s, p in out:
        acts.append((h, a, u, s, p))
        h = h_out
    return h, acts


def gate_up_pairs(theta: torch.Tensor, shape: DistillerShape) -> list[torch.Tensor]:
    """Per block, gate and up of ``theta [B, P]`` as one view ``[B, 2, I, H]`` (one launch)."""
    b, n = theta.shape[0], shape.block_numel
    nb, i, h = shape.num_blocks, shape.intermediate_size, shape.hidden_size
    both = theta[:, : 2 * n].view(b, 2, nb, i, h)
    return [both[:, :, k] for k in range(nb)]


def stack_view(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """``[B, N, ...]`` view of ``parts`` when they are equally spaced views of one buffer."""
    first = parts[0]
    step = parts[1].storage_offset() - first.storage_offset() if len(parts) > 1 else 1
    same = all(
        t.shape == first.shape
        and t.stride() == first.stride()
        and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and t.storage_offset() - first.storage_offset() == k * step
        for k, t in enumerate(parts)
    )
    if not (same and step > 0):
        return None
    size = (first.shape[0], len(parts), *first.shape[1:])
    return first.as_strided(
        size, (first.stride(0), step, *first.stride()[1:]), first.storage_offset()
    )


def pair_view(a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``[B, 2, M, I]`` view holding ``a`` and ``u`` (one product writes both)."""
    both = stack_view([a, u])
    if both is None:
        raise ValueError("a and u must be equally strided views of one buffer, u after a")
    return both


def forward_slots(
    theta: torch.Tensor,
    shape: DistillerShape,
    xp: torch.Tensor,
    mm: MatMul,
    out: ActBuffers | None = None,
) -> tuple[torch.Tensor, Activations]:
    """:func:`forward_acts` in three launches per block, for a slot-indexed ``mm``."""
    pairs = gate_up_pairs(theta, shape)
    downs = [w[2] for w in block_weights(theta, shape)]
    if out is None:
        g, rows, hid = xp.shape
        nb, i = shape.num_blocks, shape.intermediate_size
        outs = xp.new_empty(nb, g, rows, hid)
        inner = xp.new_empty(nb, 4, g, rows, i)  # a, u, s, p: each contiguous
        out = [(outs[b], *inner[b].unbind(0)) for b in range(nb)]
    acts, h = [], xp
    for b, (gu, down) in enumerate(zip(pairs, downs, strict=True)):
        h_out, a, u, s, p = out[b]
        mm(h, gu, True, out=pair_view(a, u))
        kernels.silu_mul(a, u, s, p)
        acts.append((h, a, u, s, p))
        h = mm(p, down, True, out=h_out, add=h)
    return h, acts


# (block, matrix 0/1/2 = gate/up/down, A, B): that matrix's gradient is A^T B.
Factor = tuple[int, int, torch.Tensor, torch.Tensor]
GATE_UP = -1  # fused_backward's matrix index for gate and up together
ALL_BLOCKS = -1  # fused_backward's block index for every block


def backward_factors(
    weights: list[tuple[torch.Tensor, ...]],
    acts: Activations,
    dy: torch.Tensor,
    mm: MatMul = batched_mm,
) -> tuple[list[Factor], torch.Tensor]:
    """Every weight matrix's gradient factors and each group's squared gradient norm ``[B]``."""
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
    """:func:`backward_factors` in fewer launches (``dys[-1]``: the output gradient, ``dys[b]``
    written: block ``b``'s)."""
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
    """The matrices of ``t [S, P]`` a :func:`fused_backward` factor's gradient belongs to."""
    if block == ALL_BLOCKS:
        if matrix == GATE_UP:
            n, i, h = shape.block_numel, shape.intermediate_size, shape.hidden_size
            return t[:, : 2 * n].view(t.shape[0], 2 * shape.num_blocks, i, h)
        return split_params(t, shape)[matrix]
    if matrix == GATE_UP:
        return gate_up_pairs(t, shape)[block]
    return block_weights(t, shape)[block][matrix]

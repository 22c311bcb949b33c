"""The op ``tllm_esamp::block_backward``: the elementwise backward of one block ``h + (silu(a)
* u) @ down^T`` and its share of each group's squared gradient norm.
Here: schema, call, checks, PyTorch reference, Triton launch, bytes moved."""

from __future__ import annotations

import torch

from algorithms.esamp.kernels.checks import (
    FP32,
    NORM_TILE_ROWS,
    _fp32,
    _same_device,
    _shape,
    check_precision,
    norm_parts,
)
from algorithms.esamp.kernels.launch import Launch, cdiv, rows_block, runner

NAME = "block_backward"
SCHEMA = (
    "block_backward(Tensor dp, Tensor a, Tensor u, Tensor s, Tensor p, Tensor h_in, "
    "Tensor dy, Tensor(a!) du, Tensor(b!) da, Tensor(c!) parts, "
    "str input_precision='ieee') -> ()"
)


def block_backward(
    dp: torch.Tensor,
    a: torch.Tensor,
    u: torch.Tensor,
    s: torch.Tensor,
    p: torch.Tensor,
    h_in: torch.Tensor,
    dy: torch.Tensor,
    du: torch.Tensor,
    da: torch.Tensor,
    parts: torch.Tensor,
    *,
    input_precision: str = "ieee",
) -> None:
    """The elementwise backward of one block ``h + (silu(a) * u) @ down^T`` and its share of
    each group's squared gradient norm.

    ``dp`` (the gradient at ``p = s * u``), ``a``, ``u``, ``s = silu(a)``, ``p`` ``[G, M, I]``
    fp32 (the forward's activations), ``h_in`` (the block's input) and ``dy`` (the gradient
    at its output) ``[G, M, H]`` fp32. Writes ``du = dp * s``, ``da = dp * u * silu'(a)``
    ``[G, M, I]``, and ``parts [G, T]`` fp32 (``T >= norm_parts(M)``): columns summing to
    ``|dy^T p|^2 + |du^T h_in|^2 + |da^T h_in|^2`` (the block's down, up and gate gradients'
    squared norms, from ``M x M`` Gram matrices); how the sum is spread over the columns is
    the implementation's. Padding rows must be zero in ``dp``, ``p``, ``h_in`` and ``dy``.
    ``input_precision``: the Gram products' (:data:`INPUT_PRECISIONS`)."""
    torch.ops.tllm_esamp.block_backward(dp, a, u, s, p, h_in, dy, du, da, parts, input_precision)


def check_block_backward(dp, a, u, s, p, h_in, dy, du, da, parts, input_precision="ieee") -> None:
    """Raise ``ValueError`` naming the bad argument and what is allowed."""
    _same_device(dp=dp, a=a, u=u, s=s, p=p, h_in=h_in, dy=dy, du=du, da=da, parts=parts)
    if not (dp.dim() == 3 and dp.dtype == torch.float32):
        raise ValueError(f"dp must be [G, M, I] fp32, got {_shape(dp)}")
    g, rows, _ = dp.shape
    for name, t in (("a", a), ("u", u), ("s", s), ("p", p), ("du", du), ("da", da)):
        _fp32(name, t, tuple(dp.shape), "dp's shape")
    if not (h_in.dim() == 3 and h_in.dtype == torch.float32 and h_in.shape[:2] == dp.shape[:2]):
        raise ValueError(f"h_in must be [{g}, {rows}, H] fp32, got {_shape(h_in)}")
    _fp32("dy", dy, tuple(h_in.shape), "h_in's shape")
    need = norm_parts(rows)
    if not (parts.dim() == 2 and parts.shape[0] == g and parts.dtype == torch.float32):
        raise ValueError(f"parts must be [{g}, >= {need}] fp32, got {_shape(parts)}")
    if parts.shape[1] < need:
        raise ValueError(
            f"parts must have >= {need} columns for {rows} rows (norm_parts), got {_shape(parts)}"
        )
    check_precision(input_precision)


def reference(dp, a, u, s, p, h_in, dy, du, da, parts, input_precision="ieee") -> None:
    """The PyTorch reference of :func:`block_backward`: the whole share in ``parts[:, 0]``
    (the other columns 0)."""
    torch.mul(dp, s, out=du)
    sig = torch.sigmoid(a)
    torch.mul(dp * u * sig, 1 + a * (1 - sig), out=da)
    gram_in = torch.bmm(h_in, h_in.transpose(1, 2))
    gram_g = torch.bmm(du, du.transpose(1, 2)) + torch.bmm(da, da.transpose(1, 2))
    sq = (torch.bmm(dy, dy.transpose(1, 2)) * torch.bmm(p, p.transpose(1, 2))).sum((1, 2))
    sq += (gram_g * gram_in).sum((1, 2))
    parts.zero_()
    parts[:, 0] = sq


def block_backward_launch(
    dp, a, u, s, p, h_in, dy, du, da, parts, input_precision="ieee",
    *, block_m: int | None = None, block_i: int = 32, block_h: int = 64, num_warps: int | None = None,
) -> Launch | None:  # fmt: skip
    """The block backward kernel's launch: per group one program per column of ``parts``:
    each pair of row tiles over as many shares of H as the columns allow (at most one per
    ``block_h`` columns of H), the columns past them written 0. Arguments as
    :func:`algorithms.esamp.kernels.block_backward`; the caller has checked them."""
    check_precision(input_precision)
    groups, rows, _ = dp.shape
    if groups == 0:
        return None
    block_m = block_m or min(NORM_TILE_ROWS, rows_block(rows))
    # Four [block_m, block_m] Gram tiles live across the loops: more warps for larger tiles
    # (compiled for sm_90 without spills).
    num_warps = num_warps or (4 if block_m <= 16 else 8)
    tiles = cdiv(max(rows, 1), block_m) ** 2
    if tiles > parts.shape[1]:
        raise ValueError(
            f"parts has {parts.shape[1]} columns, {tiles} row-tile pairs need one each"
        )
    hidden = h_in.shape[2]
    split_h = max(1, min(parts.shape[1] // tiles, cdiv(hidden, block_h)))
    args = (
        dp, a, u, s, p, h_in, dy, du, da, parts,
        rows, dp.shape[2], hidden, split_h,
        *dp.stride(), *a.stride(), *u.stride(), *s.stride(), *p.stride(),
        *h_in.stride(), *dy.stride(), *du.stride(), *da.stride(), *parts.stride(),
    )  # fmt: skip
    consts = dict(
        BLOCK_M=block_m, BLOCK_I=block_i, BLOCK_H=block_h, INPUT_PRECISION=input_precision
    )
    return Launch("block_backward", (parts.shape[1], groups), args, consts, num_warps)


run_triton = runner(block_backward_launch)


def block_backward_bytes(groups: int, rows: int, inter: int, hidden: int, parts: int) -> int:
    """``block_backward``: ``dp``, ``a``, ``u``, ``s``, ``p`` read and ``du``, ``da`` written
    (``[rows, inter]`` each), ``h_in`` and ``dy`` read (``[rows, hidden]``) per group (a
    group's row tiles re-read them from L2, not DRAM), its norm parts written."""
    per_group = (7 * rows * inter + 2 * rows * hidden + parts) * FP32
    return groups * per_group


def _traffic(dp, a, u, s, p, h_in, dy, du, da, parts, *args, **kwargs) -> int:
    groups, rows, inter = dp.shape
    return block_backward_bytes(groups, rows, inter, h_in.shape[2], parts.shape[1])

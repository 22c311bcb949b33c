"""The op ``tllm_esamp::block_backward``: the elementwise backward of one block ``h + (silu(a)
* u) @ down^T`` and its share of each group's squared gradient norm."""

from __future__ import annotations

import torch

from algorithms.esamp.kernels.checks import (
    FP32,
    NORM_TILE_ROWS,
    _expect,
    _fp32,
    _same_device,
    _shape,
    check_precision,
    norm_parts,
)
from algorithms.esamp.kernels.launch import Launch, cdiv, rows_block, runner

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
    """The elementwise backward of one block ``h + (silu(a) * u) @ down^T``: ``du = dp * s``,
    ``da = dp * u * silu'(a)`` (``[G, M, I]`` fp32, as ``a``, ``u``, ``s``, ``p``), and
    ``parts [G, T >= norm_parts(M)]`` summing to ``|dy^T p|^2 + |du^T h_in|^2 + |da^T
    h_in|^2`` (from ``M x M`` Gram matrices). Padding rows must be zero."""
    torch.ops.tllm_esamp.block_backward(dp, a, u, s, p, h_in, dy, du, da, parts, input_precision)


def check_block_backward(dp, a, u, s, p, h_in, dy, du, da, parts, input_precision="ieee") -> None:
    """Raise ``ValueError`` naming the bad argument and what is allowed."""
    _same_device(dp=dp, a=a, u=u, s=s, p=p, h_in=h_in, dy=dy, du=du, da=da, parts=parts)
    _expect("dp", dp, dp.dim() == 3 and dp.dtype == torch.float32, "[G, M, I] fp32")
    g, rows, _ = dp.shape
    for name, t in (("a", a), ("u", u), ("s", s), ("p", p), ("du", du), ("da", da)):
        _fp32(name, t, tuple(dp.shape), "dp's shape")
    ok = h_in.dim() == 3 and h_in.dtype == torch.float32 and h_in.shape[:2] == dp.shape[:2]
    _expect("h_in", h_in, ok, "[{}, {}, H] fp32", g, rows)
    _fp32("dy", dy, tuple(h_in.shape), "h_in's shape")
    need = norm_parts(rows)
    ok = parts.dim() == 2 and parts.shape[0] == g and parts.dtype == torch.float32
    _expect("parts", parts, ok, "[{}, >= {}] fp32", g, need)
    if parts.shape[1] < need:
        raise ValueError(
            f"parts must have >= {need} columns for {rows} rows (norm_parts), got {_shape(parts)}"
        )
    check_precision(input_precision)


def reference(dp, a, u, s, p, h_in, dy, du, da, parts, input_precision="ieee") -> None:
    """The PyTorch reference of :func:`block_backward` (the share in ``parts[:, 0]``)."""
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
    """The block backward kernel's launch: one program per column of ``parts`` (a pair of
    row tiles and a share of H; unused columns written 0)."""
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
    """``block_backward``: seven ``[rows, inter]`` and two ``[rows, hidden]`` tensors, parts."""
    per_group = (7 * rows * inter + 2 * rows * hidden + parts) * FP32
    return groups * per_group


def _traffic(dp, a, u, s, p, h_in, dy, du, da, parts, *args, **kwargs) -> int:
    groups, rows, inter = dp.shape
    return block_backward_bytes(groups, rows, inter, h_in.shape[2], parts.shape[1])

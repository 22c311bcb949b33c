"""The op ``tllm_esamp::slot_matmul``: each packed group's product with its own slot of the
stacked weights."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from algorithms.esamp.kernels.checks import (
    FP32,
    _expect,
    _fp32,
    _same_device,
    _shape,
    _slot_vector,
    check_precision,
)
from algorithms.esamp.kernels.launch import Launch, cdiv, rows_block, triton_impl

SCHEMA = (
    "slot_matmul(Tensor x, Tensor w, Tensor group_slot, Tensor(a!) out, bool transpose_w=True, "
    "str input_precision='ieee', int split_k=0, Tensor? add=None) -> ()"
)


def slot_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    group_slot: torch.Tensor,
    out: torch.Tensor,
    *,
    transpose_w: bool = True,
    input_precision: str = "ieee",
    split_k: int = 0,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[g] = x[g] @ w[s]^T`` (``transpose_w``; else ``x[g] @ w[s]``) for ``s =
    group_slot[g]``, 0 where ``s < 0``; returns ``out``. ``x [G, M, K]``, ``out [G, M, N]``
    fp32. Several matrices at once: ``w [S, E, ., .]`` with ``x`` shared or ``[G, E, M, K]``,
    into ``out [G, E, M, N]`` or their sum ``[G, M, N]``. ``add``: added to ``out`` (not
    aliasing it). ``split_k`` (CUDA): K over that many programs summed atomically (run-to-run
    rounding differences); 0 picks it from the SM count, 1 is deterministic."""
    torch.ops.tllm_esamp.slot_matmul(
        x, w, group_slot, out, transpose_w, input_precision, split_k, add
    )
    return out


def check_slot_matmul(
    x, w, group_slot, out, transpose_w, input_precision, split_k=0, add=None
) -> None:
    """Raise ``ValueError`` naming the bad argument and what is allowed."""
    extra = {} if add is None else {"add": add}
    _same_device(x=x, w=w, group_slot=group_slot, out=out, **extra)
    layout = "[S, N, K]" if transpose_w else "[S, K, N]"
    ok = w.dim() in (3, 4) and w.dtype == torch.float32
    _expect("w", w, ok, "{} or [S, E, ...] fp32 (transpose_w={})", layout, transpose_w)
    e = w.shape[1] if w.dim() == 4 else None
    ok = x.dim() == 3 or (e is not None and x.dim() == 4 and x.shape[1] == e)
    want = "[G, M, K] fp32" if e is None else "[G, M, K] or [G, {}, M, K] fp32"
    _expect("x", x, ok and x.dtype == torch.float32, want, e)
    g, rows, k = x.shape[0], x.shape[-2], x.shape[-1]
    w_k = w.shape[-1] if transpose_w else w.shape[-2]
    n = w.shape[-2] if transpose_w else w.shape[-1]
    want = "{} with K={} (x's last dim; transpose_w={})"
    _expect("w", w, w_k == k, want, layout, k, transpose_w)
    shapes = [(g, rows, n)] + ([] if e is None else [(g, e, rows, n)])
    ok = tuple(out.shape) in shapes and out.dtype == torch.float32
    _expect("out", out, ok, "{} fp32" if e is None else "{} or {} fp32", *shapes)
    if add is not None:
        _fp32("add", add, (g, rows, n), "the summed out")
    if add is not None and out.dim() != 3:
        raise ValueError(f"add needs out [{g}, {rows}, {n}] (summed over E), got {_shape(out)}")
    # Split-K zeroes out before adding into it: an addend in the same memory would be lost.
    if add is not None and not out.is_meta and add.data_ptr() == out.data_ptr():
        raise ValueError("add must not be out (out is zeroed before the sum with split_k > 1)")
    _slot_vector(group_slot, g)
    check_precision(input_precision)
    if split_k < 0:
        raise ValueError(f"split_k must be >= 0 (0: automatic), got {split_k}")


def reference(
    x, w, group_slot, out, transpose_w=True, input_precision="ieee", split_k=0, add=None
) -> None:
    """The PyTorch reference of :func:`slot_matmul`: one ``bmm`` per matrix."""
    if w.shape[0] == 0:
        out.zero_()
        if add is not None:
            out.add_(add)
        return
    live = (group_slot >= 0)[:, None, None]
    idx = group_slot.clamp(min=0)
    ys = []
    for e in range(w.shape[1] if w.dim() == 4 else 1):
        ws = (w if w.dim() == 3 else w[:, e]).index_select(0, idx)
        xe = x if x.dim() == 3 else x[:, e]
        ys.append(torch.where(live, torch.bmm(xe, ws.transpose(1, 2) if transpose_w else ws), 0.0))
    y = sum(ys[1:], ys[0]) if out.dim() == 3 else torch.stack(ys, 1)
    if add is not None:
        y = add + y
    out.copy_(y)


def slot_matmul_launch(
    x, w, group_slot, out, transpose_w=True, input_precision="ieee", split_k=0, add=None,
    *, block_n: int = 64, block_k: int = 64, num_warps: int = 4,
) -> Launch | None:  # fmt: skip
    """The slot-indexed matmul's launch (None: nothing to launch); with ``split_k > 1`` the
    kernel adds into ``out``, which must be zero first (:func:`run_triton` zeroes it)."""
    if split_k < 0:  # launched directly too (rehearsal, compile checks)
        raise ValueError(f"split_k must be >= 0 (0: automatic), got {split_k}")
    w4 = w if w.dim() == 4 else w.unsqueeze(1)
    e = w4.shape[1]
    x4 = x if x.dim() == 4 else x.unsqueeze(1).expand(x.shape[0], e, *x.shape[1:])
    reduce_e = out.dim() == 3 and w.dim() == 4
    o4 = out.unsqueeze(1) if out.dim() == 3 else out
    groups, _, rows, k = x4.shape
    n = o4.shape[3]
    if groups == 0 or rows == 0 or n == 0 or k == 0:
        return None
    block_m = rows_block(rows)
    tiles = cdiv(rows, block_m) * cdiv(n, block_n)
    if split_k == 0:  # about two programs per SM (every SM must stream weights)
        programs = tiles * groups * (1 if reduce_e else e)
        want = cdiv(2 * triton_impl()._sm_count(x.device), max(programs, 1))
        split_k = max(1, min(want, cdiv(k, block_k), 32))
    # w[s, e] as a [K, N] operand: transpose_w reads w [S, E, N, K] with its strides swapped.
    s_ws, s_we, s_w1, s_w2 = w4.stride()
    s_wk, s_wn = (s_w2, s_w1) if transpose_w else (s_w1, s_w2)
    c = add if add is not None else out
    s_c = c.stride()[-3:] if add is not None else (0, 0, 0)
    args = (
        x4, w4, group_slot, o4, c,
        rows, n, k, e,
        *x4.stride(), s_ws, s_we, s_wk, s_wn, *o4.stride(), *s_c,
    )  # fmt: skip
    consts = dict(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        INPUT_PRECISION=input_precision,
        REDUCE_E=reduce_e,
        HAS_ADD=add is not None,
    )
    grid = (tiles, groups, split_k * (1 if reduce_e else e))
    return Launch("slot_matmul", grid, args, consts, num_warps)


def run_triton(
    x: torch.Tensor,
    w: torch.Tensor,
    group_slot: torch.Tensor,
    out: torch.Tensor,
    *args: Any,
    kernels: SimpleNamespace | None = None,
    **kwargs: Any,
) -> None:
    """Run the slot-indexed matmul; zeroes ``out`` first where the kernel adds into it."""
    launch = slot_matmul_launch(x, w, group_slot, out, *args, **kwargs)
    if launch is None or launch.constexprs["SPLIT_K"] > 1:
        out.zero_()
        add = kwargs.get("add", args[3] if len(args) > 3 else None)
        if launch is None and add is not None:
            out.copy_(add)
    if launch is not None:
        launch.run(kernels)


def slot_matmul_bytes(
    groups: int,
    rows: int,
    n: int,
    k: int,
    matrices: int = 1,
    *,
    shared_x: bool = True,
    summed: bool = False,
    add: bool = False,
) -> int:
    """Bytes one ``slot_matmul`` call moves: weights, ``x`` and ``add`` read once, ``out``
    written once."""
    e = matrices
    x_reads = 1 if shared_x else e
    outs = 1 if summed else e
    per_group = e * n * k + x_reads * rows * k + outs * rows * n + (rows * n if add else 0)
    return groups * per_group * FP32 + groups * 8


def _traffic(
    x, w, group_slot, out, transpose_w=True, input_precision="ieee", split_k=0, add=None
) -> int:
    groups, rows, k = x.shape[0], x.shape[-2], x.shape[-1]
    e = w.shape[1] if w.dim() == 4 else 1
    return slot_matmul_bytes(
        groups, rows, out.shape[-1], k, e,
        shared_x=x.dim() == 3, summed=out.dim() == 3, add=add is not None,
    )  # fmt: skip

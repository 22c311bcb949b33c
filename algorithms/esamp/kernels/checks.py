"""Argument checks shared by every implementation of the kernels' ops (metadata only: no
device reads, so they are safe inside a CUDA graph capture)."""

from __future__ import annotations

import torch

# tl.dot's choices for fp32 inputs: exact fp32 ("ieee"), TF32 tensor cores ("tf32"), or
# three TF32 products that recover about fp32 accuracy ("tf32x3").
INPUT_PRECISIONS = ("ieee", "tf32", "tf32x3")
MOMENT_DTYPES = (torch.float32, torch.bfloat16)
# An LM head's weight dtypes (candidate_dot upcasts each element to fp32).
HEAD_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SLOT_DTYPES = (torch.int32, torch.int64)


def check_precision(input_precision: str) -> None:
    if input_precision not in INPUT_PRECISIONS:
        raise ValueError(
            f"input_precision {input_precision!r} is not one of {', '.join(INPUT_PRECISIONS)}"
        )


def _shape(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _same_device(**tensors: torch.Tensor) -> None:
    first = next(iter(tensors.values())).device
    if any(t.device != first for t in tensors.values()):
        devices = {n: str(t.device) for n, t in tensors.items()}
        raise ValueError(f"tensors on different devices: {devices}")


def _group_vector(name: str, t: torch.Tensor, groups: int) -> None:
    if t.dim() != 1 or t.shape[0] != groups:
        raise ValueError(f"{name} must be [{groups}], got {_shape(t)}")


def _slot_vector(group_slot: torch.Tensor, groups: int) -> None:
    # Each group's slot (-1: none).
    _group_vector("group_slot", group_slot, groups)
    if group_slot.dtype not in _SLOT_DTYPES:
        raise ValueError(f"group_slot must be int32 or int64, got {_shape(group_slot)}")


def check_grad_adam(
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    group_slot: torch.Tensor,
    ok: torch.Tensor,
    step: torch.Tensor,
    w: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    input_precision: str,
) -> None:
    """Raise ``ValueError`` naming the bad argument and what is allowed."""
    _same_device(a=a, b=b, scale=scale, group_slot=group_slot, ok=ok, step=step, w=w, m=m, v=v)
    if not (a.dim() in (3, 4) and a.dtype == torch.float32):
        raise ValueError(f"a must be [G, M, N] or [G, E, M, N] fp32, got {_shape(a)}")
    e = a.shape[1] if a.dim() == 4 else None  # E matrices of a slot at once
    g, rows, n = a.shape[0], a.shape[-2], a.shape[-1]
    b_ok = b.dim() == 3 and tuple(b.shape[:2]) == (g, rows)
    b_ok = b_ok or (
        e is not None
        and b.dim() == 4
        and (b.shape[0], b.shape[2]) == (g, rows)
        and b.shape[1] >= 1
        and e % b.shape[1] == 0
    )
    if not (b_ok and b.dtype == torch.float32):
        also = "" if e is None else f" or [{g}, E_b, {rows}, K] with {e} % E_b == 0"
        raise ValueError(
            f"b must be [{g}, {rows}, K]{also} fp32 (a is {_shape(a)}), got {_shape(b)}"
        )
    k = b.shape[-1]
    mats = "" if e is None else f"{e}, "
    if not (w.dim() == (3 if e is None else 4) and w.dtype == torch.float32):
        raise ValueError(f"w must be [S, {mats}N, K] fp32, got {_shape(w)}")
    slots = w.shape[0]
    if tuple(w.shape[1:]) != ((n, k) if e is None else (e, n, k)):
        raise ValueError(f"w must be [S, {mats}{n}, {k}] (a^T b's shape), got {_shape(w)}")
    for name, t in (("m", m), ("v", v)):
        if not (tuple(t.shape) == tuple(w.shape) and t.dtype in MOMENT_DTYPES):
            raise ValueError(
                f"{name} must be {list(w.shape)} fp32 or bf16 (w's shape), got {_shape(t)}"
            )
    _group_vector("scale", scale, g)
    if scale.dtype != torch.float32:
        raise ValueError(f"scale must be fp32, got {_shape(scale)}")
    _slot_vector(group_slot, g)
    _group_vector("ok", ok, g)
    if not (step.dim() == 1 and step.shape[0] == slots and step.dtype == torch.float32):
        raise ValueError(
            f"step must be [{slots}] fp32 (one count per slot of w), got {_shape(step)}"
        )
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {beta}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    check_precision(input_precision)


def check_slot_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    group_slot: torch.Tensor,
    out: torch.Tensor,
    transpose_w: bool,
    input_precision: str,
    split_k: int = 0,
    add: torch.Tensor | None = None,
) -> None:
    """Raise ``ValueError`` naming the bad argument and what is allowed."""
    extra = {} if add is None else {"add": add}
    _same_device(x=x, w=w, group_slot=group_slot, out=out, **extra)
    layout = "[S, N, K]" if transpose_w else "[S, K, N]"
    if not (w.dim() in (3, 4) and w.dtype == torch.float32):
        raise ValueError(
            f"w must be {layout} or [S, E, ...] fp32 (transpose_w={transpose_w}), got {_shape(w)}"
        )
    e = w.shape[1] if w.dim() == 4 else None
    if not (x.dim() == 3 or (e is not None and x.dim() == 4 and x.shape[1] == e)):
        want = "[G, M, K]" + ("" if e is None else f" or [G, {e}, M, K]")
        raise ValueError(f"x must be {want} fp32, got {_shape(x)}")
    if x.dtype != torch.float32:
        raise ValueError(f"x must be fp32, got {_shape(x)}")
    g, rows, k = x.shape[0], x.shape[-2], x.shape[-1]
    w_k = w.shape[-1] if transpose_w else w.shape[-2]
    n = w.shape[-2] if transpose_w else w.shape[-1]
    if w_k != k:
        raise ValueError(
            f"w must be {layout} with K={k} (x's last dim; transpose_w={transpose_w}), got {_shape(w)}"
        )
    shapes = [(g, rows, n)] + ([] if e is None else [(g, e, rows, n)])
    if not (tuple(out.shape) in shapes and out.dtype == torch.float32):
        want = " or ".join(str(list(sh)) for sh in shapes)
        raise ValueError(f"out must be {want} fp32, got {_shape(out)}")
    if add is not None and not (tuple(add.shape) == (g, rows, n) and add.dtype == torch.float32):
        raise ValueError(f"add must be [{g}, {rows}, {n}] fp32 (the summed out), got {_shape(add)}")
    if add is not None and out.dim() != 3:
        raise ValueError(f"add needs out [{g}, {rows}, {n}] (summed over E), got {_shape(out)}")
    # Split-K zeroes out before adding into it: an addend in the same memory would be lost.
    if add is not None and not out.is_meta and add.data_ptr() == out.data_ptr():
        raise ValueError("add must not be out (out is zeroed before the sum with split_k > 1)")
    _slot_vector(group_slot, g)
    check_precision(input_precision)
    if split_k < 0:
        raise ValueError(f"split_k must be >= 0 (0: automatic), got {split_k}")


def check_candidate_dot(
    weight: torch.Tensor,
    f: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Raise ``ValueError`` naming the bad argument and what is allowed. Index values are not
    checked (that would read the device): they must lie in ``[0, R)`` and ``[0, V)``."""
    _same_device(weight=weight, f=f, rows=rows, tokens=tokens, out=out)
    if not (weight.dim() == 2 and weight.dtype in HEAD_DTYPES):
        raise ValueError(
            f"weight must be [V, H] float16, bfloat16 or float32, got {_shape(weight)}"
        )
    h = weight.shape[1]
    if not (f.dim() == 2 and f.dtype == torch.float32 and f.shape[1] == h):
        raise ValueError(f"f must be [R, {h}] fp32 (H of weight), got {_shape(f)}")
    # Rows are gathered as contiguous runs of H elements (vector loads on the GPU).
    for name, t in (("weight", weight), ("f", f)):
        if h > 1 and t.stride(1) != 1:
            raise ValueError(
                f"{name} must have unit stride along H (any row stride), got strides {t.stride()}"
            )
    if not (tokens.dim() == 1 and tokens.dtype in _SLOT_DTYPES):
        raise ValueError(f"tokens must be [N] int32 or int64, got {_shape(tokens)}")
    n = tokens.shape[0]
    if not (rows.dim() == 1 and rows.dtype in _SLOT_DTYPES and rows.shape[0] == n):
        raise ValueError(f"rows must be [{n}] int32 or int64 (one per token), got {_shape(rows)}")
    if not (out.dim() == 1 and out.shape[0] == n and out.dtype == torch.float32):
        raise ValueError(f"out must be [{n}] fp32 (one per token), got {_shape(out)}")
    if n > 0 and (weight.shape[0] == 0 or f.shape[0] == 0):
        raise ValueError(f"{n} pairs index an empty table: weight {_shape(weight)}, f {_shape(f)}")


# block_backward: rows are tiled by up to this many for the Gram matrices; each pair of row
# tiles of a group writes one column of the norm parts.
NORM_TILE_ROWS = 32
LOSS_REDUCTIONS = ("mean", "sum")


# block_backward: hidden columns per program (norm_parts with a hidden size: the columns
# that let a group's row-tile pairs spread over that many programs).
NORM_CHUNK_HIDDEN = 512


def norm_parts(rows: int, hidden: int = 0) -> int:
    """Columns of ``block_backward``'s norm parts for groups of ``rows`` rows: at least one
    per pair of row tiles; with ``hidden``, enough for each pair to split the hidden size
    over programs of ``NORM_CHUNK_HIDDEN`` columns (more programs on the GPU)."""
    tiles = max(1, -(-rows // NORM_TILE_ROWS))
    return tiles * tiles * max(1, -(-hidden // NORM_CHUNK_HIDDEN))


def _fp32(name: str, t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if not (tuple(t.shape) == shape and t.dtype == torch.float32):
        raise ValueError(f"{name} must be {list(shape)} fp32 ({what}), got {_shape(t)}")


def _row_mask(mask: torch.Tensor, groups: int, rows: int) -> None:
    if not (tuple(mask.shape) == (groups, rows) and mask.dtype == torch.bool):
        raise ValueError(f"mask must be [{groups}, {rows}] bool, got {_shape(mask)}")


def check_loss_dy(
    h: torch.Tensor,
    tp: torch.Tensor,
    mask: torch.Tensor,
    parts: torch.Tensor,
    dy: torch.Tensor,
    reduction: str,
) -> None:
    """Raise ``ValueError`` naming the bad argument and what is allowed."""
    _same_device(h=h, tp=tp, mask=mask, parts=parts, dy=dy)
    if not (h.dim() == 3 and h.dtype == torch.float32):
        raise ValueError(f"h must be [G, M, H] fp32, got {_shape(h)}")
    g, rows, _ = h.shape
    _fp32("tp", tp, tuple(h.shape), "h's shape")
    _fp32("dy", dy, tuple(h.shape), "h's shape")
    if not (
        parts.dim() == 2
        and parts.shape[0] == g
        and parts.shape[1] >= 1
        and parts.dtype == torch.float32
    ):
        raise ValueError(f"parts must be [{g}, L >= 1] fp32 (the loss parts), got {_shape(parts)}")
    _row_mask(mask, g, rows)
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss reduction must be 'mean' or 'sum', got {reduction!r}")


def check_block_backward(
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
    input_precision: str = "ieee",
) -> None:
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


def check_update_tail(
    loss_parts: torch.Tensor,
    parts: torch.Tensor,
    group_slot: torch.Tensor,
    mask: torch.Tensor,
    step: torch.Tensor,
    applied: torch.Tensor | None,
    losses: torch.Tensor,
    ok: torch.Tensor,
    scale: torch.Tensor,
    norm: torch.Tensor,
    grad_clip: float,
    clip_eps: float,
) -> None:
    """Raise ``ValueError`` naming the bad argument and what is allowed."""
    tensors = dict(loss_parts=loss_parts, parts=parts, group_slot=group_slot, mask=mask)
    tensors.update(step=step, losses=losses, ok=ok, scale=scale, norm=norm)
    if applied is not None:
        tensors["applied"] = applied
    _same_device(**tensors)
    if not (mask.dim() == 2 and mask.dtype == torch.bool):
        raise ValueError(f"mask must be [G, M] bool, got {_shape(mask)}")
    g = mask.shape[0]
    for name, t in (("loss_parts", loss_parts), ("parts", parts)):
        if not (t.dim() == 2 and t.shape[0] == g and t.dtype == torch.float32):
            raise ValueError(f"{name} must be [{g}, K] fp32, got {_shape(t)}")
    _slot_vector(group_slot, g)
    if not (step.dim() == 1 and step.dtype == torch.float32):
        raise ValueError(f"step must be [S] fp32, got {_shape(step)}")
    if applied is not None and not (
        tuple(applied.shape) == tuple(step.shape) and applied.dtype == torch.int64
    ):
        raise ValueError(
            f"applied must be {list(step.shape)} int64 (step's), got {_shape(applied)}"
        )
    if not (tuple(ok.shape) == (g,) and ok.dtype == torch.bool):
        raise ValueError(f"ok must be [{g}] bool, got {_shape(ok)}")
    _fp32("losses", losses, (g,), "one per group")
    _fp32("scale", scale, (g,), "one per group")
    _fp32("norm", norm, (g,), "one per group")
    if not clip_eps >= 0:
        raise ValueError(f"clip_eps must be >= 0, got {clip_eps}")


def check_silu_mul(a: torch.Tensor, u: torch.Tensor, s: torch.Tensor, p: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the bad argument and what is allowed."""
    _same_device(a=a, u=u, s=s, p=p)
    if not (a.dim() == 3 and a.dtype == torch.float32):
        raise ValueError(f"a must be [G, M, I] fp32, got {_shape(a)}")
    for name, t in (("u", u), ("s", s), ("p", p)):
        _fp32(name, t, tuple(a.shape), "a's shape")


def check_stale_max(
    submitted: torch.Tensor, applied: torch.Tensor, group_slot: torch.Tensor, stale: torch.Tensor
) -> None:
    """Raise ``ValueError`` naming the bad argument and what is allowed."""
    _same_device(submitted=submitted, applied=applied, group_slot=group_slot, stale=stale)
    if not (submitted.dim() == 1 and submitted.dtype == torch.int64):
        raise ValueError(f"submitted must be [G] int64, got {_shape(submitted)}")
    _slot_vector(group_slot, submitted.shape[0])
    if not (applied.dim() == 1 and applied.dtype == torch.int64):
        raise ValueError(f"applied must be [S] int64, got {_shape(applied)}")
    if not (tuple(stale.shape) == (1,) and stale.dtype == torch.int64):
        raise ValueError(f"stale must be [1] int64, got {_shape(stale)}")

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
    if not (a.dim() == 3 and a.dtype == torch.float32):
        raise ValueError(f"a must be [G, M, N] fp32, got {_shape(a)}")
    g, rows, n = a.shape
    if not (b.dim() == 3 and b.dtype == torch.float32 and tuple(b.shape[:2]) == (g, rows)):
        raise ValueError(f"b must be [{g}, {rows}, K] fp32 (a is {_shape(a)}), got {_shape(b)}")
    k = b.shape[2]
    if not (w.dim() == 3 and w.dtype == torch.float32):
        raise ValueError(f"w must be [S, N, K] fp32, got {_shape(w)}")
    slots = w.shape[0]
    if tuple(w.shape[1:]) != (n, k):
        raise ValueError(f"w must be [S, {n}, {k}] (a^T b's shape), got {_shape(w)}")
    for name, t in (("m", m), ("v", v)):
        if not (tuple(t.shape) == tuple(w.shape) and t.dtype in MOMENT_DTYPES):
            raise ValueError(
                f"{name} must be {list(w.shape)} fp32 or bf16 (w's shape), got {_shape(t)}"
            )
    _group_vector("scale", scale, g)
    if scale.dtype != torch.float32:
        raise ValueError(f"scale must be fp32, got {_shape(scale)}")
    _group_vector("group_slot", group_slot, g)
    if group_slot.dtype not in _SLOT_DTYPES:
        raise ValueError(f"group_slot must be int32 or int64, got {_shape(group_slot)}")
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
) -> None:
    """Raise ``ValueError`` naming the bad argument and what is allowed."""
    _same_device(x=x, w=w, group_slot=group_slot, out=out)
    if not (x.dim() == 3 and x.dtype == torch.float32):
        raise ValueError(f"x must be [G, M, K] fp32, got {_shape(x)}")
    g, rows, k = x.shape
    layout = "[S, N, K]" if transpose_w else "[S, K, N]"
    if not (w.dim() == 3 and w.dtype == torch.float32):
        raise ValueError(f"w must be {layout} fp32 (transpose_w={transpose_w}), got {_shape(w)}")
    w_k = w.shape[2] if transpose_w else w.shape[1]
    n = w.shape[1] if transpose_w else w.shape[2]
    if w_k != k:
        raise ValueError(
            f"w must be {layout} with K={k} (x's last dim; transpose_w={transpose_w}), got {_shape(w)}"
        )
    if not (tuple(out.shape) == (g, rows, n) and out.dtype == torch.float32):
        raise ValueError(f"out must be [{g}, {rows}, {n}] fp32, got {_shape(out)}")
    _group_vector("group_slot", group_slot, g)
    if group_slot.dtype not in _SLOT_DTYPES:
        raise ValueError(f"group_slot must be int32 or int64, got {_shape(group_slot)}")
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

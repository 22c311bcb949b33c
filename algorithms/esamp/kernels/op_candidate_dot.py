"""The op ``tllm_esamp::candidate_dot``: guidance's dist logit ``W[token] . f[row]`` of each
(row, token) pair, in fp32."""

from __future__ import annotations

import torch

from algorithms.esamp.kernels.checks import (
    _SLOT_DTYPES,
    FP32,
    HEAD_DTYPES,
    _expect,
    _fp32,
    _same_device,
    _shape,
)
from algorithms.esamp.kernels.launch import Launch, cdiv, runner

SCHEMA = "candidate_dot(Tensor weight, Tensor f, Tensor rows, Tensor tokens, Tensor(a!) out) -> ()"


def candidate_dot(
    weight: torch.Tensor,
    f: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out[j] = sum_h float(weight[tokens[j], h]) * f[rows[j], h]`` in fp32; returns ``out``.
    ``weight [V, H]`` (:data:`HEAD_DTYPES`), ``f [R, H]`` fp32, both unit stride along H;
    ``rows``, ``tokens`` ``[N]`` int; indices unchecked (a host read): in ``[0, R)``, ``[0, V)``."""
    torch.ops.tllm_esamp.candidate_dot(weight, f, rows, tokens, out)
    return out


def check_candidate_dot(weight, f, rows, tokens, out) -> None:
    """Raise ``ValueError`` naming the bad argument and what is allowed."""
    _same_device(weight=weight, f=f, rows=rows, tokens=tokens, out=out)
    ok = weight.dim() == 2 and weight.dtype in HEAD_DTYPES
    _expect("weight", weight, ok, "[V, H] float16, bfloat16 or float32")
    h = weight.shape[1]
    ok = f.dim() == 2 and f.dtype == torch.float32 and f.shape[1] == h
    _expect("f", f, ok, "[R, {}] fp32 (H of weight)", h)
    # Rows are gathered as contiguous runs of H elements (vector loads on the GPU).
    for name, t in (("weight", weight), ("f", f)):
        if h > 1 and t.stride(1) != 1:
            raise ValueError(
                f"{name} must have unit stride along H (any row stride), got strides {t.stride()}"
            )
    ok = tokens.dim() == 1 and tokens.dtype in _SLOT_DTYPES
    _expect("tokens", tokens, ok, "[N] int32 or int64")
    n = tokens.shape[0]
    ok = rows.dim() == 1 and rows.dtype in _SLOT_DTYPES and rows.shape[0] == n
    _expect("rows", rows, ok, "[{}] int32 or int64 (one per token)", n)
    _fp32("out", out, (n,), "one per token")
    if n > 0 and (weight.shape[0] == 0 or f.shape[0] == 0):
        raise ValueError(f"{n} pairs index an empty table: weight {_shape(weight)}, f {_shape(f)}")


# Pairs gathered at once: bounds the fallback's temporaries to chunk x H.
CANDIDATE_CHUNK = 4096


def reference(weight, f, rows, tokens, out, chunk=CANDIDATE_CHUNK) -> None:
    """The PyTorch reference of :func:`candidate_dot`, ``chunk`` pairs at a time."""
    for i in range(0, tokens.shape[0], chunk):
        w = weight.index_select(0, tokens[i : i + chunk]).float()
        w.mul_(f.index_select(0, rows[i : i + chunk]))
        torch.sum(w, -1, out=out[i : i + chunk])


def candidate_dot_launch(
    weight, f, rows, tokens, out, *, block_p=4, block_h=512, num_warps=4
) -> Launch | None:
    """The candidate dot kernel's launch (None: no pairs; ``H = 0`` writes zeros)."""
    n, h = tokens.shape[0], weight.shape[1]
    if n == 0:
        return None
    args = (
        weight, f, rows, tokens, out,
        n, h,
        weight.stride(0), f.stride(0), rows.stride(0), tokens.stride(0), out.stride(0),
    )  # fmt: skip
    consts = dict(BLOCK_P=block_p, BLOCK_H=block_h)
    return Launch("candidate_dot", (cdiv(n, block_p),), args, consts, num_warps)


run_triton = runner(candidate_dot_launch)


def candidate_dot_bytes(n: int, h: int, weight_bytes: int, f_rows: int = 0) -> int:
    """Bytes one ``candidate_dot`` call moves: each pair's head row, indices and result, and
    the prediction ``f [f_rows, h]`` once."""
    return n * h * weight_bytes + n * (8 + 8 + FP32) + f_rows * h * FP32


def _traffic(weight, f, rows, tokens, out, *args, **kwargs) -> int:
    return candidate_dot_bytes(tokens.numel(), weight.shape[-1], weight.element_size(), f.shape[0])

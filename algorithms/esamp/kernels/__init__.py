"""ESamp's fused GPU kernels, as torch operators (``torch.ops.tllm_esamp``; a dispatch mode
sees each call as one op):

- :func:`grad_adam`: each group's weight gradient ``scale * a^T b`` formed tile by tile in
  registers and consumed at once by an Adam step of that group's slot (never stored), so
  the update moves each parameter and its moments once: 24 bytes per parameter with fp32
  moments, 16 with bf16 (:func:`grad_adam_bytes`);
- :func:`slot_matmul`: ``out[g] = x[g] @ w[slot[g]]^T`` (or ``@ w[slot[g]]``) reading only
  the listed slots' weights, out= style (no allocation);
- :func:`candidate_dot`: guidance's dist logits for (row, token) pairs,
  ``out[j] = W[tokens[j]] . f[rows[j]]`` in fp32, reading each pair's head row once in its
  own dtype (no gathered or upcast copy), out= style (:func:`candidate_dot_bytes`).

The first two take ``w`` (and ``m``/``v``) as strided views into the slots' flat ``[S, P]``
state rows. CUDA runs Triton kernels (Triton is imported only there); CPU and meta run the
PyTorch reference and a no-op. Importing this package needs neither Triton nor a GPU.
"""

from __future__ import annotations

import torch

from algorithms.esamp.kernels import ops  # noqa: F401  (defines the ops)
from algorithms.esamp.kernels.checks import HEAD_DTYPES, INPUT_PRECISIONS, MOMENT_DTYPES
from algorithms.esamp.kernels.ops import triton_available
from algorithms.esamp.kernels.traffic import (
    candidate_dot_bytes,
    grad_adam_bytes,
    slot_matmul_bytes,
)

__all__ = [
    "HEAD_DTYPES",
    "INPUT_PRECISIONS",
    "MOMENT_DTYPES",
    "candidate_dot",
    "candidate_dot_bytes",
    "grad_adam",
    "grad_adam_bytes",
    "slot_matmul",
    "slot_matmul_bytes",
    "triton_available",
]


def grad_adam(
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    group_slot: torch.Tensor,
    ok: torch.Tensor,
    step: torch.Tensor,
    w: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    input_precision: str = "ieee",
) -> None:
    """One Adam step per live group, gradient formed inside the kernel.

    For every group ``g`` with ``group_slot[g] >= 0`` and ``ok[g] != 0``, with
    ``s = group_slot[g]``: ``grad = scale[g] * a[g]^T @ b[g]``, then ``torch._fused_adam_``'s
    step of ``w[s]``, ``m[s]``, ``v[s]`` with step count ``step[s]`` (already incremented),
    no weight decay. Other groups touch nothing (their slots keep w/m/v bit for bit).

    ``a [G, M, N]``, ``b [G, M, K]`` fp32 (rows past a group's count must be zero);
    ``scale [G]`` fp32 (e.g. the clip coefficient); ``group_slot [G]`` int32/int64;
    ``ok [G]`` bool/int/float; ``step [S]`` fp32; ``w [S, N, K]`` fp32 and ``m``/``v``
    (fp32 or bf16: computed in fp32, stored rounded) as any strided views, e.g.
    ``theta[:, off:off + N * K].view(S, N, K)``. A slot may appear in at most one live group
    (two would race on the GPU). ``input_precision``: the gradient product's, one of
    :data:`INPUT_PRECISIONS` (``"ieee"``: exact fp32; ``"tf32"`` is faster on tensor cores).
    """
    b1, b2 = betas
    torch.ops.tllm_esamp.grad_adam(
        a, b, scale, group_slot, ok, step, w, m, v, lr, b1, b2, eps, input_precision
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
) -> torch.Tensor:
    """``out[g] = x[g] @ w[s]^T`` with ``w [S, N, K]`` (``transpose_w``), or ``x[g] @ w[s]``
    with ``w [S, K, N]``, for ``s = group_slot[g]``; ``out[g] = 0`` where ``s < 0``. Returns
    ``out`` (written in place; nothing allocated).

    ``x [G, M, K]``, ``out [G, M, N]`` fp32; ``w`` fp32, any strided view. On CUDA,
    ``split_k`` splits K over that many programs whose partial sums are added atomically
    (summation order then varies run to run, at fp32 rounding level); 0 picks it from the
    GPU's SM count, 1 is deterministic."""
    torch.ops.tllm_esamp.slot_matmul(x, w, group_slot, out, transpose_w, input_precision, split_k)
    return out


def candidate_dot(
    weight: torch.Tensor,
    f: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out[j] = sum_h float(weight[tokens[j], h]) * f[rows[j], h]``, accumulated in fp32;
    returns ``out`` (written in place; nothing allocated on CUDA).

    ``weight [V, H]`` one of :data:`HEAD_DTYPES` (an LM head's weight), ``f [R, H]`` fp32,
    both with unit stride along H (any row stride); ``rows``, ``tokens`` ``[N]`` int64 (or
    int32), any pair may repeat; ``out [N]`` fp32. All on one device. Index values are not
    checked on CUDA (that would need a host read): they must lie in ``[0, R)`` and
    ``[0, V)``."""
    torch.ops.tllm_esamp.candidate_dot(weight, f, rows, tokens, out)
    return out

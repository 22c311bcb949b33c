"""ESamp's fused GPU kernels, as torch operators (``torch.ops.tllm_esamp``; a dispatch mode
sees each call as one op):

- :func:`grad_adam`: each group's weight gradient ``scale * a^T b`` formed tile by tile in
  registers and consumed at once by an Adam step of that group's slot (never stored), so
  the update moves each parameter and its moments once: 24 bytes per parameter with fp32
  moments, 16 with bf16 (:func:`grad_adam_bytes`);
- :func:`slot_matmul`: ``out[g] = x[g] @ w[slot[g]]^T`` (or ``@ w[slot[g]]``) reading only
  the listed slots' weights, out= style (no allocation);
- :func:`silu_mul`: a SwiGLU block's activations ``s = silu(a)``, ``p = s * u`` in one
  launch;
- :func:`loss_dy`, :func:`block_backward`, :func:`update_tail`: the rest of the update's
  backward, one launch each: the loss and its gradient; per SwiGLU block the elementwise
  backward with the block's share of each group's gradient norm (from Gram matrices);
  norm, finite check, clip coefficient and the step counts;
- :func:`stale_max`: the prediction's staleness measurement (largest lag of its groups'
  slots) in one launch;
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
from algorithms.esamp.kernels.checks import (
    HEAD_DTYPES,
    INPUT_PRECISIONS,
    MOMENT_DTYPES,
    NORM_TILE_ROWS,
    norm_parts,
)
from algorithms.esamp.kernels.ops import triton_available
from algorithms.esamp.kernels.traffic import (
    block_backward_bytes,
    candidate_dot_bytes,
    grad_adam_bytes,
    loss_dy_bytes,
    silu_mul_bytes,
    slot_matmul_bytes,
    stale_max_bytes,
    update_tail_bytes,
)

__all__ = [
    "HEAD_DTYPES",
    "INPUT_PRECISIONS",
    "MOMENT_DTYPES",
    "NORM_TILE_ROWS",
    "block_backward",
    "block_backward_bytes",
    "candidate_dot",
    "candidate_dot_bytes",
    "grad_adam",
    "grad_adam_bytes",
    "loss_dy",
    "loss_dy_bytes",
    "norm_parts",
    "silu_mul",
    "silu_mul_bytes",
    "slot_matmul",
    "slot_matmul_bytes",
    "stale_max",
    "stale_max_bytes",
    "triton_available",
    "update_tail",
    "update_tail_bytes",
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
    ``theta[:, off:off + N * K].view(S, N, K)``. Several matrices of a slot in one launch:
    ``w``/``m``/``v`` ``[S, E, N, K]``, ``a [G, E, M, N]``, ``b [G, M, K]`` (shared by the
    matrices, e.g. gate and up of a block) or ``[G, E_b, M, K]`` with ``E`` a multiple of
    ``E_b``: matrix ``e`` uses ``b[:, e % E_b]`` (gate and up of every block: ``E = 2 NB``,
    ``b`` each block's input, ``E_b = NB``). A slot may appear in at most one live group
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
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[g] = x[g] @ w[s]^T`` with ``w [S, N, K]`` (``transpose_w``), or ``x[g] @ w[s]``
    with ``w [S, K, N]``, for ``s = group_slot[g]``; the product is 0 where ``s < 0``.
    Returns ``out`` (written in place; nothing allocated).

    ``x [G, M, K]``, ``out [G, M, N]`` fp32; ``w`` fp32, any strided view. Several matrices
    of a slot at once (one launch): ``w [S, E, N, K]`` (or ``[S, E, K, N]``) with ``x [G, M,
    K]`` (shared) or ``[G, E, M, K]``, into ``out [G, E, M, N]`` (one product per matrix) or
    ``out [G, M, N]`` (their sum: ``sum_e x[g, e] @ w[s, e]^T``). ``add [G, M, N]``
    (optional, with ``out [G, M, N]``): added to ``out``, which must not alias it. On CUDA,
    ``split_k`` splits K over that many programs whose partial sums are added atomically
    (summation order then varies run to run, at fp32 rounding level); 0 picks it from the
    GPU's SM count, 1 is deterministic."""
    torch.ops.tllm_esamp.slot_matmul(
        x, w, group_slot, out, transpose_w, input_precision, split_k, add
    )
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


def loss_dy(
    h: torch.Tensor,
    tp: torch.Tensor,
    mask: torch.Tensor,
    parts: torch.Tensor,
    dy: torch.Tensor,
    *,
    reduction: str = "mean",
) -> None:
    """Each group's loss (in parts) and its gradient with respect to ``h``, in one pass.

    ``h``, ``tp``, ``dy`` ``[G, M, H]`` fp32, ``mask [G, M]`` bool (the group's rows),
    ``parts [G, L]`` fp32 (``L >= 1``: on CUDA each group's hidden columns are split over
    ``L`` programs). With ``diff = h - tp`` on marked rows (0 elsewhere, whatever ``h`` and
    ``tp`` hold there) and ``denom = max(rows x (H for "mean", 1 for "sum"), 1)``
    (:func:`algorithms.esamp.objective.loss_denominator`): ``parts[g]`` sums to
    ``sum(diff[g]^2) / denom`` (how it is spread over the columns is the implementation's;
    :func:`update_tail` sums it), ``dy[g] = diff[g] * (2 / denom)``."""
    torch.ops.tllm_esamp.loss_dy(h, tp, mask, parts, dy, reduction)


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


def update_tail(
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
    *,
    grad_clip: float | None,
    clip_eps: float,
) -> None:
    """Per group, after the backward: ``losses[g] = sum(loss_parts[g])`` (:func:`loss_dy`'s),
    ``norm[g] = sqrt(sum(parts[g]))`` (:func:`block_backward`'s); ``valid`` = the group has
    a slot (``group_slot >= 0``) and rows (``mask``); ``ok[g]`` = valid with a finite loss
    and norm; ``scale[g] = min(1, grad_clip / (norm + clip_eps))`` (1 with ``grad_clip``
    None); ``step[s] += ok`` and ``applied[s] += valid`` (``applied`` optional) at ``s =
    group_slot[g]``.

    ``loss_parts [G, L]``, ``parts [G, K]``, ``losses``/``scale``/``norm [G]`` fp32,
    ``group_slot [G]`` int32/int64, ``mask [G, M]`` bool, ``ok [G]`` bool, ``step [S]``
    fp32, ``applied [S]`` int64. A slot may appear in at most one group (two would race on
    the GPU)."""
    clip = -1.0 if grad_clip is None else float(grad_clip)
    if grad_clip is not None and not grad_clip >= 0:
        raise ValueError(f"grad_clip must be >= 0 or None, got {grad_clip}")
    torch.ops.tllm_esamp.update_tail(
        loss_parts, parts, group_slot, mask, step, applied, losses, ok, scale, norm, clip,
        clip_eps,
    )  # fmt: skip


def silu_mul(a: torch.Tensor, u: torch.Tensor, s: torch.Tensor, p: torch.Tensor) -> None:
    """``s = silu(a)`` and ``p = s * u``, all ``[G, M, I]`` fp32 (any strides), in one pass
    (CPU: ``torch``'s silu and mul, the values of ``F.silu(a) * u``)."""
    torch.ops.tllm_esamp.silu_mul(a, u, s, p)


def stale_max(
    submitted: torch.Tensor, applied: torch.Tensor, group_slot: torch.Tensor, stale: torch.Tensor
) -> None:
    """``stale[0] = max(stale[0], submitted[g] - applied[group_slot[g]])`` over the groups
    ``g`` with a slot (``group_slot >= 0``): the largest number of updates submitted for a
    group's slot but not yet applied when the prediction reads it. ``submitted [G]``,
    ``applied [S]``, ``stale [1]`` int64; ``group_slot [G]`` int32/int64."""
    torch.ops.tllm_esamp.stale_max(submitted, applied, group_slot, stale)

"""The CUDA path's two slot-indexed operations adapted to the update's calls: a product with
each packed group's own slot of the stacked weights (``group_slot[g]``; ``-1``: a padding
group, output 0), and each group's clipped gradient formed inside its slot's Adam step. Only
the step's slots are read. Both are :mod:`algorithms.esamp.kernels` operators.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from algorithms.esamp import kernels
from algorithms.esamp.mlp import MatMul
from algorithms.esamp.params import AdamHyper


def slot_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    group_slot: torch.Tensor,
    transpose_w: bool,
    precision: str = "ieee",
    out: torch.Tensor | None = None,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x[g] @ w[group_slot[g]]^T`` (``w [S, N, K]``) or, with ``transpose_w=False``,
    ``x[g] @ w[group_slot[g]]`` (``w [S, K, N]``); ``x [G, M, K]``; padding groups give 0.
    With ``w [S, E, ., .]`` (e.g. :func:`~algorithms.esamp.mlp.gate_up_pairs`): one product
    per matrix ``[G, E, M, N]`` from a shared ``x``, or, with ``x [G, E, M, K]``, their sum
    ``[G, M, N]``. ``add``: added to the result (:func:`algorithms.esamp.kernels.slot_matmul`).
    ``precision``: the product's (``"ieee"`` or ``"tf32"``); ``out``: written there (else a
    new tensor)."""
    if out is None:
        n = w.shape[-2] if transpose_w else w.shape[-1]
        per_matrix = w.dim() == 4 and x.dim() == 3
        lead = (x.shape[0], w.shape[1]) if per_matrix else (x.shape[0],)
        out = torch.empty(*lead, x.shape[-2], n, device=x.device, dtype=torch.float32)
    return kernels.slot_matmul(
        x, w, group_slot, out, transpose_w=transpose_w, input_precision=precision, add=add
    )


def slot_grad_adam_(
    w: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    group_slot: torch.Tensor,
    step: torch.Tensor,
    ok: torch.Tensor,
    scale: torch.Tensor,
    hp: AdamHyper,
    precision: str = "ieee",
) -> None:
    """For each group with a slot and ``ok``: gradient ``scale[g] * a[g]^T b[g]`` (``a [G, M,
    N]``, ``b [G, M, K]``), then one Adam step of ``w``/``m``/``v`` ``[S, N, K]`` at the slot
    with its count ``step[slot]`` (already incremented). Same formulas as
    ``torch._fused_adam_``; other slots, and groups not ``ok``, are left bit for bit."""
    kernels.grad_adam(
        a, b, scale, group_slot, ok, step, w, m, v,
        lr=hp.lr, betas=hp.betas, eps=hp.eps, input_precision=precision,
    )  # fmt: skip


def slots_bound(mm: Callable[..., torch.Tensor], group_slot: torch.Tensor) -> MatMul:
    """``mm`` (as :func:`slot_matmul`) with ``group_slot`` bound: the :data:`MatMul` of
    :func:`~algorithms.esamp.mlp.forward_slots`."""
    return lambda x, w, transpose_w, **kw: mm(x, w, group_slot, transpose_w, **kw)

"""Pure-PyTorch implementations of the kernels' ops: the CPU kernels, and the fallback on
other devices where Triton is missing.

Written for clarity, not speed, but on any device without a host read: groups are visited
in a Python loop over ``G`` (known on the host), and a skipped group writes back what it
read (``torch.where``), so its rows end bit for bit as they were."""

from __future__ import annotations

import torch


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
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """For each group ``g`` with ``group_slot[g] >= 0`` and ``ok[g] != 0``: one Adam step of
    ``w/m/v[s]`` (``s = group_slot[g]``) with gradient ``scale[g] * a[g]^T b[g]`` and step
    count ``step[s]``. Same formula as ``torch._fused_adam_`` (bias corrections in fp64,
    the rest in fp32; moments rounded to their dtype when stored)."""
    if w.shape[0] == 0:
        return
    for g in range(a.shape[0]):
        slot = group_slot[g]
        live = (slot >= 0) & (ok[g] != 0)
        idx = slot.clamp(min=0).reshape(1)
        grad = scale[g] * (a[g].transpose(0, 1) @ b[g])
        t = step.index_select(0, idx).double()
        bc1 = 1 - beta1**t
        bc2_sqrt = (1 - beta2**t).sqrt()
        step_size = (lr / bc1).float()
        w0, m0, v0 = (x.index_select(0, idx)[0] for x in (w, m, v))
        m1 = beta1 * m0.float() + (1 - beta1) * grad
        v1 = beta2 * v0.float() + (1 - beta2) * grad * grad
        denom = v1.sqrt() / bc2_sqrt.float() + eps
        w1 = w0 - step_size * m1 / denom
        for dst, old, new in ((w, w0, w1), (m, m0, m1), (v, v0, v1)):
            kept = torch.where(live, new.to(dst.dtype), old)
            dst.index_copy_(0, idx, kept[None])


def slot_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    group_slot: torch.Tensor,
    out: torch.Tensor,
    transpose_w: bool,
) -> None:
    """``out[g] = x[g] @ w[s]^T`` (``transpose_w``, ``w [S, N, K]``) or ``x[g] @ w[s]``
    (``w [S, K, N]``), ``s = group_slot[g]``; zeros where ``s < 0``."""
    if w.shape[0] == 0:
        out.zero_()
        return
    ws = w.index_select(0, group_slot.clamp(min=0))
    y = torch.bmm(x, ws.transpose(1, 2) if transpose_w else ws)
    out.copy_(torch.where((group_slot >= 0)[:, None, None], y, 0.0))


# Pairs gathered at once: bounds the fallback's temporaries to chunk x H (as guidance did).
CANDIDATE_CHUNK = 4096


def candidate_dot(
    weight: torch.Tensor,
    f: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    out: torch.Tensor,
    chunk: int = CANDIDATE_CHUNK,
) -> None:
    """``out[j] = sum_h float(weight[tokens[j], h]) * f[rows[j], h]`` in fp32, ``chunk``
    pairs at a time."""
    for i in range(0, tokens.shape[0], chunk):
        w = weight.index_select(0, tokens[i : i + chunk]).float()
        w.mul_(f.index_select(0, rows[i : i + chunk]))
        torch.sum(w, -1, out=out[i : i + chunk])

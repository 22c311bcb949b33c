"""Pure-PyTorch implementations of the kernels' ops: the CPU kernels, and the fallback on
other devices where Triton is missing.

Written for clarity, not speed, but on any device without a host read: groups are visited
in a Python loop over ``G`` (known on the host), and a skipped group writes back what it
read (``torch.where``), so its rows end bit for bit as they were."""

from __future__ import annotations

import torch

from algorithms.esamp.adam import fused_adam_
from algorithms.esamp.objective import loss_denominator
from algorithms.esamp.params import AdamHyper


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
    count ``step[s]``: :func:`~algorithms.esamp.adam.fused_adam_` on the slot's rows (bf16
    moments: computed in fp32, rounded when stored)."""
    if w.shape[0] == 0:
        return
    if w.dim() == 4:  # E matrices of each slot: one at a time (b shared or cycling)
        for e in range(w.shape[1]):
            b_e = b if b.dim() == 3 else b[:, e % b.shape[1]]
            grad_adam(a[:, e], b_e, scale, group_slot, ok, step, w[:, e], m[:, e], v[:, e],
                      lr, beta1, beta2, eps)  # fmt: skip
        return
    hp = AdamHyper(lr=lr, eps=eps, betas=(beta1, beta2))
    for g in range(a.shape[0]):
        slot = group_slot[g]
        skip = ~((slot >= 0) & (ok[g] != 0))
        idx = slot.clamp(min=0).reshape(1)
        grad = scale[g] * (a[g].transpose(0, 1) @ b[g])
        # The slot's rows gathered (no host read of the slot), stepped, written back.
        rows = [x.index_select(0, idx)[0].float() for x in (w, m, v)]
        fused_adam_(rows[:1], [grad], rows[1:2], rows[2:], [step[idx[0]]], hp, skip.float())
        for dst, new in zip((w, m, v), rows, strict=True):
            dst.index_copy_(0, idx, new.to(dst.dtype)[None])


def slot_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    group_slot: torch.Tensor,
    out: torch.Tensor,
    transpose_w: bool,
    add: torch.Tensor | None = None,
) -> None:
    """``out[g] = x[g] @ w[s]^T`` (``transpose_w``, ``w [S, N, K]``) or ``x[g] @ w[s]``
    (``w [S, K, N]``), ``s = group_slot[g]``; zeros where ``s < 0``. With ``w [S, E, ., .]``
    the same per matrix ``e`` (``x [G, M, K]`` shared or ``[G, E, M, K]``), into ``out [G, E,
    M, N]`` or summed over ``e`` into ``out [G, M, N]``; then ``add`` (if any) added."""
    if w.shape[0] == 0:
        out.zero_()
        if add is not None:
            out.add_(add)
        return
    live = (group_slot >= 0)[:, None, None]
    idx = group_slot.clamp(min=0)
    if w.dim() == 3:
        ws = w.index_select(0, idx)
        y = torch.where(live, torch.bmm(x, ws.transpose(1, 2) if transpose_w else ws), 0.0)
    else:
        ys = []
        for e in range(w.shape[1]):
            ws = w[:, e].index_select(0, idx)
            xe = x if x.dim() == 3 else x[:, e]
            ys.append(
                torch.where(live, torch.bmm(xe, ws.transpose(1, 2) if transpose_w else ws), 0.0)
            )
        y = sum(ys[1:], ys[0]) if out.dim() == 3 else torch.stack(ys, 1)
    if add is not None:
        y = add + y
    out.copy_(y)


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


def loss_dy(
    h: torch.Tensor,
    tp: torch.Tensor,
    mask: torch.Tensor,
    parts: torch.Tensor,
    dy: torch.Tensor,
    reduction: str,
) -> None:
    """Each group's loss ``sum(diff^2) / denom`` (into ``parts[:, 0]``, the other columns 0)
    and its gradient ``dy = diff * 2 / denom`` with ``diff = h - tp`` on the rows ``mask``
    marks (0 elsewhere) and ``denom`` :func:`~algorithms.esamp.objective.loss_denominator`."""
    diff = torch.where(mask[..., None], h - tp, 0.0)
    denom = loss_denominator(mask.sum(1), h.shape[2], reduction)
    parts.zero_()
    parts[:, 0] = diff.square().sum((1, 2)) / denom
    torch.mul(diff, (2.0 / denom)[:, None, None], out=dy)


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
) -> None:
    """One SwiGLU block's elementwise backward, ``du = dp * s``, ``da = dp * u * silu'(a)``,
    and the block's share of each group's squared gradient norm from Gram matrices:
    ``sum((dy dy^T) * (p p^T)) + sum((du du^T + da da^T) * (h_in h_in^T))``, written to
    ``parts[:, 0]`` (the other columns: 0)."""
    torch.mul(dp, s, out=du)
    sig = torch.sigmoid(a)
    torch.mul(dp * u * sig, 1 + a * (1 - sig), out=da)
    gram_in = torch.bmm(h_in, h_in.transpose(1, 2))
    gram_g = torch.bmm(du, du.transpose(1, 2)) + torch.bmm(da, da.transpose(1, 2))
    sq = (torch.bmm(dy, dy.transpose(1, 2)) * torch.bmm(p, p.transpose(1, 2))).sum((1, 2))
    sq += (gram_g * gram_in).sum((1, 2))
    parts.zero_()
    parts[:, 0] = sq


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
    grad_clip: float,
    clip_eps: float,
) -> None:
    """Per group: ``losses = sum(loss_parts)``, ``norm = sqrt(sum(parts))``; ``valid`` = has
    a slot and rows; ``ok`` = valid with a finite loss and norm; ``scale`` =
    ``clip_grad_norm_``'s coefficient ``min(1, grad_clip / (norm + clip_eps))`` (1 where
    ``grad_clip < 0``: no clipping); ``step[slot] += ok``, ``applied[slot] += valid``."""
    torch.sum(loss_parts, 1, out=losses)
    torch.sqrt(parts.sum(1), out=norm)
    valid = (group_slot >= 0) & mask.any(1)
    # Finite iff x * 0 == 0 (inf * 0 and NaN * 0 are NaN).
    ok.copy_(valid & (losses * 0 + norm * 0 == 0))
    if grad_clip < 0:
        scale.fill_(1.0)
    else:
        scale.copy_((grad_clip / (norm + clip_eps)).clamp(max=1.0))
    idx = group_slot.clamp(min=0)
    step.index_add_(0, idx, ok.to(step.dtype))
    if applied is not None:
        applied.index_add_(0, idx, valid.to(applied.dtype))


def silu_mul(a: torch.Tensor, u: torch.Tensor, s: torch.Tensor, p: torch.Tensor) -> None:
    """``s = silu(a)``, ``p = s * u`` (a SwiGLU block's activations)."""
    torch._C._nn.silu(a, out=s)  # F.silu has no out=
    torch.mul(s, u, out=p)


def stale_max(
    submitted: torch.Tensor, applied: torch.Tensor, group_slot: torch.Tensor, stale: torch.Tensor
) -> None:
    """``stale[0] = max(stale[0], submitted[g] - applied[group_slot[g]])`` over the groups
    with a slot."""
    lag = submitted - applied.index_select(0, group_slot.clamp(min=0))
    lag = torch.where(group_slot >= 0, lag, stale)
    torch.maximum(stale, lag.max(), out=stale)

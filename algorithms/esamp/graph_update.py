"""The update step with fixed shapes and no host sync, so it can be captured as a CUDA graph
(the CUDA path replays it; the CPU path uses :mod:`algorithms.esamp.host_trainer`). The
backward is written out (:mod:`algorithms.esamp.backward`), Adam is PyTorch's fused kernel
(:func:`~algorithms.esamp.adam.fused_adam_`). Runs on any device: the CPU tests check it
against the CPU trainer.

Dense over slots: the step computes every slot of the stacked state (live or not) on its own
rows, directly on the state tensors, so nothing is gathered or scattered. Each weight
matrix's gradients (all slots, already clipped) are formed in one scratch block and read
once by Adam: the only full-size temporary is one matrix per slot, and per parameter the
step moves about what Adam itself must (``benchmarks/bytes_count.py``). Slots with no row
in the step (``valid`` False) or a non-finite loss or gradient keep their state bit for bit:
Adam skips them on the device (``found_inf``)."""

from __future__ import annotations

import torch

from algorithms.esamp.adam import adam_stats, clip_scale, fused_adam_
from algorithms.esamp.backward import backward_factors, clipped_grad
from algorithms.esamp.mlp import forward_acts
from algorithms.esamp.objective import loss_denominator
from algorithms.esamp.params import AdamHyper, DistillerShape, block_weights


def train_dense(
    theta: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    valid: torch.Tensor,
    xp: torch.Tensor,
    tp: torch.Tensor,
    mask: torch.Tensor,
    shape: DistillerShape,
    hp: AdamHyper,
    applied: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Adam step for every slot with rows, written in place into the slot state.

    ``theta``/``m``/``v`` ``[S, P]``, ``step``/``valid`` ``[S]``; ``xp``/``tp`` ``[S, M, H]``
    hold slot ``s``'s rows at ``[s, :count]``, ``mask [S, M]`` marks them. Loss of slot s: its
    summed ``(f(x) - target)^2`` over the loss denominator (``hp.loss_reduction``).
    ``applied`` (int64 per slot, optional): incremented for every valid slot once its update
    has been processed (applied, or skipped as non-finite): what staleness is measured
    against. ``stats [S, len(STATS)]`` (optional, with ``hp.stats``): written in place with
    each slot's update statistics (:func:`~algorithms.esamp.adam.adam_stats`; NaN for slots
    not updated). Returns ``(losses [S], updated [S])``.
    """
    with torch.no_grad():
        weights = block_weights(theta, shape)
        h, acts = forward_acts(weights, xp)
        diff = torch.where(mask[..., None], h - tp, 0.0)
        denom = loss_denominator(mask.sum(1), shape.hidden_size, hp.loss_reduction)
        losses = diff.square().sum((1, 2)) / denom
        factors, sq = backward_factors(weights, acts, diff.mul_((2.0 / denom)[:, None, None]))
        norm = sq.sqrt()
        ok = valid & torch.isfinite(losses) & torch.isfinite(norm)
        scale = clip_scale(norm, hp)
        step.add_(ok.to(step.dtype))
        skip = (~ok).to(torch.float32)
        s_total = theta.shape[0]
        scratch = torch.empty(
            s_total, shape.intermediate_size * shape.hidden_size, device=theta.device
        )
        wv = [block_weights(t, shape) for t in (theta, m, v)]
        for f in factors:
            b, k = f[0], f[1]
            w, mm, vv = (x[b][k] for x in wv)
            grad = clipped_grad(f, scale, scratch.view(w.shape))
            for s in range(s_total):
                fused_adam_([w[s]], [grad[s]], [mm[s]], [vv[s]], [step[s]], hp, found_inf=skip[s])
        if stats is not None and hp.stats:
            for s in range(s_total):
                st = adam_stats(m[s : s + 1], v[s : s + 1], step[s : s + 1], norm[s : s + 1], hp)
                stats[s] = torch.where(ok[s], st[0], float("nan"))
        if applied is not None:
            applied.add_(valid.to(applied.dtype))
    return losses, ok

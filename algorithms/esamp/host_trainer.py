"""The CPU trainer: clip_grad_norm_ + Adam for the packed groups of one step, in place, with
the backward written out as batched products over groups (no autograd)."""

from __future__ import annotations

import math

import torch

from algorithms.esamp.adam import CLIP_EPS, STATS, adam_stats, fused_adam_
from algorithms.esamp.backward import backward_factors, clipped_grad
from algorithms.esamp.mlp import Activations, forward_acts
from algorithms.esamp.objective import loss_denominator
from algorithms.esamp.packing import HostBatch, Packing
from algorithms.esamp.params import AdamHyper, DistillerShape, block_weights


def _fused_adam_available() -> bool:
    return hasattr(torch, "_fused_adam_")


class HostTrainer:
    """clip_grad_norm_ + Adam for the packed groups of one step, in place, with the backward
    written out as batched products over groups (both cores work on it through torch's
    intra-op pool; 16-row products of one group alone run on one core).

    The backward is :mod:`algorithms.esamp.backward`'s: every group's clip coefficient is
    known before any gradient exists. Each weight's gradients (all groups) are then formed
    once, already clipped, in a scratch buffer that stays in cache, and handed to PyTorch's
    fused Adam kernel: per step the optimizer streams parameters and moments once, and no
    full-size gradient is ever written to memory.
    """

    def __init__(self, shape: DistillerShape, hp: AdamHyper):
        self.shape, self.hp = shape, hp
        self.scratch = torch.empty(0)
        self.fused = _fused_adam_available()
        # Per slot: its weight matrices in theta, m and v (flat, index 3 * block + matrix),
        # kept while the state tensors are the same storage (they change only on growth).
        self._views: dict[int, tuple[list[torch.Tensor], ...]] = {}
        self._views_key: tuple[int, ...] = ()

    def step(
        self,
        state: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        pk: Packing,
        batch: HostBatch,
        x: torch.Tensor,
        target: torch.Tensor,
        forward: tuple[torch.Tensor, Activations] | None = None,
    ) -> tuple[list[float], list[bool], torch.Tensor | None]:
        """One update of each packed group; returns per group (loss, updated) and, with
        ``hp.stats``, the update's statistics ``[groups, len(STATS)]`` (:func:`adam_stats`; rows of
        groups not updated are NaN), else None.

        ``state``: the stacked ``(theta, m, v, step)``. ``forward``: :func:`forward_acts` of
        these parameters on the packed ``x``, when already computed (a prediction of the same
        rows). A group with a non-finite loss or gradient norm keeps its state (updated False).
        """
        theta, m, v, step = state
        shape, hp = self.shape, self.hp
        weights = block_weights(batch.take(theta), shape)
        if forward is None:
            forward = forward_acts(weights, batch.pack(pk, x))
        h, acts = forward
        diff = h - batch.pack(pk, target)
        counts = torch.ones(batch.size, dtype=torch.float32)
        counts[torch.from_numpy(batch.pos)] = torch.from_numpy(pk.counts).float()
        denom = loss_denominator(counts, shape.hidden_size, hp.loss_reduction)
        losses = diff.square().sum((1, 2)) / denom
        dy = diff.mul_((2.0 / denom)[:, None, None])
        factors, sq = backward_factors(weights, acts, dy)
        loss_l = losses[torch.from_numpy(batch.pos)].tolist()
        sq_l = sq[torch.from_numpy(batch.pos)].tolist()
        ok = [math.isfinite(lo) and math.isfinite(q) for lo, q in zip(loss_l, sq_l, strict=True)]
        coef = torch.ones(batch.size)
        if hp.grad_clip is not None:
            for gi, q in enumerate(sq_l):
                if ok[gi]:
                    coef[batch.pos[gi]] = min(1.0, hp.grad_clip / (math.sqrt(q) + CLIP_EPS))
        todo = [(int(batch.pos[gi]), int(slot)) for gi, slot in enumerate(pk.slots) if ok[gi]]
        if todo:
            self._update(theta, m, v, step, factors, coef, todo, batch.size)
        stats = None
        if hp.stats:
            stats = torch.full((len(ok), len(STATS)), float("nan"))
            done = [gi for gi in range(len(ok)) if ok[gi]]
            if done:
                sl = torch.from_numpy(pk.slots[done])
                norm = torch.tensor([sq_l[gi] for gi in done]).sqrt()
                stats[done] = adam_stats(m[sl], v[sl], step[sl], norm, hp)
        return loss_l, ok, stats

    def _update(self, theta, m, v, step, factors, coef, todo, size) -> None:
        """Form each weight's clipped gradient for all groups and apply Adam to the groups in
        ``todo`` (batch index, slot)."""
        shape = self.shape
        steps = [step[slot] for _, slot in todo]
        for s in steps:
            s += 1
        rows = [self._slot_views(theta, m, v, slot) for _, slot in todo]
        numel = shape.intermediate_size * shape.hidden_size
        if self.scratch.numel() < size * numel:
            self.scratch = torch.empty(size * numel)
        for f in factors:
            j = 3 * f[0] + f[1]
            grad = self.scratch[: size * numel].view(size, *rows[0][0][j].shape)
            clipped_grad(f, coef, grad)
            self._adam(
                [r[0][j] for r in rows],
                [grad[i] for i, _ in todo],
                [r[1][j] for r in rows],
                [r[2][j] for r in rows],
                steps,
            )

    def _slot_views(self, theta, m, v, slot: int) -> tuple[list[torch.Tensor], ...]:
        # Capacity only grows, so a row count names one allocation of the state.
        key = (theta.data_ptr(), theta.shape[0], m.data_ptr(), v.data_ptr())
        if key != self._views_key:
            self._views, self._views_key = {}, key
        views = self._views.get(slot)
        if views is None:
            views = tuple(
                [w[0] for blk in block_weights(t[slot][None], self.shape) for w in blk]
                for t in (theta, m, v)
            )
            self._views[slot] = views
        return views

    def _adam(self, ws, grads, ms, vs, steps) -> None:
        hp = self.hp
        b1, b2 = hp.betas
        if self.fused:
            fused_adam_(ws, grads, ms, vs, steps, hp)
            return
        for w, grad, m, v, step in zip(ws, grads, ms, vs, steps, strict=True):
            n = float(step)
            m.lerp_(grad, 1 - b1)
            v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            denom = v.sqrt().div_(math.sqrt(1 - b2**n)).add_(hp.eps)
            w.addcdiv_(m, denom, value=-hp.lr / (1 - b1**n))

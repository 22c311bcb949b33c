"""The CPU trainer: clip + Adam for the packed groups of one step, in place, with the weights
as views of the state. Not the update graph's ``train_groups``: its slot-gathered weights and
moments made an 8 x 16 update at hidden 576 about 2.7 times slower on CPU."""

from __future__ import annotations

import torch

from algorithms.esamp import kernels
from algorithms.esamp.adam import CLIP_EPS, STATS, adam_stats, fused_adam_
from algorithms.esamp.backward import backward_factors, clipped_grad
from algorithms.esamp.kernels.op_loss_dy import loss_per_row
from algorithms.esamp.mlp import Activations, forward_acts
from algorithms.esamp.packing import HostBatch, Packing
from algorithms.esamp.params import AdamHyper, DistillerShape, block_weights


class HostTrainer:
    """The backward as batched products over groups (they use every core), each group's clip
    coefficient known before any gradient exists, then each weight's clipped gradients formed
    in a cached scratch buffer for PyTorch's fused Adam."""

    def __init__(self, shape: DistillerShape, hp: AdamHyper):
        self.shape, self.hp = shape, hp
        self.scratch = torch.empty(0)
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
        row_errors: torch.Tensor | None = None,
    ) -> tuple[list[float], list[bool], torch.Tensor | None]:
        """One update of each packed group of ``state = (theta, m, v, step)``; returns per
        group (loss, updated) and, with ``hp.stats``, the statistics (NaN where not updated).
        ``forward``: the prediction's, when already computed; ``row_errors``: filled."""
        theta, m, v, step = state
        shape, hp = self.shape, self.hp
        weights = block_weights(batch.take(theta), shape)
        if forward is None:
            forward = forward_acts(weights, batch.pack(pk, x))
        h, acts = forward
        pos = torch.from_numpy(batch.pos)
        # Batch entries that are no packed group: no slot, no rows (nothing read or updated).
        group_slot = torch.full((batch.size,), -1, dtype=torch.int64)
        group_slot[pos] = torch.from_numpy(pk.slots)
        mask = torch.zeros(batch.size, h.shape[1], dtype=torch.bool)
        mask[batch.pos[pk.row_group], pk.row_pos] = True
        loss_parts, dy = h.new_empty(batch.size, 1), torch.empty_like(h)
        tp = batch.pack(pk, target)
        kernels.loss_dy(h, tp, mask, loss_parts, dy, reduction=hp.loss_reduction)
        if row_errors is not None:  # each row's term of its group's loss, times its rows
            diff = batch.unpack(pk, h) - batch.unpack(pk, tp)
            per_row = loss_per_row(shape.hidden_size, hp.loss_reduction)
            row_errors.copy_(diff.square_().sum(-1).div_(per_row))
        factors, sq = backward_factors(weights, acts, dy)
        ok_b = torch.empty(batch.size, dtype=torch.bool)
        losses, coef, norm = (h.new_empty(batch.size) for _ in range(3))
        kernels.update_tail(
            loss_parts, sq[:, None], group_slot, mask, step, None, losses, ok_b, coef, norm,
            grad_clip=hp.grad_clip, clip_eps=CLIP_EPS,
        )  # fmt: skip
        ok = ok_b[pos].tolist()
        todo = [(int(batch.pos[gi]), int(slot)) for gi, slot in enumerate(pk.slots) if ok[gi]]
        if todo:
            self._update(theta, m, v, step, factors, coef, todo, batch.size)
        stats = None
        if hp.stats:
            stats = torch.full((len(ok), len(STATS)), float("nan"))
            done = [gi for gi in range(len(ok)) if ok[gi]]
            if done:
                sl = torch.from_numpy(pk.slots[done])
                stats[done] = adam_stats(m[sl], v[sl], step[sl], norm[pos[done]], hp)
        return losses[pos].tolist(), ok, stats

    def _update(self, theta, m, v, step, factors, coef, todo, size) -> None:
        """Each weight's clipped gradient for all groups, then Adam on ``todo`` (index, slot)."""
        shape = self.shape
        steps = [step[slot] for _, slot in todo]  # counted by update_tail
        rows = [self._slot_views(theta, m, v, slot) for _, slot in todo]
        numel = shape.intermediate_size * shape.hidden_size
        if self.scratch.numel() < size * numel:
            self.scratch = torch.empty(size * numel)
        for f in factors:
            j = 3 * f[0] + f[1]
            grad = self.scratch[: size * numel].view(size, *rows[0][0][j].shape)
            clipped_grad(f, coef, grad)
            fused_adam_(
                [r[0][j] for r in rows],
                [grad[i] for i, _ in todo],
                [r[1][j] for r in rows],
                [r[2][j] for r in rows],
                steps,
                self.hp,
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

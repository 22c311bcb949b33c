"""Grouped Latent Distiller: G independent residual gated-SwiGLU MLPs run as one batched
computation.

Each group (slot) owns one flat fp32 parameter row of ``theta [C, P]`` plus its Adam state
(``m``, ``v``, ``step``). Rows of a step are packed per group into ``[G, M, H]`` (padded,
with a mask) so every block is one ``torch.bmm`` over groups; the update (per-group clip +
Adam) is one set of tensor ops over ``[G, P]``. Groups never mix: each group's loss only
depends on its own parameter row, and clipping/Adam are row-wise.
"""

from __future__ import annotations

import heapq
import math
import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing.
_CLIP_EPS = 1e-6


@dataclass(frozen=True)
class DistillerShape:
    hidden_size: int
    intermediate_size: int = 384
    num_blocks: int = 2

    @property
    def block_numel(self) -> int:
        return self.num_blocks * self.intermediate_size * self.hidden_size

    @property
    def num_params(self) -> int:
        # gate, up: [NB, I, H]; down: [NB, H, I]
        return 3 * self.block_numel


@dataclass(frozen=True)
class AdamHyper:
    lr: float = 4e-4
    eps: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float | None = 0.5


@dataclass
class Packing:
    """Host-side plan mapping R rows onto ``[G, M]`` packed positions."""

    slots: np.ndarray  # int64 [G]: slot of each packed group (sorted, unique)
    row_group: np.ndarray  # int64 [R]: packed group of each row
    row_pos: np.ndarray  # int64 [R]: position of each row inside its group
    counts: np.ndarray  # int64 [G]
    max_rows: int


@dataclass
class TrainResult:
    """Outcome of one train step. ``losses``/``updated`` stay on the device (no host sync)."""

    slots: np.ndarray  # int64 [G] (host)
    losses: torch.Tensor  # fp32 [G]: MSE of each group before the update
    updated: torch.Tensor  # bool [G]: False where the loss/grad was non-finite (skipped)
    # Set once the values are final (CPU side thread); None: final after synchronize().
    done: threading.Event | None = None

    def ready(self) -> bool:
        """True when ``losses``/``updated`` can be read without waiting."""
        return self.done is None or self.done.is_set()


def make_packing(slots: torch.Tensor | np.ndarray) -> Packing:
    """Plan the per-group packing of rows; computed on the host so no device sync is needed."""
    s = slots.cpu().numpy() if isinstance(slots, torch.Tensor) else np.asarray(slots)
    s = s.astype(np.int64).reshape(-1)
    uniq, inv, counts = np.unique(s, return_inverse=True, return_counts=True)
    inv = inv.reshape(-1)
    order = np.argsort(inv, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    pos = np.empty_like(inv)
    pos[order] = np.arange(s.size, dtype=np.int64) - np.repeat(starts, counts)
    return Packing(
        uniq,
        inv.astype(np.int64),
        pos,
        counts.astype(np.int64),
        int(counts.max()) if counts.size else 0,
    )


def pack_rows(pk: Packing, x: torch.Tensor, m: int | None = None):
    """``x [R, H]`` -> padded ``[G, M, H]`` fp32 and its row mask ``[G, M]`` (the layout of
    the batched, graph-capturable update)."""
    g, m = len(pk.slots), pk.max_rows if m is None else m
    rg = torch.from_numpy(pk.row_group).to(x.device)
    rp = torch.from_numpy(pk.row_pos).to(x.device)
    xp = torch.zeros(g, m, x.shape[-1], device=x.device)
    xp[rg, rp] = x.float()
    mask = torch.zeros(g, m, dtype=torch.bool, device=x.device)
    mask[rg, rp] = True
    return xp, mask


def split_params(theta: torch.Tensor, shape: DistillerShape):
    """Views ``(gate [G,NB,I,H], up [G,NB,I,H], down [G,NB,H,I])`` into ``theta [G, P]``."""
    g, n = theta.shape[0], shape.block_numel
    nb, i, h = shape.num_blocks, shape.intermediate_size, shape.hidden_size
    return (
        theta[:, :n].reshape(g, nb, i, h),
        theta[:, n : 2 * n].reshape(g, nb, i, h),
        theta[:, 2 * n :].reshape(g, nb, h, i),
    )


def block_weights(theta: torch.Tensor, shape: DistillerShape) -> list[tuple[torch.Tensor, ...]]:
    """Per block ``(gate [B,I,H], up [B,I,H], down [B,H,I])``: views into ``theta [B, P]`` (or
    the same rows of ``m``/``v``, which share the layout)."""
    gate, up, down = split_params(theta, shape)
    return [(gate[:, b], up[:, b], down[:, b]) for b in range(shape.num_blocks)]


# Per block (h_in, a = h_in gate^T, u = h_in up^T, s = silu(a), p = s * u), each [B, M, .]:
# what the backward needs from the forward.
Activations = list[tuple[torch.Tensor, ...]]


def forward_acts(
    weights: list[tuple[torch.Tensor, ...]], xp: torch.Tensor
) -> tuple[torch.Tensor, Activations]:
    """``f`` of packed rows ``xp [B, M, H]`` (fp32; one batch entry per group) and the
    activations its backward needs. All-zero padding rows stay exactly zero (no biases)."""
    acts = []
    h = xp
    for gate, up, down in weights:
        a = torch.bmm(h, gate.transpose(1, 2))
        u = torch.bmm(h, up.transpose(1, 2))
        s = F.silu(a)
        p = s * u
        acts.append((h, a, u, s, p))
        h = h + torch.bmm(p, down.transpose(1, 2))
    return h, acts


def forward_packed(theta: torch.Tensor, xp: torch.Tensor, shape: DistillerShape) -> torch.Tensor:
    """``f`` for packed rows: ``theta [G, P]``, ``xp [G, M, H]`` -> ``[G, M, H]``."""
    return forward_acts(block_weights(theta, shape), xp)[0]


def init_params(shape: DistillerShape, init: str, seed: int) -> torch.Tensor:
    """One group's initial flat parameters (CPU, fp32), reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    n = shape.block_numel

    def uniform(fan_in: int) -> torch.Tensor:
        # nn.Linear's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        bound = 1.0 / math.sqrt(fan_in)
        return torch.rand(n, generator=gen, dtype=torch.float32).mul_(2 * bound).sub_(bound)

    gate, up = uniform(shape.hidden_size), uniform(shape.hidden_size)
    down = uniform(shape.intermediate_size)
    if init == "zero":
        down.zero_()  # every block starts as the identity residual: f(x) = x
    elif init != "paper":
        raise ValueError(f"unknown init {init!r} (expected 'paper' or 'zero')")
    return torch.cat([gate, up, down])


def adam_clip_update(
    theta: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    ok: torch.Tensor,
    hp: AdamHyper,
):
    """Row-wise clip + Adam (same formulas as clip_grad_norm_ + torch.optim.Adam).

    All tensors are ``[G, P]`` except ``step``/``ok`` ``[G]``. Rows with ``ok`` False keep
    their parameters and state unchanged. Returns new ``(theta, m, v, step)``.
    """
    b1, b2 = hp.betas
    grad = torch.where(ok[:, None], grad, torch.zeros_like(grad))
    if hp.grad_clip is not None:
        norm = torch.linalg.vector_norm(grad, dim=1)
        coef = (hp.grad_clip / (norm + _CLIP_EPS)).clamp(max=1.0)
        grad = grad * coef[:, None]
    step_n = step + 1
    m_n = m.lerp(grad, 1 - b1)
    v_n = v * b2 + (1 - b2) * grad * grad
    bc1 = 1 - torch.pow(b1, step_n)
    bc2_sqrt = torch.sqrt(1 - torch.pow(b2, step_n))
    denom = v_n.sqrt() / bc2_sqrt[:, None] + hp.eps
    theta_n = theta - (hp.lr / bc1)[:, None] * (m_n / denom)
    keep = ok[:, None]
    return (
        torch.where(keep, theta_n, theta),
        torch.where(keep, m_n, m),
        torch.where(keep, v_n, v),
        torch.where(ok, step_n, step),
    )


def _losses_and_grads(theta_g, xp, tp, mask, shape):
    """Per-group MSE and its gradient, flat ``[G, P]`` like ``theta_g`` (autograd; the
    graph-capturable CUDA path).

    The gradient is taken per weight matrix: differentiating through slices of one flat
    tensor would zero-fill a full ``[G, P]`` buffer for every slice.
    """
    gate, up, down = split_params(theta_g, shape)
    nb, g = shape.num_blocks, theta_g.shape[0]
    leaves = [w[:, b].detach().requires_grad_(True) for w in (gate, up, down) for b in range(nb)]
    with torch.enable_grad():
        blocks = list(zip(leaves[:nb], leaves[nb : 2 * nb], leaves[2 * nb :], strict=True))
        y = forward_acts(blocks, xp)[0]
        err = torch.where(mask[..., None], (y - tp).square(), torch.zeros_like(y))
        n = (mask.sum(1) * shape.hidden_size).clamp_min(1).to(y.dtype)
        losses = err.sum((1, 2)) / n
        grads = torch.autograd.grad(losses.sum(), leaves)
    grad = torch.cat(
        [torch.stack(grads[k * nb : (k + 1) * nb], 1).reshape(g, -1) for k in range(3)], dim=1
    )
    return losses.detach(), grad


# -- CPU path: all groups of a step at once, in place -----------------------------------
def _fused_adam_available() -> bool:
    return hasattr(torch, "_fused_adam_")


@dataclass
class HostBatch:
    """Where the packed groups of one step live in the stacked state.

    ``rows`` selects a block of state rows: a slice (so weights are views, nothing copied)
    when the slots fill a short range, else the slots themselves (weights gathered).
    ``pos [G]``: batch index of each packed group inside that block; batch entries that are
    no packed group get all-zero rows, so they contribute nothing and are never updated.
    """

    rows: slice | torch.Tensor
    pos: np.ndarray
    size: int

    @classmethod
    def plan(cls, slots: np.ndarray) -> HostBatch:
        lo, hi = int(slots[0]), int(slots[-1]) + 1  # slots: sorted, unique
        if hi - lo <= 2 * len(slots):
            return cls(slice(lo, hi), slots - lo, hi - lo)
        return cls(torch.from_numpy(slots), np.arange(len(slots)), len(slots))

    def take(self, state: torch.Tensor) -> torch.Tensor:
        return (
            state[self.rows] if isinstance(self.rows, slice) else state.index_select(0, self.rows)
        )

    def pack(self, pk: Packing, x: torch.Tensor) -> torch.Tensor:
        """``x [R, H]`` -> zero-padded fp32 ``[size, max_rows, H]``."""
        xp = torch.zeros(self.size, pk.max_rows, x.shape[-1], device=x.device)
        xp[self._index(pk)] = x.float()
        return xp

    def unpack(self, pk: Packing, yp: torch.Tensor) -> torch.Tensor:
        return yp[self._index(pk)]

    def _index(self, pk: Packing) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(self.pos[pk.row_group]), torch.from_numpy(pk.row_pos)


class HostTrainer:
    """clip_grad_norm_ + Adam for the packed groups of one step, in place, with the backward
    written out as batched products over groups (both cores work on it through torch's
    intra-op pool; 16-row products of one group alone run on one core).

    Each weight gradient is a product ``A^T B`` of two thin ``[M, .]`` factors, so its squared
    norm is ``sum((A A^T) * (B B^T))``: every group's clip coefficient is known from M x M
    Gram matrices before any gradient exists. Each weight's gradients (all groups) are then
    formed once, already clipped, in a scratch buffer that stays in cache, and handed to
    PyTorch's fused Adam kernel: per step the optimizer streams parameters and moments once,
    and no full-size gradient is ever written to memory.
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
    ) -> tuple[list[float], list[bool]]:
        """One update of each packed group; returns per group (loss, updated).

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
        denom = counts * shape.hidden_size
        losses = diff.square().sum((1, 2)) / denom
        dy = diff.mul_((2.0 / denom)[:, None, None])
        # (block, matrix 0/1/2 = gate/up/down, A, B): that matrix's gradient is A^T B.
        factors: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        sq = torch.zeros(batch.size)
        for b in reversed(range(len(weights))):
            gate, up, down = weights[b]
            h_in, a, u, s, p = acts[b]
            dp = torch.bmm(dy, down)
            du = dp * s
            sig = torch.sigmoid(a)
            da = dp * u * sig * (1 + a * (1 - sig))
            factors += [(b, 2, dy, p), (b, 1, du, h_in), (b, 0, da, h_in)]
            # ||A^T B||^2 = sum((A A^T) * (B B^T)); gate and up share B = h_in.
            gram_in = torch.bmm(h_in, h_in.transpose(1, 2))
            gram_g = torch.bmm(du, du.transpose(1, 2)) + torch.bmm(da, da.transpose(1, 2))
            sq += (torch.bmm(dy, dy.transpose(1, 2)) * torch.bmm(p, p.transpose(1, 2))).sum((1, 2))
            sq += (gram_g * gram_in).sum((1, 2))
            if b:
                dy = dy + torch.bmm(du, up) + torch.bmm(da, gate)
        loss_l = losses[torch.from_numpy(batch.pos)].tolist()
        sq_l = sq[torch.from_numpy(batch.pos)].tolist()
        ok = [math.isfinite(lo) and math.isfinite(q) for lo, q in zip(loss_l, sq_l, strict=True)]
        coef = torch.ones(batch.size)
        if hp.grad_clip is not None:
            for gi, q in enumerate(sq_l):
                if ok[gi]:
                    coef[batch.pos[gi]] = min(1.0, hp.grad_clip / (math.sqrt(q) + _CLIP_EPS))
        todo = [(int(batch.pos[gi]), int(slot)) for gi, slot in enumerate(pk.slots) if ok[gi]]
        if todo:
            self._update(theta, m, v, step, factors, coef, todo, batch.size)
        return loss_l, ok

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
        scale = coef[:, None, None]
        for b, k, a_f, b_f in factors:
            j = 3 * b + k
            w_shape = rows[0][0][j].shape
            grad = self.scratch[: size * numel].view(size, *w_shape)
            # Clipping folded into the thin factor: (c A)^T B = c (A^T B).
            torch.bmm((a_f * scale).transpose(1, 2), b_f, out=grad)
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
            torch._fused_adam_(
                ws,
                grads,
                ms,
                vs,
                [],
                steps,
                lr=hp.lr,
                beta1=b1,
                beta2=b2,
                weight_decay=0.0,
                eps=hp.eps,
                amsgrad=False,
                maximize=False,
            )
            return
        for w, grad, m, v, step in zip(ws, grads, ms, vs, steps, strict=True):
            n = float(step)
            m.lerp_(grad, 1 - b1)
            v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            denom = v.sqrt().div_(math.sqrt(1 - b2**n)).add_(hp.eps)
            w.addcdiv_(m, denom, value=-hp.lr / (1 - b1**n))


def train_packed(
    theta: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    gslots: torch.Tensor,
    gvalid: torch.Tensor,
    xp: torch.Tensor,
    tp: torch.Tensor,
    mask: torch.Tensor,
    shape: DistillerShape,
    hp: AdamHyper,
):
    """One Adam step per packed group, written in place into the slot state.

    ``gslots [G]`` must be distinct except for padding groups (``gvalid`` False), which may
    all point at one scratch slot. Loss of group g: mean over its rows (``mask``) and hidden
    dims of ``(f(x) - target)^2``. Fixed shapes and no host sync, so it can be graph-captured.
    Returns ``(losses [G], updated [G])``.
    """
    theta_g = theta.index_select(0, gslots)
    losses, grad = _losses_and_grads(theta_g, xp, tp, mask, shape)
    with torch.no_grad():
        ok = gvalid & torch.isfinite(losses) & torch.isfinite(grad).all(1)
        t, m_n, v_n, s_n = adam_clip_update(
            theta_g.detach(),
            grad,
            m.index_select(0, gslots),
            v.index_select(0, gslots),
            step.index_select(0, gslots),
            ok,
            hp,
        )
        theta.index_copy_(0, gslots, t)
        m.index_copy_(0, gslots, m_n)
        v.index_copy_(0, gslots, v_n)
        step.index_copy_(0, gslots, s_n)
    return losses, ok


class GroupedDistiller:
    """Slots of independent distillers with stacked fp32 parameters and Adam state (CPU path;
    see :mod:`algorithms.esamp.cuda` for the stream/graph version).

    With ``side_thread=True`` training steps and slot resets run on a
    :class:`~algorithms.esamp.side_thread.SideThread`, in order; every method that reads the
    state (``predict``, ``synchronize``, growth) first waits for them, so a prediction always
    sees every update submitted before it (strict staleness).

    A prediction keeps its forward activations; a train step on the same rows with the
    parameters unchanged since (the usual ESamp step: predict in the sampler, then train on
    those rows) reuses them instead of running the forward again.
    """

    _SCRATCH = 0  # extra rows past capacity (the CUDA path pads graph groups into one)

    def __init__(
        self,
        hidden_size: int,
        *,
        intermediate_size: int = 384,
        num_blocks: int = 2,
        lr: float = 4e-4,
        eps: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float | None = 0.5,
        init: str = "paper",
        seed: int = 0,
        capacity: int = 4,
        device: torch.device | str = "cpu",
        side_thread: bool = False,
    ):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.shape = DistillerShape(hidden_size, intermediate_size, num_blocks)
        self.hp = AdamHyper(lr, eps, tuple(betas), grad_clip)
        self.device = torch.device(device)
        self.template = init_params(self.shape, init, seed).to(self.device)
        self._capacity = 0
        self.theta = self.m = self.v = self.step = torch.empty(0)
        self._free: list[int] = []
        self._live: set[int] = set()
        self._side = None
        if side_thread:
            from algorithms.esamp.side_thread import SideThread

            self._side = SideThread("tllm-esamp-update")
        self._host = HostTrainer(self.shape, self.hp)
        # Bumped by every change of the parameters (update, slot reset, growth).
        self._version = 0
        # The last prediction: (version, slots [G], x fp32 [R, H], packed (f, activations)).
        self._saved: tuple[int, np.ndarray, torch.Tensor, list] | None = None
        self._grow(capacity)

    @property
    def asynchronous(self) -> bool:
        """True when train steps return before they have run (read results after
        :meth:`synchronize`)."""
        return self._side is not None

    def _wait_side(self) -> None:
        if self._side is not None:
            self._side.wait()

    def close(self) -> None:
        """Finish pending work and stop the side thread (if any)."""
        if self._side is not None:
            self._side.wait()
            self._side.close()
            self._side = None

    # -- slots ----------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def live_slots(self) -> list[int]:
        return sorted(self._live)

    def _grow(self, new_capacity: int) -> None:
        """Reallocate the stacked state; new slots start from the template."""
        self._wait_side()  # pending jobs hold views of the old storage
        self._version += 1
        rows = new_capacity + self._SCRATCH
        p, dev = self.shape.num_params, self.device
        theta = self.template.expand(rows, p).clone()
        m = torch.zeros(rows, p, device=dev)
        v = torch.zeros(rows, p, device=dev)
        step = torch.zeros(rows, device=dev)
        old = self._capacity
        if old:
            theta[:old].copy_(self.theta[:old])
            m[:old].copy_(self.m[:old])
            v[:old].copy_(self.v[:old])
            step[:old].copy_(self.step[:old])
        self.theta, self.m, self.v, self.step = theta, m, v, step
        for s in range(old, new_capacity):
            heapq.heappush(self._free, s)
        self._capacity = new_capacity

    def alloc(self) -> int:
        """A fresh slot (state at init); doubles the capacity when all slots are live."""
        if not self._free:
            # vLLM calls consumers under inference mode; state made there could not be
            # trained in place later.
            with torch.inference_mode(False):
                self._grow(2 * self._capacity)
        slot = heapq.heappop(self._free)
        self._live.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Release ``slot``: its parameters go back to init and its Adam state to zero."""
        if slot not in self._live:
            raise ValueError(f"slot {slot} is not live (live: {self.live_slots})")
        self._reset(slot)
        self._live.remove(slot)
        heapq.heappush(self._free, slot)

    def _reset(self, slot: int) -> None:
        def reset() -> None:
            self.theta[slot].copy_(self.template)
            self.m[slot].zero_()
            self.v[slot].zero_()
            self.step[slot].zero_()

        self._version += 1
        # Queued after the slot's pending updates, before any later use of the slot.
        self._side.submit(reset) if self._side is not None else reset()

    def _check_live(self, pk: Packing) -> None:
        dead = [int(s) for s in pk.slots if int(s) not in self._live]
        if dead:
            raise ValueError(f"slots {dead} are not live (live: {self.live_slots})")

    # -- math -----------------------------------------------------------------------
    def predict(self, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``f_slot(x)`` for each row: ``slots [R]`` (host), ``x [R, H]`` -> fp32 ``[R, H]``."""
        pk = make_packing(slots)
        if not pk.slots.size:
            return torch.zeros(0, self.shape.hidden_size, device=x.device)
        self._check_live(pk)
        self._wait_side()
        with torch.no_grad():
            # A copy: x may be a view of a capture buffer that the next step overwrites.
            x = x.to(torch.float32, copy=True)
            batch = HostBatch.plan(pk.slots)
            fwd = forward_acts(block_weights(batch.take(self.theta), self.shape), batch.pack(pk, x))
            self._saved = (self._version, pk.slots, x, fwd)
            return batch.unpack(pk, fwd[0])

    def _saved_forward(self, pk: Packing, x: torch.Tensor) -> tuple | None:
        """The last prediction's packed forward if it was on exactly these rows and
        parameters (checked, not assumed: the inputs are compared)."""
        saved, self._saved = self._saved, None
        if saved is None:
            return None
        version, slots, x_saved, fwd = saved
        if (
            version != self._version
            or not np.array_equal(slots, pk.slots)
            or x.shape != x_saved.shape
            or not torch.equal(x.float(), x_saved)
        ):
            return None
        return fwd

    def train_step(self, slots: torch.Tensor, x: torch.Tensor, target: torch.Tensor) -> TrainResult:
        """One Adam step per group present, on that group's rows (MSE averaged over them).

        Groups whose loss or gradient is non-finite are skipped (``updated`` False).
        """
        pk = make_packing(slots)
        if not pk.slots.size:
            empty = torch.zeros(0, device=self.device)
            return TrainResult(pk.slots, empty, empty.bool())
        self._check_live(pk)
        # vLLM runs sampling under inference mode; its tensors cannot enter autograd, so
        # train outside it (subclasses override _train only).
        with torch.inference_mode(False):
            fwd = self._saved_forward(pk, x)
            self._version += 1
            return self._train(pk, x.clone(), target.clone(), fwd)

    def _train(
        self, pk: Packing, x: torch.Tensor, target: torch.Tensor, forward: tuple | None = None
    ) -> TrainResult:
        """CPU: one in-place update of all packed groups (see :class:`HostTrainer`), inline or
        queued on the side thread; ``losses``/``updated`` are filled when the update has run.
        ``forward``: the packed forward on these rows (from :meth:`predict`), or None."""
        losses = torch.full((len(pk.slots),), float("nan"))
        updated = torch.zeros(len(pk.slots), dtype=torch.bool)
        done = threading.Event()

        def run() -> None:
            state = (self.theta, self.m, self.v, self.step)
            batch = HostBatch.plan(pk.slots)
            loss, ok = self._host.step(state, pk, batch, x, target, forward)
            losses.copy_(torch.tensor(loss))
            updated.copy_(torch.tensor(ok))
            done.set()

        self._side.submit(run) if self._side is not None else run()
        return TrainResult(pk.slots, losses, updated, done)

    def synchronize(self) -> None:
        """Wait for pending work (the side thread's queue on CPU)."""
        self._wait_side()

    def memory_bytes_per_group(self) -> int:
        """Parameters + Adam moments + step counter of one slot, in bytes (fp32)."""
        return (3 * self.shape.num_params + 1) * 4

    def memory_bytes(self) -> int:
        """Bytes held by the stacked state (all slots, live or not) plus the template."""
        return (
            self._capacity + self._SCRATCH
        ) * self.memory_bytes_per_group() + self.shape.num_params * 4


def make_distiller(
    hidden_size: int,
    device: torch.device | str,
    use_cuda_graph: bool = True,
    side_thread: bool = False,
    **kwargs,
) -> GroupedDistiller:
    """The CUDA implementation (side stream, graphs) for CUDA devices, else the CPU one
    (updates on a side thread when ``side_thread``)."""
    device = torch.device(device)
    if device.type == "cuda":
        from algorithms.esamp.cuda import CudaGroupedDistiller

        return CudaGroupedDistiller(
            hidden_size, device=device, use_cuda_graph=use_cuda_graph, **kwargs
        )
    return GroupedDistiller(hidden_size, device=device, side_thread=side_thread, **kwargs)

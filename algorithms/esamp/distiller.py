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

    def group_rows(self, gi: int) -> torch.Tensor:
        """Indices (host int64) of the rows of packed group ``gi``, in row order."""
        return torch.from_numpy(np.nonzero(self.row_group == gi)[0])


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


def forward_packed(theta: torch.Tensor, xp: torch.Tensor, shape: DistillerShape) -> torch.Tensor:
    """``f`` for packed rows: ``theta [G, P]``, ``xp [G, M, H]`` -> ``[G, M, H]``."""
    gate, up, down = split_params(theta, shape)
    nb = shape.num_blocks
    return _forward_blocks(
        [gate[:, b] for b in range(nb)],
        [up[:, b] for b in range(nb)],
        [down[:, b] for b in range(nb)],
        xp,
    )


def _forward_blocks(gate: list, up: list, down: list, xp: torch.Tensor) -> torch.Tensor:
    h = xp
    for g, u_w, d in zip(gate, up, down, strict=True):
        a = torch.bmm(h, g.transpose(1, 2))
        u = torch.bmm(h, u_w.transpose(1, 2))
        h = h + torch.bmm(F.silu(a) * u, d.transpose(1, 2))
    return h


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
        y = _forward_blocks(leaves[:nb], leaves[nb : 2 * nb], leaves[2 * nb :], xp)
        err = torch.where(mask[..., None], (y - tp).square(), torch.zeros_like(y))
        n = (mask.sum(1) * shape.hidden_size).clamp_min(1).to(y.dtype)
        losses = err.sum((1, 2)) / n
        grads = torch.autograd.grad(losses.sum(), leaves)
    grad = torch.cat(
        [torch.stack(grads[k * nb : (k + 1) * nb], 1).reshape(g, -1) for k in range(3)], dim=1
    )
    return losses.detach(), grad


# -- CPU path: one group at a time, in place ---------------------------------------------
def group_matrices(row: torch.Tensor, shape: DistillerShape) -> list[tuple[torch.Tensor, ...]]:
    """Per block ``(gate [I,H], up [I,H], down [H,I])``: views into one flat row of theta, m
    or v (the same layout for all three)."""
    gate, up, down = split_params(row[None], shape)
    return [(gate[0, b], up[0, b], down[0, b]) for b in range(shape.num_blocks)]


# Per block (h_in, a = h_in gate^T, u = h_in up^T, s = silu(a), p = s * u): what the backward
# needs from the forward.
Activations = list[tuple[torch.Tensor, ...]]


def forward_acts(
    mats: list[tuple[torch.Tensor, ...]], x: torch.Tensor
) -> tuple[torch.Tensor, Activations]:
    """``f(x)`` of one group (``x [R, H]`` fp32) and the activations its backward needs."""
    acts = []
    h = x
    for gate, up, down in mats:
        a, u = h @ gate.t(), h @ up.t()
        s = F.silu(a)
        p = s * u
        acts.append((h, a, u, s, p))
        h = h + p @ down.t()
    return h, acts


def _fused_adam_available() -> bool:
    return hasattr(torch, "_fused_adam_")


class HostTrainer:
    """clip_grad_norm_ + Adam for one group's rows, in place, with the backward written out.

    Each weight gradient is a product ``A^T B`` of two thin ``[R, .]`` factors, so its squared
    norm is ``sum((A A^T) * (B B^T))``: the clip coefficient is known from R x R Gram matrices
    before any gradient exists. Each gradient matrix is then formed once, already clipped, in
    a scratch buffer that stays in cache, and handed straight to PyTorch's fused Adam kernel:
    per step the optimizer streams parameters and moments once, and no full-size gradient is
    ever written to memory.
    """

    def __init__(self, shape: DistillerShape, hp: AdamHyper):
        self.shape, self.hp = shape, hp
        self.scratch = torch.empty(shape.intermediate_size * shape.hidden_size)
        self.fused = _fused_adam_available()

    def step(
        self,
        theta: torch.Tensor,
        m: torch.Tensor,
        v: torch.Tensor,
        step: torch.Tensor,
        x: torch.Tensor,
        target: torch.Tensor,
        forward: tuple[torch.Tensor, Activations] | None = None,
    ) -> tuple[float, bool]:
        """One update of the group whose flat state rows are given; returns (loss, updated).

        ``step`` is the group's 0-d step counter. ``forward``: :func:`forward_acts` of these
        parameters on ``x``, when already computed (a prediction of the same rows). A
        non-finite loss or gradient norm leaves the state untouched (updated False).
        """
        mats = group_matrices(theta, self.shape)
        h, acts = forward if forward is not None else forward_acts(mats, x)
        diff = h - target
        loss = float(diff.square().mean())
        dy = diff.mul_(2.0 / diff.numel())
        # (block, matrix 0/1/2 = gate/up/down, A, B): that matrix's gradient is A^T B.
        factors: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        sq_terms = []
        for b in reversed(range(len(mats))):
            gate, up, down = mats[b]
            h_in, a, u, s, p = acts[b]
            dp = dy @ down
            du = dp * s
            sig = torch.sigmoid(a)
            da = dp * u * sig * (1 + a * (1 - sig))
            factors += [(b, 2, dy, p), (b, 1, du, h_in), (b, 0, da, h_in)]
            # ||A^T B||^2 = sum((A A^T) * (B B^T)); gate and up share B = h_in.
            sq_terms.append(
                ((dy @ dy.t()) * (p @ p.t())).sum()
                + ((du @ du.t() + da @ da.t()) * (h_in @ h_in.t())).sum()
            )
            if b:
                dy = dy + du @ up + da @ gate
        sq = float(torch.stack(sq_terms).sum())
        if not (math.isfinite(loss) and math.isfinite(sq)):
            return loss, False
        hp = self.hp
        coef = 1.0
        if hp.grad_clip is not None:
            coef = min(1.0, hp.grad_clip / (math.sqrt(sq) + _CLIP_EPS))
        step += 1
        m_mats, v_mats = group_matrices(m, self.shape), group_matrices(v, self.shape)
        for b, k, a_f, b_f in factors:
            w = mats[b][k]
            grad = self.scratch[: w.numel()].view(w.shape)
            torch.mm(a_f.t(), b_f, out=grad)
            if coef < 1.0:
                grad.mul_(coef)
            self._adam(w, grad, m_mats[b][k], v_mats[b][k], step)
        return loss, True

    def _adam(self, w, grad, m, v, step) -> None:
        hp = self.hp
        b1, b2 = hp.betas
        if self.fused:
            torch._fused_adam_(
                [w],
                [grad],
                [m],
                [v],
                [],
                [step],
                lr=hp.lr,
                beta1=b1,
                beta2=b2,
                weight_decay=0.0,
                eps=hp.eps,
                amsgrad=False,
                maximize=False,
            )
            return
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
        # The last prediction: (version, slots [G], x fp32 [R, H], per group (f, activations)).
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
            y = torch.empty_like(x)
            fwd = []
            for gi, slot in enumerate(pk.slots.tolist()):
                rows = pk.group_rows(gi).to(x.device)
                mats = group_matrices(self.theta[slot], self.shape)
                fwd.append(forward_acts(mats, x.index_select(0, rows)))
                y.index_copy_(0, rows, fwd[-1][0])
            self._saved = (self._version, pk.slots, x, fwd)
            return y

    def _saved_forward(self, pk: Packing, x: torch.Tensor) -> list | None:
        """The last prediction's per-group forward if it was on exactly these rows and
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
        self, pk: Packing, x: torch.Tensor, target: torch.Tensor, forward: list | None = None
    ) -> TrainResult:
        """CPU: one in-place update per group (see :class:`HostTrainer`), inline or queued on
        the side thread; ``losses``/``updated`` are filled when the update has run.
        ``forward``: the groups' forward on these rows (from :meth:`predict`), or None."""
        losses = torch.full((len(pk.slots),), float("nan"))
        updated = torch.zeros(len(pk.slots), dtype=torch.bool)
        x, target = x.float(), target.float()
        groups = [(gi, slot, pk.group_rows(gi)) for gi, slot in enumerate(pk.slots.tolist())]

        done = threading.Event()

        def run() -> None:
            for gi, slot, rows in groups:
                loss, ok = self._host.step(
                    self.theta[slot],
                    self.m[slot],
                    self.v[slot],
                    self.step[slot],
                    x.index_select(0, rows),
                    target.index_select(0, rows),
                    forward[gi] if forward is not None else None,
                )
                losses[gi], updated[gi] = loss, ok
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

"""The update graph's body (``graph_update.train_groups`` with ``mlp.forward_slots`` and
``backward.fused_backward``) as a whole: its launches, the slots it leaves alone (padding
groups, masked rows, a group with a non-finite loss), the gradient norm it measures, and the
CUDA distiller's graphs on CPU stubs. Its values against autograd + torch.optim: in
test_esamp_ops_reference.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from algorithms.esamp import graph_update, kernels
from algorithms.esamp.graph_update import slot_matmul
from algorithms.esamp.mlp import (
    batched_mm,
    forward_acts,
    forward_slots,
    pair_view,
)
from algorithms.esamp.params import AdamHyper, DistillerShape, block_weights, init_params

SHAPE = DistillerShape(hidden_size=24, intermediate_size=9)  # 2 blocks
SLOTS, ROWS = 4, 5
GROUP_SLOT = (2, -1, 0, 3)  # group 1: padding; slot 1 in no group
COUNTS = (5, 0, 3, 4)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _state(seed: int = 0) -> list[torch.Tensor]:
    theta = torch.stack([init_params(SHAPE, "paper", seed=s) for s in range(SLOTS)])
    gen = torch.Generator().manual_seed(seed)
    m = 0.01 * torch.randn(theta.shape, generator=gen)
    v = 0.001 * torch.rand(theta.shape, generator=gen)
    return [theta, m, v, torch.tensor([3.0, 1.0, 2.0, 5.0])]


def _rows(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.arange(ROWS)[None, :] < torch.tensor(COUNTS)[:, None]
    xp = torch.randn(len(COUNTS), ROWS, SHAPE.hidden_size, generator=gen) * mask[..., None]
    tp = torch.randn(len(COUNTS), ROWS, SHAPE.hidden_size, generator=gen)
    tp[0, 4] = float("nan")  # a marked row of group 0: its loss is not finite
    tp[2, 4] = float("nan")  # an unmarked row of group 2: ignored
    return xp, tp, mask


def _slot_weights(theta: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Each group's weights (zeros for a padding group): the dense form of the slots."""
    rows = torch.stack([theta[max(s, 0)] * (s >= 0) for s in GROUP_SLOT])
    return block_weights(rows, SHAPE)


def test_forward_slots_equals_forward_acts():
    """On the CPU ops: the paired forward (into fresh tensors and into act buffers at an odd
    offset, a and u one pair view) equals the plain forward of each group's weights: bit for
    bit into fresh tensors; to float rounding into the buffers at the odd offset, where the
    BLAS kernel may take another path for the misaligned output (seen on some CPUs)."""
    theta = _state()[0]
    xp, _, _ = _rows(1)
    gs = torch.tensor(GROUP_SLOT)

    def mm(x, w, transpose_w, out=None, add=None):
        return slot_matmul(x, w, gs, transpose_w, out=out, add=add)

    h_ref, acts_ref = forward_acts(_slot_weights(theta), xp, batched_mm)
    h, acts = forward_slots(theta, SHAPE, xp, mm)
    g, i, hid = len(GROUP_SLOT), SHAPE.intermediate_size, SHAPE.hidden_size
    flat = torch.full((7 + 2 * g * ROWS * (hid + 4 * i),), float("nan"))
    bufs, at = [], 7
    for _ in range(2):
        block = []
        for width in (hid, i, i, i, i):
            block.append(flat[at : at + g * ROWS * width].view(g, ROWS, width))
            at += g * ROWS * width
        bufs.append(tuple(block))
    h_kept, acts_kept = forward_slots(theta, SHAPE, xp, mm, out=bufs)
    assert torch.equal(h, h_ref)
    for blk, ref in zip(acts, acts_ref, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(blk, ref, strict=True))
    torch.testing.assert_close(h_kept, h_ref, rtol=1e-6, atol=1e-6)
    for blk, ref in zip(acts_kept, acts_ref, strict=True):
        for a, b in zip(blk, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="equally strided views of one buffer"):
        pair_view(bufs[0][2], bufs[0][1])  # u before a


def _stacked_forward(theta: torch.Tensor, xp: torch.Tensor, mm) -> tuple:
    """The forward as the CUDA path keeps it: the packed inputs and every block's output in
    one buffer (block inputs equally spaced), a, u, s, p of every block in another; the
    packed inputs are a copy of ``xp`` there."""
    nb, (g, rows, hid), i = SHAPE.num_blocks, xp.shape, SHAPE.intermediate_size
    hs = torch.zeros(nb + 1, g, rows, hid)
    hs[0] = xp
    inner = torch.zeros(nb, 4, g, rows, i)
    bufs = [(hs[b + 1], *inner[b].unbind(0)) for b in range(nb)]
    return forward_slots(theta, SHAPE, hs[0], mm, out=bufs)


class _Counted:
    """A slot op that counts its calls."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("stacked", [False, True], ids=["own_forward", "kept_forward"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_train_groups_launches_and_leaves_other_slots(reduction, stacked):
    """Own forward: down of both blocks in one Adam call, gate and up one per block (the
    inputs are not equally spaced); the forward kept as the CUDA path keeps it: two Adam
    calls in all. Slots in no group and groups not finite are left bit for bit (the values
    are checked against autograd + torch.optim in test_esamp_ops_reference.py)."""
    hp = AdamHyper(lr=1e-2, grad_clip=0.05, loss_reduction=reduction)
    ours = _state()
    before = [t.clone() for t in ours]
    applied = torch.zeros(SLOTS, dtype=torch.long)
    gs = torch.tensor(GROUP_SLOT)
    adam = _Counted(kernels.grad_adam)
    ops = (slot_matmul, adam)
    for seed in range(2):
        xp, tp, mask = _rows(seed)
        fwd = None
        if stacked:
            fwd = _stacked_forward(
                ours[0], xp, lambda x, w, t, **kw: slot_matmul(x, w, gs, t, **kw)
            )
        losses, ok = graph_update.train_groups(
            *ours, gs, xp, tp, mask, SHAPE, hp, applied, ops=ops, forward=fwd
        )
        assert ok.tolist() == [False, False, True, True]
        assert torch.isfinite(losses[2:]).all()
    for t, old in zip(ours, before, strict=True):
        for s in (1, 2):  # in no group; group 0's slot (non-finite loss)
            assert torch.equal(t[s], old[s])
    assert applied.tolist() == [2, 0, 2, 2]  # group 0 processed (skipped), padding not
    assert adam.calls == 2 * (2 if stacked else 3)


@pytest.mark.usefixtures("cuda_on_cpu")
def test_the_cuda_prediction_measures_a_missed_update():
    """The CUDA distiller's prediction graph (computing on CPU, kernels.stale_max) sees an update
    submitted for its slot and not yet applied: the host counts one more than the device
    applied (as if the update were still queued), the prediction measures lag 1."""
    from algorithms.esamp.cuda import CudaGroupedDistiller

    d = CudaGroupedDistiller(24, device="cpu", intermediate_size=9, capacity=3, graph_max_rows=4)
    a, b = d.alloc(), d.alloc()
    x = torch.randn(4, 24)
    d.train_step(torch.tensor([a, a, b, b]), x, x + 1)
    d.predict(torch.tensor([a, b]), x[:2])
    assert d.results.stale.tolist() == [0]  # the device maximum (CPU here)
    d._submitted[b] += 1  # an update of b submitted, not applied
    d.predict(torch.tensor([a, b, b]), x[:3])
    assert d.results.stale.tolist() == [1]
    d.train_step(torch.tensor([a]), x[:1], x[:1])  # the next result copy carries it
    d.synchronize()
    assert d.staleness_max() == 1


@pytest.mark.usefixtures("cuda_on_cpu")
def test_the_cuda_update_logs_losses_ok_and_stats_like_the_cpu_distiller():
    """The update graph writes each group's loss, ok and optimizer statistics into its row of
    the result ring (computing on CPU): read back, they equal the CPU distiller's for the same
    steps; a group with a non-finite target is not ok and has NaN statistics."""
    from algorithms.esamp.cpu import GroupedDistiller
    from algorithms.esamp.cuda import CudaGroupedDistiller

    kw = dict(intermediate_size=9, lr=1e-2, capacity=3, optimizer_stats=True)
    cpu = GroupedDistiller(24, **kw)
    gpu = CudaGroupedDistiller(24, device="cpu", graph_max_rows=4, **kw)
    slots = [cpu.alloc() for _ in range(3)]
    assert [gpu.alloc() for _ in range(3)] == slots
    gen = torch.Generator().manual_seed(3)
    rows = torch.tensor([slots[0]] * 3 + [slots[2]] * 2 + [slots[1]])
    for step in range(3):
        x, t = torch.randn(6, 24, generator=gen), torch.randn(6, 24, generator=gen)
        if step == 1:
            t[5, 0] = float("nan")  # slot 1's group: skipped
        a, b = cpu.train_step(rows, x, t), gpu.train_step(rows, x, t)
        gpu.synchronize()
        assert a.slots.tolist() == b.slots.tolist()
        assert b.updated.tolist() == a.updated.tolist() == [True, step != 1, True]
        torch.testing.assert_close(b.losses, a.losses, rtol=1e-5, atol=1e-6, equal_nan=True)
        torch.testing.assert_close(b.stats, a.stats, rtol=1e-3, atol=1e-6, equal_nan=True)
        assert b.stats[1].isnan().all() == (step == 1)


def test_the_captured_graphs_use_no_cublas():
    """Every product of the CUDA distiller's graphs is a Triton kernel (``slot_matmul``,
    ``grad_adam``, ``block_backward``): its side stream never makes a cuBLAS workspace, so no
    captured product writes into memory outside the graphs' pool (a workspace made before
    capture would be shared by every replay and freed under it by anything that clears
    cuBLAS's workspaces)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from algorithms.esamp.cuda import CudaGroupedDistiller
    from tllm_core.testing.fake_cuda import FakeCuda

    seen: set[str] = set()

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func._schema.name)
            return func(*args, **(kwargs or {}))

    with FakeCuda() as fc, Ops():
        CudaGroupedDistiller(
            SHAPE.hidden_size, device=fc.device, intermediate_size=SHAPE.intermediate_size,
            capacity=SLOTS, graph_max_rows=ROWS,
        )  # fmt: skip
    assert "tllm_esamp::slot_matmul" in seen and "tllm_esamp::grad_adam" in seen, seen
    cublas = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::matmul"}
    assert not seen & cublas, seen & cublas


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_update_measures_the_gradient_autograd_finds(reduction):
    """The loss and the gradient norm before clipping (statistics column ``grad_norm``) equal
    torch.autograd's on the same weights and rows, the loss written from its definition
    (summed squared error of the marked rows over rows, or over rows x hidden). The clip and
    Adam cancel any uniform scale of the gradient, so the update's weights alone would not
    show a wrong loss or gradient scale; this does."""
    from algorithms.esamp.params import STATS

    hp = AdamHyper(lr=1e-2, grad_clip=0.05, loss_reduction=reduction, stats=True)
    state = _state()
    theta = state[0].clone()
    xp, tp, mask = _rows(4)
    gs = torch.tensor(GROUP_SLOT)
    stats = torch.full((len(GROUP_SLOT), len(STATS)), float("nan"))
    losses, ok = graph_update.train_groups(*state, gs, xp, tp, mask, SHAPE, hp, stats=stats)
    norm_col = STATS.index("grad_norm")
    checked = 0
    for g, s in enumerate(GROUP_SLOT):
        if s < 0 or not ok[g]:
            continue
        leaf = theta[s].clone().requires_grad_(True)
        weights = block_weights(leaf[None], SHAPE)
        n = int(mask[g].sum())
        h = xp[g, :n]
        for gate, up, down in weights:
            h = h + (F.silu(h @ gate[0].T) * (h @ up[0].T)) @ down[0].T
        err = (h - tp[g, :n]).square().sum()
        loss = err / (n * (SHAPE.hidden_size if reduction == "mean" else 1))
        (grad,) = torch.autograd.grad(loss, leaf)
        torch.testing.assert_close(losses[g], loss.detach(), rtol=1e-5, atol=0)
        torch.testing.assert_close(stats[g, norm_col], grad.norm(), rtol=1e-4, atol=0)
        checked += 1
    assert checked == 2  # groups 2 and 3 (0: non-finite loss; 1: padding)

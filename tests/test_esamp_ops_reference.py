"""Every path of ESamp's update against ONE reference: ``torch.autograd`` through the
distiller's blocks written from their definition, ``torch.nn.utils.clip_grad_norm_`` and
``torch.optim.Adam``, one optimizer per group.

Paths: the CPU distiller (:class:`~algorithms.esamp.cpu.GroupedDistiller`, fp32 moments
only), the graph-capturable update (:func:`~algorithms.esamp.graph_update.train_groups`) on
the kernels' PyTorch reference ops, the same update on the Triton kernels under Triton's
interpreter, and on CUDA where a GPU is present. Parametrized over group layouts (with a
padding group, a slot in no group and a group whose loss is not finite at the first step),
both loss reductions and both moment dtypes. The loss, the clip (active: the gradient norms
are far above it) and the bias corrections each show in what is compared: losses, Adam's
moments and the weights after two steps."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from esamp_kernel_helpers import interpreted_kernels

from algorithms.esamp import graph_update, mlp
from algorithms.esamp.params import AdamHyper, DistillerShape, block_weights, init_params

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

SHAPE = DistillerShape(hidden_size=24, intermediate_size=9)  # 2 blocks
SLOTS, ROWS, STEPS = 4, 5, 2
# (group -> slot (-1: padding), rows per group, group whose loss is NaN at step 0)
LAYOUTS = {
    "1group": ((1,), (4,), None),
    "4groups": ((2, -1, 0, 3), (5, 0, 3, 2), 3),
}
CLIP = 0.05


def _hyper(reduction: str) -> AdamHyper:
    return AdamHyper(lr=1e-2, eps=1e-6, grad_clip=CLIP, loss_reduction=reduction)


def _theta0() -> torch.Tensor:
    return torch.stack([init_params(SHAPE, "paper", seed=s) for s in range(SLOTS)])


def _steps(layout: str) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per step the packed rows ``xp``, targets ``tp`` ``[G, M, H]`` and ``mask [G, M]``."""
    slots, counts, nan_group = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(7)
    mask = torch.arange(ROWS)[None, :] < torch.tensor(counts)[:, None]
    out = []
    for step in range(STEPS):
        xp = torch.randn(len(slots), ROWS, SHAPE.hidden_size, generator=gen) * mask[..., None]
        tp = 3 * torch.randn(len(slots), ROWS, SHAPE.hidden_size, generator=gen)
        if step == 0 and nan_group is not None:
            tp[nan_group, 0] = float("nan")
        out.append((xp, tp, mask))
    return out


def _reference(layout: str, hp: AdamHyper) -> dict[str, list]:
    """Per slot the weights, Adam's moments and step count after the steps, and per step
    each group's loss (NaN: skipped), from autograd + clip_grad_norm_ + torch.optim.Adam."""
    theta = _theta0()
    m, v = torch.zeros_like(theta), torch.zeros_like(theta)
    count = torch.zeros(SLOTS)
    losses = []
    slots, _, _ = LAYOUTS[layout]
    leaves = {s: theta[s].clone().requires_grad_(True) for s in slots if s >= 0}
    opts = {
        s: torch.optim.Adam([p], lr=hp.lr, betas=hp.betas, eps=hp.eps) for s, p in leaves.items()
    }
    for xp, tp, mask in _steps(layout):
        step_losses = []
        for g, s in enumerate(slots):
            if s < 0:
                step_losses.append(float("nan"))
                continue
            n = int(mask[g].sum())
            h = xp[g, :n]
            for gate, up, down in block_weights(leaves[s][None], SHAPE):
                h = h + (F.silu(h @ gate[0].T) * (h @ up[0].T)) @ down[0].T
            if hp.loss_reduction == "mean":
                loss = F.mse_loss(h, tp[g, :n])
            else:
                loss = F.mse_loss(h, tp[g, :n], reduction="sum") / n
            opts[s].zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_([leaves[s]], hp.grad_clip)
            if not (torch.isfinite(loss) and torch.isfinite(norm)):
                step_losses.append(float("nan"))
                continue
            assert norm > 2 * hp.grad_clip  # the clip is active
            opts[s].step()
            step_losses.append(loss.item())
        losses.append(step_losses)
    for s, p in leaves.items():
        state = opts[s].state.get(p)
        theta[s] = p.detach()
        if state:
            m[s], v[s], count[s] = state["exp_avg"], state["exp_avg_sq"], state["step"]
    return {"state": [theta, m, v, count], "losses": losses}


def _interpreted() -> SimpleNamespace:
    """The update's kernel calls, each the Triton kernel under the interpreter (small tiles:
    several per matrix, ragged edges)."""
    jit = interpreted_kernels()
    from algorithms.esamp.graph_update import slot_matmul
    from algorithms.esamp.kernels import (
        INPUT_PRECISIONS,
        norm_parts,
        op_block_backward,
        op_grad_adam,
        op_loss_dy,
        op_silu_mul,
        op_slot_matmul,
        op_update_tail,
    )
    from algorithms.esamp.kernels import slot_matmul as slot_matmul_op

    def update_tail(*args, grad_clip, clip_eps):
        clip = -1.0 if grad_clip is None else grad_clip
        op_update_tail.run_triton(*args, clip, clip_eps, kernels=jit, block_g=2)

    def mm(x, w, gs, transpose_w, out=None, add=None, precision="ieee"):
        if out is None:
            out = slot_matmul(x, w, gs, transpose_w)  # the shape (values overwritten)
        op_slot_matmul.run_triton(
            x, w, gs, out, transpose_w, "ieee", 2, add, kernels=jit, block_n=16, block_k=16
        )
        return out

    def adam(*args, lr, betas, eps, input_precision="ieee"):
        op_grad_adam.run_triton(*args, lr, *betas, eps, kernels=jit, block_n=8, block_k=16)

    kernels = SimpleNamespace(
        silu_mul=functools.partial(op_silu_mul.run_triton, kernels=jit, block_m=4, block_i=8),
        loss_dy=lambda *a, reduction: op_loss_dy.run_triton(*a, reduction, kernels=jit, block_h=16),
        block_backward=lambda *a, input_precision="ieee": op_block_backward.run_triton(
            *a, input_precision, kernels=jit, block_i=8, block_h=16
        ),
        update_tail=update_tail,
        norm_parts=norm_parts,
        INPUT_PRECISIONS=INPUT_PRECISIONS,
        slot_matmul=slot_matmul_op,  # graph_update.slot_matmul's, for the output's shape
    )
    return SimpleNamespace(kernels=kernels, ops=(mm, adam))


def _run_graph_update(layout, hp, moments, device="cpu", interpreted=None):
    slots, _, _ = LAYOUTS[layout]
    theta = _theta0().to(device)
    m, v = (torch.zeros_like(theta, dtype=moments) for _ in range(2))
    state = [theta, m, v, torch.zeros(SLOTS, device=device)]
    gs = torch.tensor(slots, device=device)
    losses = []
    for xp, tp, mask in _steps(layout):
        xp, tp, mask = (t.to(device) for t in (xp, tp, mask))
        ops = interpreted.ops if interpreted is not None else None
        loss, ok = graph_update.train_groups(*state, gs, xp, tp, mask, SHAPE, hp, ops=ops)
        losses.append(torch.where(ok, loss, float("nan")).tolist())
    return {"state": [t.cpu() for t in state], "losses": losses}


def _run_cpu_distiller(layout, hp, moments):
    from algorithms.esamp.cpu import GroupedDistiller

    if moments != torch.float32:
        pytest.skip("the CPU distiller keeps fp32 moments only")
    slots, _, _ = LAYOUTS[layout]
    d = GroupedDistiller(
        SHAPE.hidden_size, intermediate_size=SHAPE.intermediate_size,
        num_blocks=SHAPE.num_blocks, lr=hp.lr, eps=hp.eps, betas=hp.betas,
        grad_clip=hp.grad_clip, loss_reduction=hp.loss_reduction, capacity=SLOTS,
    )  # fmt: skip
    assert [d.alloc() for _ in range(SLOTS)] == list(range(SLOTS))
    d.theta.copy_(_theta0())
    losses = []
    for xp, tp, mask in _steps(layout):
        live = [g for g, s in enumerate(slots) if s >= 0 and mask[g].any()]
        rows = torch.tensor([slots[g] for g in live]).repeat_interleave(mask[live].sum(1))
        res = d.train_step(rows, xp[live][mask[live]], tp[live][mask[live]])
        by_slot = dict(zip(res.slots.tolist(), res.losses.tolist(), strict=True))
        ok = dict(zip(res.slots.tolist(), res.updated.tolist(), strict=True))
        losses.append([by_slot[s] if ok.get(s) else float("nan") for s in slots])
    d.close()
    return {"state": [d.theta, d.m, d.v, d.step], "losses": losses}


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("path", ["cpu_distiller", "graph_update", "triton_interpreted", "cuda"])
def test_every_update_path_equals_autograd_clip_and_torch_adam(
    path, layout, reduction, moments, monkeypatch
):
    hp = _hyper(reduction)
    if path == "cpu_distiller":
        got = _run_cpu_distiller(layout, hp, moments)
    elif path == "graph_update":
        got = _run_graph_update(layout, hp, moments)
    elif path == "triton_interpreted":
        if layout != "4groups" or moments != torch.float32 and reduction != "mean":
            pytest.skip("the interpreter is slow: one layout, bf16 with one reduction")
        interp = _interpreted()
        for module in (graph_update, mlp):
            monkeypatch.setattr(module, "kernels", interp.kernels)
        got = _run_graph_update(layout, hp, moments, interpreted=interp)
    else:
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        got = _run_graph_update(layout, hp, moments, device="cuda")
    want = _reference(layout, hp)
    slots, _, _ = LAYOUTS[layout]
    for step, (g_l, w_l) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        torch.testing.assert_close(
            torch.tensor(g_l), torch.tensor(w_l), rtol=1e-5, atol=0, equal_nan=True,
            msg=lambda s, step=step: f"losses at step {step}: {s}",
        )  # fmt: skip
    theta0 = _theta0()
    bf16 = moments == torch.bfloat16
    names = ("theta", "m", "v", "step")
    for name, g_t, w_t in zip(names, got["state"], want["state"], strict=True):
        for s in range(SLOTS):
            if s not in slots:  # in no group: never read or written
                want_s = theta0[s] if name == "theta" else torch.zeros_like(w_t[s])
                assert torch.equal(g_t[s].float(), want_s), (name, s)
                continue
            # bf16 moments: rounded to 8 bits of mantissa at each store.
            rtol = {"theta": 1e-4, "m": 2e-2 if bf16 else 1e-4, "v": 2e-2 if bf16 else 1e-4}
            scale = w_t[s].abs().max().item()
            atol = {"theta": hp.lr * (1e-2 if bf16 else 1e-3)}
            atol.update(m=scale * (1e-2 if bf16 else 1e-6), v=scale * (1e-2 if bf16 else 1e-6))
            torch.testing.assert_close(
                g_t[s].float(), w_t[s], rtol=rtol.get(name, 0), atol=atol.get(name, 0),
                msg=lambda msg, name=name, s=s: f"{name} of slot {s}: {msg}",
            )  # fmt: skip

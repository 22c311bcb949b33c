"""The update's fused backward kernels (``loss_dy``, ``block_backward``, ``update_tail`` in
``algorithms.esamp.kernels``) against independent fp64 references written here (autograd of
the block, explicit gradients, a loop over groups), at small odd shapes: non-powers of two,
padding groups (slot -1), masked rows, a group without rows and groups with a non-finite
loss or norm. Each is checked as the CPU op (the PyTorch reference) and as the Triton
kernel run by Triton's interpreter (skipped without Triton)."""

from __future__ import annotations

import ast
import functools
import inspect
from types import SimpleNamespace

import pytest
import torch
from esamp_kernel_helpers import interpreted_kernels

from algorithms.esamp import kernels
from algorithms.esamp.kernels import (  # the package imports every op: no Triton needed
    op_block_backward,
    op_grad_adam,
    op_loss_dy,
    op_silu_mul,
    op_slot_matmul,
    op_stale_max,
    op_update_tail,
)

# NaN and inf in the inputs on purpose (the interpreter's numpy warns about them).
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

G, M, H, INTER = 5, 7, 37, 11
GROUP_SLOT = (3, -1, 0, 2, 1)  # group 1: padding
COUNTS = (7, 0, 3, 5, 1)  # group 1 has no rows either; group 2 three of seven


@pytest.fixture(scope="module")
def interpreted() -> SimpleNamespace:
    """The Triton launchers with kernels decorated under ``TRITON_INTERPRET=1``, small tiles
    so that the shapes above span several tiles with ragged edges."""
    jit = interpreted_kernels()
    return SimpleNamespace(
        grad_adam=functools.partial(op_grad_adam.run_triton, kernels=jit, block_n=8, block_k=16),
        slot_matmul=functools.partial(
            op_slot_matmul.run_triton, kernels=jit, block_n=16, block_k=16
        ),
        silu_mul=functools.partial(op_silu_mul.run_triton, kernels=jit, block_m=4, block_i=8),
        stale_max=functools.partial(op_stale_max.run_triton, kernels=jit, block_g=2),
        loss_dy=lambda *a, reduction: op_loss_dy.run_triton(*a, reduction, kernels=jit, block_h=16),
        block_backward=functools.partial(
            op_block_backward.run_triton, kernels=jit, block_m=16, block_i=8, block_h=16
        ),
        update_tail=lambda *a, grad_clip, clip_eps: op_update_tail.run_triton(
            *a, -1.0 if grad_clip is None else grad_clip, clip_eps, kernels=jit, block_g=4
        ),
    )


def _grad_adam_op(a, b, scale, slots, ok, step, w, m, v, lr, b1, b2, eps):
    kernels.grad_adam(a, b, scale, slots, ok, step, w, m, v, lr=lr, betas=(b1, b2), eps=eps)


def _cpu() -> SimpleNamespace:
    return SimpleNamespace(
        grad_adam=_grad_adam_op,
        silu_mul=kernels.silu_mul,
        stale_max=kernels.stale_max,
        slot_matmul=lambda x, w, gs, out, transpose_w, precision="ieee", split_k=0, add=None: (
            kernels.slot_matmul(x, w, gs, out, transpose_w=transpose_w, split_k=split_k, add=add)
        ),
        loss_dy=kernels.loss_dy,
        block_backward=lambda *a: kernels.block_backward(*a),
        update_tail=kernels.update_tail,
    )


@pytest.fixture(params=["triton", "cpu"])
def impl(request) -> SimpleNamespace:
    if request.param == "triton":
        return request.getfixturevalue("interpreted")
    return _cpu()


def _mask(rows: int = M, counts=COUNTS) -> torch.Tensor:
    return torch.arange(rows)[None, :] < torch.tensor(counts)[:, None]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_dy_equals_the_masked_squared_error(impl, reduction):
    gen = torch.Generator().manual_seed(1)
    h, tp = torch.randn(G, M, H, generator=gen), torch.randn(G, M, H, generator=gen)
    mask = _mask()
    tp[2, 5] = float("nan")  # an unmarked row: ignored whatever it holds
    h[4, 0, 3] = float("inf")  # a marked one: that group's loss is not finite
    # Three parts: the interpreter splits H = 37 over three programs (13, 13, 11 columns).
    parts, dy = torch.full((G, 3), 7.0), torch.full((G, M, H), 7.0)
    impl.loss_dy(h, tp, mask, parts, dy, reduction=reduction)
    losses = parts.sum(1)
    for g, n in enumerate(COUNTS):
        diff = (h[g, :n] - tp[g, :n]).double()
        denom = max(n * (H if reduction == "mean" else 1), 1)
        want = diff.square().sum() / denom
        if g == 4:
            assert losses[g].isinf()
            continue
        torch.testing.assert_close(losses[g].double(), want, rtol=1e-6, atol=0)
        torch.testing.assert_close(dy[g, :n].double(), 2 * diff / denom, rtol=1e-6, atol=0)
        assert torch.equal(dy[g, n:], torch.zeros_like(dy[g, n:]))  # unmarked rows: 0


def _block_inputs(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A block's forward on random rows (zero past each group's count) and the gradient
    ``dy`` at its output."""
    counts = [rows, 0, rows // 2, rows - 1, 1]
    live = _mask(rows, counts).float()[..., None]
    h_in = torch.randn(G, rows, H, generator=gen) * live
    gate, up = (
        torch.randn(G, INTER, H, generator=gen) / 6,
        torch.randn(G, INTER, H, generator=gen) / 6,
    )
    a, u = h_in @ gate.transpose(1, 2), h_in @ up.transpose(1, 2)
    s = torch.nn.functional.silu(a)
    p = s * u
    dy = torch.randn(G, rows, H, generator=gen) * live
    dp = torch.randn(G, rows, INTER, generator=gen) * live
    return dp, a, u, s, p, h_in, dy


@pytest.mark.parametrize("rows", [7, 20])  # 20: 2 x 2 row tiles of 16 in the interpreter
def test_block_backward_equals_autograd_and_the_explicit_gradient_norm(impl, rows):
    gen = torch.Generator().manual_seed(rows)
    dp, a, u, s, p, h_in, dy = _block_inputs(rows, gen)
    du, da = torch.full_like(dp, 7.0), torch.full_like(dp, 7.0)
    parts = torch.full((G, kernels.norm_parts(rows) + 5), 7.0)  # extra columns: written too
    impl.block_backward(dp, a, u, s, p, h_in, dy, du, da, parts)
    a64 = a.double().requires_grad_()
    u64 = u.double().requires_grad_()
    (torch.nn.functional.silu(a64) * u64 * dp.double()).sum().backward()
    torch.testing.assert_close(du.double(), u64.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(da.double(), a64.grad, rtol=1e-5, atol=1e-7)
    d64, h64 = dy.double().transpose(1, 2), h_in.double().transpose(1, 2)
    grads = (d64 @ p.double(), u64.grad.transpose(1, 2) @ h64.transpose(1, 2))
    grads += (a64.grad.transpose(1, 2) @ h64.transpose(1, 2),)
    want = sum(gr.square().sum((1, 2)) for gr in grads)
    torch.testing.assert_close(parts.sum(1).double(), want, rtol=1e-5, atol=1e-6)
    assert parts[1].eq(0).all()  # the group without rows has no gradient


def test_block_backward_triton_tiles_equal_the_cpu_op(interpreted):
    """Several row tiles of 16 (rows 37: 3 x 3 pairs), rows past the count zero: the same
    du, da and norm as the CPU op."""
    gen = torch.Generator().manual_seed(5)
    args = _block_inputs(37, gen)
    outs = []
    for run in (interpreted.block_backward, _cpu().block_backward):
        du, da = torch.zeros_like(args[0]), torch.zeros_like(args[0])
        parts = torch.zeros(G, 9)
        run(*args, du, da, parts)
        outs.append((du, da, parts.sum(1)))
    for x, y in zip(*outs, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grad_clip", [0.5, None])
def test_update_tail_counts_and_clips_each_group(impl, grad_clip):
    # Groups: 0 non-finite loss, 1 padding (with rows), 2 and 4 fine, 3 non-finite norm,
    # 5 a slot without rows.
    slots, counts = (3, -1, 0, 2, 1, 5), (7, 2, 3, 5, 1, 0)
    g_n = len(slots)
    gen = torch.Generator().manual_seed(2)
    parts = torch.rand(g_n, 3, generator=gen) * 2
    parts[3, 1] = float("nan")
    loss_parts = torch.rand(g_n, 2, generator=gen)
    loss_parts[0, 1] = float("inf")
    parts[4] = torch.tensor([1e-4, 0.0, 0.0])  # norm 0.01: not clipped
    mask = _mask(M, counts)
    step = torch.tensor([4.0, 1.0, 9.0, 2.0, 6.0, 3.0, 5.0])
    applied = torch.tensor([10, 20, 30, 40, 50, 60, 70])
    ok, scale, norm = torch.ones(g_n, dtype=torch.bool), torch.zeros(g_n), torch.zeros(g_n)
    losses = torch.zeros(g_n)
    step0, applied0 = step.clone(), applied.clone()
    args = (loss_parts, parts, torch.tensor(slots), mask, step)
    out = (losses, ok, scale, norm)
    impl.update_tail(*args, applied, *out, grad_clip=grad_clip, clip_eps=1e-6)
    want_norm = parts.double().sum(1).sqrt()
    torch.testing.assert_close(norm.double(), want_norm, rtol=1e-6, atol=0, equal_nan=True)
    torch.testing.assert_close(losses, loss_parts.sum(1), rtol=1e-6, atol=0)
    assert ok.tolist() == [False, False, True, False, True, False]
    for g, slot in enumerate(slots):
        if slot >= 0:
            assert step[slot] == step0[slot] + ok[g]
            assert applied[slot] == applied0[slot] + (counts[g] > 0)
    assert step[1] == step0[1] + 1 and applied[1] == applied0[1] + 1  # group 4's slot
    assert step[5] == step0[5] and applied[5] == applied0[5]  # group 5: no rows
    assert step[4] == step0[4] and applied[4] == applied0[4]  # slot 4: in no group
    assert step[6] == step0[6] and applied[6] == applied0[6]  # slot 6: in no group
    for g in (2, 4):
        want = 1.0 if grad_clip is None else min(1.0, grad_clip / (want_norm[g].item() + 1e-6))
        torch.testing.assert_close(scale[g].item(), want, rtol=1e-6, atol=0)
    assert grad_clip is None or scale[2] < 1 == scale[4]  # one clipped, one not
    # Without the applied counts.
    impl.update_tail(*args, None, *out, grad_clip=grad_clip, clip_eps=1e-6)
    assert step[1] == step0[1] + 2 and applied[1] == applied0[1] + 1


def test_bad_input_names_the_argument():
    h = torch.zeros(2, 3, 4)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"mask must be \[2, 3\] bool, got \[2, 3\] float32"):
        kernels.loss_dy(h, h, mask.float(), torch.zeros(2, 1), h.clone())
    with pytest.raises(ValueError, match="loss reduction must be 'mean' or 'sum', got 'max'"):
        kernels.loss_dy(h, h, mask, torch.zeros(2, 1), h.clone(), reduction="max")
    with pytest.raises(ValueError, match=r"parts must be \[2, L >= 1\] fp32"):
        kernels.loss_dy(h, h, mask, torch.zeros(2), h.clone())
    x = torch.zeros(2, 70, 5)
    hh = torch.zeros(2, 70, 4)
    with pytest.raises(ValueError, match=r"parts must have >= 9 columns for 70 rows"):
        kernels.block_backward(x, x, x, x, x, hh, hh, x.clone(), x.clone(), torch.zeros(2, 1))
    with pytest.raises(ValueError, match=r"dy must be \[2, 70, 4\] fp32"):
        kernels.block_backward(x, x, x, x, x, hh, x, x.clone(), x.clone(), torch.zeros(2, 9))
    vec = torch.zeros(2)
    col, slots = torch.zeros(2, 1), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"ok must be \[2\] bool"):
        kernels.update_tail(
            col, col, slots, mask, torch.zeros(3), None, vec, vec, vec, vec,
            grad_clip=1.0, clip_eps=0.0,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"applied must be \[3\] int64"):
        kernels.update_tail(
            col, col, slots, mask, torch.zeros(3), torch.zeros(3), vec, vec.bool(), vec, vec,
            grad_clip=1.0, clip_eps=0.0,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"loss_parts must be \[2, K\] fp32"):
        kernels.update_tail(
            vec, col, slots, mask, torch.zeros(3), None, vec, vec.bool(), vec, vec,
            grad_clip=1.0, clip_eps=0.0,
        )  # fmt: skip


def test_every_launch_refuses_an_unknown_precision():
    """Launches are built directly too (the sm_90 compile checks, the interpreter tests): each
    launcher that takes a precision refuses an unknown one (one check, in Launch)."""
    g, rows, i, h = 2, 4, 3, 5
    dp, hid, w = torch.zeros(g, rows, i), torch.zeros(g, rows, h), torch.zeros(2, i, h)
    slots, vec, parts = torch.zeros(g, dtype=torch.long), torch.zeros(g), torch.zeros(g, 1)
    builds = {
        "block_backward": lambda p: op_block_backward.block_backward_launch(
            dp, dp, dp, dp, dp, hid, hid, dp, dp, parts, p
        ),
        "slot_matmul": lambda p: op_slot_matmul.slot_matmul_launch(
            hid, w, slots, dp.clone(), True, p, 1
        ),
        "grad_adam": lambda p: op_grad_adam.grad_adam_launch(
            dp, hid, vec, slots, vec.bool(), torch.ones(2), w, w, w, 1e-3, 0.9, 0.999, 1e-8, p
        ),
    }
    for name, build in builds.items():
        assert build("tf32").constexprs["INPUT_PRECISION"] == "tf32", name
        with pytest.raises(ValueError, match="'fp16' is not one of ieee, tf32, tf32x3"):
            build("fp16")


def test_the_checks_build_no_message_for_good_arguments():
    """The op checks run on every eager call: an error message (an f-string) is formatted only
    where a check fails, inside the ``if`` that raises (``_expect`` takes a format and args)."""
    from algorithms.esamp.kernels import checks, ops

    for module in (checks, *ops.OP_MODULES):
        for fn in ast.walk(ast.parse(inspect.getsource(module))):
            if not isinstance(fn, ast.FunctionDef) or fn.name == "_shape":  # failures' only
                continue
            if module is not checks and not fn.name.startswith("check_"):
                continue
            raising = [n for n in ast.walk(fn) if isinstance(n, ast.If)]
            raising = [n for n in raising if any(isinstance(s, ast.Raise) for s in n.body)]
            lazy = {id(x) for n in raising for s in n.body for x in ast.walk(s)}
            eager = [n for n in ast.walk(fn) if isinstance(n, ast.JoinedStr) and id(n) not in lazy]
            assert not eager, f"{module.__name__}.{fn.name}: {ast.unparse(eager[0])}"


def test_meta_tensors_run_the_fake_impls_and_state_their_bytes():
    meta = functools.partial(torch.zeros, device="meta")
    h, mask = meta(2, 3, 8), torch.zeros(2, 3, dtype=torch.bool, device="meta")
    kernels.loss_dy(h, h, mask, meta(2, 1), h)
    x = meta(2, 3, 5)
    kernels.block_backward(x, x, x, x, x, h, h, x, x, meta(2, 1))
    ok = torch.zeros(2, dtype=torch.bool, device="meta")
    slots = torch.zeros(2, dtype=torch.long, device="meta")
    kernels.update_tail(
        meta(2, 1), meta(2, 1), slots, mask, meta(4), None, meta(2), ok, meta(2), meta(2),
        grad_clip=None, clip_eps=1e-6,
    )  # fmt: skip
    assert kernels.loss_dy_bytes(2, 3, 8) == 3 * 2 * 3 * 8 * 4 + 2 * (3 + 4)
    stated = torch.ops.tllm_esamp.block_backward.default.tllm_bytes
    assert stated(x, x, x, x, x, h, h, x, x, meta(2, 1)) == kernels.block_backward_bytes(
        2, 3, 5, 8, 1
    )


@pytest.mark.parametrize("rows", [16, 128])  # one 16-row tile; 4 x 4 tiles of 32
def test_kernels_compile_for_sm90_without_spills(rows):
    """The interpreter runs any tile shape; the GPU compiler may spill: compile each kernel's
    default launch at these rows for sm_90 and check that nothing spills to the stack, and
    that the "ieee" Gram products are plain fp32 FMAs."""
    pytest.importorskip("triton", reason="Triton is not installed here")
    from test_esamp_kernels import _compile_sm90

    g, h, i = 3, 256, 96
    dp, hid = torch.zeros(g, rows, i), torch.zeros(g, rows, h)
    mask, parts = torch.ones(g, rows, dtype=torch.bool), torch.zeros(g, kernels.norm_parts(rows))
    vec, slots = torch.zeros(g), torch.zeros(g, dtype=torch.long)
    launches = (
        op_block_backward.block_backward_launch(dp, dp, dp, dp, dp, hid, hid, dp.clone(), dp.clone(), parts),
        op_loss_dy.loss_dy_launch(hid, hid, mask, torch.zeros(g, 2), hid.clone(), "mean"),
        op_silu_mul.silu_mul_launch(dp, dp, dp.clone(), dp.clone()),
        op_stale_max.stale_max_launch(slots, torch.zeros(5, dtype=torch.long), slots, slots[:1].clone()),
        op_update_tail.update_tail_launch(
            parts, parts, slots, mask, torch.zeros(5), torch.zeros(5, dtype=torch.long),
            vec, vec.bool(), vec, vec, 0.5, 1e-6,
        ),
    )  # fmt: skip
    # Gate and up at once: their product from one x, the gradient carried back through both
    # (summed, with the addend, split-K 2), and their Adam step (bf16 moments).
    pair = torch.zeros(2, 2 * i * h)[:, : 2 * i * h].view(2, 2, i, h)
    dz = torch.zeros(g, 2, rows, i)
    launches += (
        op_slot_matmul.slot_matmul_launch(hid, pair, slots, torch.zeros(g, 2, rows, i), True, "ieee", 1),
        op_slot_matmul.slot_matmul_launch(dz, pair, slots, hid.clone(), False, "ieee", 2, hid),
        op_grad_adam.grad_adam_launch(
            dz, hid, vec, slots, vec.bool(), torch.ones(2), pair, pair.bfloat16(),
            pair.bfloat16(), 1e-3, 0.9, 0.999, 1e-8,
        ),
    )  # fmt: skip
    for launch in launches:
        ptx, usage = _compile_sm90(launch)
        assert "STACK:0" in usage or usage == "", f"{launch.kernel} spills: {usage}"
        if launch.kernel == "block_backward":
            assert "mma" not in ptx and "fma.rn.f32" in ptx


def _pair_state(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat state ``[S, P]`` with two ``[n, k]`` matrices per slot ``n * k + 3`` apart
    (like gate and up of a block), and their ``[S, 2, n, k]`` strided view."""
    slots, gap = 4, 3
    theta = torch.randn(slots, 2 + 2 * n * k + gap, generator=gen)
    view = theta[:, 2:].as_strided((slots, 2, n, k), (theta.stride(0), n * k + gap, k, 1))
    return theta, view


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("transpose_w", [True, False], ids=["x_wT", "x_w"])
def test_slot_matmul_over_two_matrices_of_a_slot(impl, transpose_w, split_k):
    """``w [S, 2, ., .]``: one product per matrix from a shared ``x`` (the forward's gate and
    up), and the sum of both products from per-matrix ``x`` plus an addend (the gradient
    carried back through gate and up), padding groups giving 0 (+ the addend)."""
    gen = torch.Generator().manual_seed(split_k + 2 * transpose_w)
    n, k, rows = 13, 21, 5
    theta, w = _pair_state(n, k, gen)
    before = theta.clone()
    slots = torch.tensor(GROUP_SLOT)  # group 1: padding
    kx = k if transpose_w else n
    nx = n if transpose_w else k
    x = torch.randn(G, rows, kx, generator=gen)
    xe = torch.randn(G, 2, rows, kx, generator=gen)
    add = torch.randn(G, rows, nx, generator=gen)

    def prod(xg, g, e):
        s = GROUP_SLOT[g]
        if s < 0:
            return torch.zeros(rows, nx)
        we = w[s, e].double()
        return (xg.double() @ (we.T if transpose_w else we)).float()

    want = torch.stack([torch.stack([prod(x[g], g, e) for e in range(2)]) for g in range(G)])
    out = torch.full((G, 2, rows, nx), float("nan"))
    impl.slot_matmul(x, w, slots, out, transpose_w, split_k=split_k)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    summed = torch.stack([add[g] + prod(xe[g, 0], g, 0) + prod(xe[g, 1], g, 1) for g in range(G)])
    out3 = torch.full((G, rows, nx), float("nan"))
    impl.slot_matmul(xe, w, slots, out3, transpose_w, split_k=split_k, add=add)
    torch.testing.assert_close(out3, summed, rtol=1e-5, atol=1e-5)
    assert torch.equal(out3[1], add[1]) and torch.equal(theta, before)


def test_slot_matmul_pair_bad_input_names_the_argument():
    w = torch.zeros(3, 2, 5, 8)
    slots = torch.tensor([0, -1])
    with pytest.raises(ValueError, match=r"x must be \[G, M, K\] or \[G, 2, M, K\] fp32"):
        kernels.slot_matmul(torch.zeros(2, 3, 4, 8), w, slots, torch.zeros(2, 4, 5))
    with pytest.raises(ValueError, match=r"out must be \[2, 4, 5\] or \[2, 2, 4, 5\] fp32"):
        kernels.slot_matmul(torch.zeros(2, 4, 8), w, slots, torch.zeros(2, 3, 4, 5))
    out3 = torch.zeros(2, 4, 5)
    with pytest.raises(ValueError, match="add must not be out"):
        kernels.slot_matmul(torch.zeros(2, 2, 4, 8), w, slots, out3, add=out3)
    with pytest.raises(ValueError, match=r"add needs out \[2, 4, 5\]"):
        out = torch.zeros(2, 2, 4, 5)
        kernels.slot_matmul(torch.zeros(2, 4, 8), w, slots, out, add=torch.zeros(2, 4, 5))


@pytest.mark.parametrize("shared_b", [True, False], ids=["shared_b", "own_b"])
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grad_adam_over_two_matrices_equals_one_call_each(impl, moments, shared_b):
    """``w [S, 2, N, K]`` (gate and up of a block, a strided view of the flat state): the
    same as one single-matrix call per matrix (the CPU op, checked against
    ``torch._fused_adam_`` in test_esamp_kernels.py), skipped groups' slots bit for bit."""
    gen = torch.Generator().manual_seed(int(shared_b) + 2 * (moments == torch.float32))
    n, k, rows = 11, 19, 6
    theta, _ = _pair_state(n, k, gen)
    mom = [(torch.randn_like(theta) * s).abs().to(moments) for s in (0.1, 0.01)]
    state = [theta, *mom]
    twin = [t.clone() for t in state]
    before = [t.clone() for t in state]

    def pair(t):
        return t[:, 2:].as_strided((t.shape[0], 2, n, k), (t.stride(0), n * k + 3, k, 1))

    slots = torch.tensor(GROUP_SLOT)
    ok = torch.tensor([True, True, True, False, True])  # group 3 (slot 2) skipped
    step = torch.tensor([3.0, 1.0, 5.0, 2.0])
    a = torch.randn(G, 2, rows, n, generator=gen)
    b = torch.randn(G, rows, k, generator=gen) if shared_b else torch.randn(G, 2, rows, k)
    scale = torch.rand(G, generator=gen) + 0.1
    hyper = (1e-3, 0.9, 0.999, 1e-8)
    impl.grad_adam(a, b, scale, slots, ok, step, *(pair(t) for t in state), *hyper)
    for e in range(2):
        b_e = b if shared_b else b[:, e]
        views = [pair(t)[:, e] for t in twin]
        _grad_adam_op(a[:, e], b_e, scale, slots, ok, step, *views, *hyper)
    # bf16 moments: the interpreter and torch may round an element to neighbouring bf16
    # values (as in test_esamp_kernels.py).
    loose = dict(rtol=8e-3, atol=1e-5) if moments == torch.bfloat16 else {}
    for i, (x, y, old) in enumerate(zip(state, twin, before, strict=True)):
        torch.testing.assert_close(x, y, **(dict(rtol=1e-5, atol=1e-6) if i == 0 else loose))
        assert torch.equal(x[2], old[2])  # the skipped group's slot
        gap = slice(2 + n * k, 2 + n * k + 3)  # between the two matrices
        assert torch.equal(x[:, :2], old[:, :2]) and torch.equal(x[:, gap], old[:, gap])
        assert not torch.equal(x[3], old[3])  # a live one moved


def test_silu_mul_equals_silu_times_u(impl):
    """On strided views (a and u one [G, 2, M, I] buffer, as the forward writes them; s and
    p rows padded), rows and columns not multiples of the tiles."""
    gen = torch.Generator().manual_seed(4)
    au = torch.randn(G, 2, M, INTER, generator=gen) * 4
    a, u = au[:, 0], au[:, 1]
    a[0, 0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp overflow / underflow, 0
    sp = torch.full((2, G, M, INTER + 3), 7.0)
    s, p = sp[0, :, :, :INTER], sp[1, :, :, :INTER]
    impl.silu_mul(a, u, s, p)
    want = torch.nn.functional.silu(a.double())
    torch.testing.assert_close(s.double(), want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(p.double(), want * u.double(), rtol=1e-6, atol=1e-6)
    assert sp[..., INTER:].eq(7).all()  # the padding columns untouched
    with pytest.raises(ValueError, match=r"p must be \[5, 7, 11\] fp32"):
        kernels.silu_mul(a, u, s, p[:, :3])


def test_grad_adam_b_cycles_over_fewer_matrices(impl):
    """Gate and up of two blocks in one call: ``w [S, 4, N, K]`` (gate 0, gate 1, up 0, up
    1), ``b [G, 2, M, K]`` (each block's input): matrix ``e`` uses ``b[:, e % 2]``."""
    gen = torch.Generator().manual_seed(9)
    n, k, rows, mats = 6, 10, 5, 4
    state = [torch.randn(4, 1 + mats * n * k, generator=gen).abs() for _ in range(3)]
    twin = [t.clone() for t in state]

    def quad(t):
        return t[:, 1:].view(4, mats, n, k)

    slots, ok = torch.tensor(GROUP_SLOT), torch.tensor([True, True, False, True, True])
    step = torch.tensor([3.0, 1.0, 5.0, 2.0])
    a = torch.randn(G, mats, rows, n, generator=gen)
    b = torch.randn(G, 2, rows, k, generator=gen)
    scale = torch.rand(G, generator=gen) + 0.1
    hyper = (1e-3, 0.9, 0.999, 1e-8)
    impl.grad_adam(a, b, scale, slots, ok, step, *(quad(t) for t in state), *hyper)
    for e in range(mats):
        views = [quad(t)[:, e] for t in twin]
        _grad_adam_op(a[:, e], b[:, e % 2], scale, slots, ok, step, *views, *hyper)
    for x, y in zip(state, twin, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"or \[5, E_b, 5, K\] with 4 % E_b == 0"):
        _grad_adam_op(a, b[:, :1].expand(G, 3, rows, k), scale, slots, ok, step,
                      *(quad(t) for t in state), *hyper)  # fmt: skip


def test_stale_max_takes_the_largest_lag_of_the_groups_with_a_slot(impl):
    """Five groups over blocks of two (the interpreter): the padding group's large count is
    ignored, the maximum only ever grows."""
    slots = torch.tensor(GROUP_SLOT)  # group 1: padding
    applied = torch.tensor([5, 7, 2, 9])
    submitted = torch.tensor([9, 99, 6, 4, 8])  # lags 0, -, 1, 2, 1 (slots 3, 0, 2, 1)
    stale = torch.tensor([1])
    impl.stale_max(submitted, applied, slots, stale)
    assert stale.tolist() == [2]
    impl.stale_max(submitted - 2, applied, slots, stale)  # lags all <= 0: kept
    assert stale.tolist() == [2]
    with pytest.raises(ValueError, match=r"stale must be \[1\] int64"):
        kernels.stale_max(submitted, applied, slots, stale.float())

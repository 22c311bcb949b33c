"""ESamp's fused kernels (``algorithms.esamp.kernels``) against independent PyTorch references:
``torch._fused_adam_`` / ``torch.optim.Adam`` on the explicitly formed gradient, ``torch.bmm``,
and the fp64 gather-and-multiply (``candidate_dot``). Each op is checked twice: the Triton
kernel (compiled, on a CUDA device where one is; else on CPU by Triton's interpreter, decorated
afresh with ``TRITON_INTERPRET=1`` set; skipped without Triton), and the op's CPU
implementation (the PyTorch reference, reached through ``torch.ops``)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from esamp_kernel_helpers import triton_under_test
from torch.utils._python_dispatch import TorchDispatchMode

from algorithms.esamp.kernels import (
    candidate_dot,
    candidate_dot_bytes,
    grad_adam,
    grad_adam_bytes,
    slot_matmul,
    slot_matmul_bytes,
)

ROOT = Path(__file__).resolve().parent.parent
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
# One flat state row holds three matrices ([N, K] each, like gate, up, down), a gap before
# and after: the kernels must write only their own matrix's elements.
MATS = ((12, 40), (12, 40), (40, 12))
GAP = 3
SLOTS = 5
# Groups: two padding groups (slot -1), slot 2's group skipped (ok 0), slot 4 in no group.
GROUP_SLOT = (3, 0, -1, 2, 1, -1)
GROUP_OK = (1, 1, 1, 0, 1, 1)
STEP = (4.0, 1.0, 9.0, 2.0, 6.0)  # per slot, already counting this step
UNTOUCHED = (2, 4)


@pytest.fixture(scope="module")
def triton_ops() -> SimpleNamespace:
    """The Triton launchers: compiled, on CUDA copies of the tensors, where a GPU is; else
    interpreted on CPU (``esamp_kernel_helpers.triton_under_test``)."""
    kernels, wrap = triton_under_test()
    from algorithms.esamp.kernels import op_candidate_dot, op_grad_adam, op_slot_matmul

    # Small tiles, so the test shapes span several tiles with ragged edges.
    return SimpleNamespace(
        grad_adam=wrap(
            functools.partial(op_grad_adam.run_triton, kernels=kernels, block_n=16, block_k=32)
        ),
        slot_matmul=wrap(
            functools.partial(op_slot_matmul.run_triton, kernels=kernels, block_n=16, block_k=16)
        ),
        candidate_dot=wrap(
            functools.partial(op_candidate_dot.run_triton, kernels=kernels, block_p=4, block_h=16)
        ),
    )


def _grad_adam_cpu_op(*args, input_precision="ieee"):
    a, b, scale, slot, ok, step, w, m, v, lr, b1, b2, eps = args
    grad_adam(
        a, b, scale, slot, ok, step, w, m, v,
        lr=lr, betas=(b1, b2), eps=eps, input_precision=input_precision,
    )  # fmt: skip


def _impl(name: str, triton_fixture) -> SimpleNamespace:
    if name == "triton":
        return triton_fixture()
    return SimpleNamespace(
        grad_adam=_grad_adam_cpu_op,
        slot_matmul=lambda x, w, s, out, transpose_w, input_precision="ieee", split_k=0: (
            slot_matmul(
                x, w, s, out,
                transpose_w=transpose_w, input_precision=input_precision, split_k=split_k,
            )
        ),
        candidate_dot=candidate_dot,
    )  # fmt: skip


@pytest.fixture(params=["triton", "cpu"])
def impl(request) -> SimpleNamespace:
    return _impl(request.param, lambda: request.getfixturevalue("triton_ops"))


def _offsets() -> list[int]:
    offs, o = [], GAP
    for n, k in MATS:
        offs.append(o)
        o += n * k
    return offs


def _row_len() -> int:
    return 2 * GAP + sum(n * k for n, k in MATS)


def _view(state: torch.Tensor, i: int) -> torch.Tensor:
    """Matrix ``i`` of every slot: ``[S, N, K]``, slot stride P, row stride K."""
    n, k = MATS[i]
    off = _offsets()[i]
    return state[:, off : off + n * k].view(state.shape[0], n, k)


def _state(moments: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    p = _row_len()
    theta = torch.randn(SLOTS, p, generator=gen)
    m = (0.1 * torch.randn(SLOTS, p, generator=gen)).to(moments)
    v = (0.01 * torch.rand(SLOTS, p, generator=gen)).to(moments)
    return theta, m, v


def _factors(rows: int, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``a [G, rows, n]``, ``b [G, rows, k]`` with zero rows past each group's count."""
    g = len(GROUP_SLOT)
    counts = torch.randint(1, rows + 1, (g,), generator=gen)
    live = (torch.arange(rows)[None, :] < counts[:, None]).float()[..., None]
    a = torch.randn(g, rows, n, generator=gen) * live
    b = torch.randn(g, rows, k, generator=gen) * live
    scale = torch.rand(g, generator=gen) + 0.1
    return a, b, scale


def _reference_adam(a, b, scale, w, m, v) -> None:
    """The CPU op (PyTorch's fused Adam on each live group's formed gradient: what
    test_esamp_ops_reference.py checks against torch.optim.Adam)."""
    _run_adam(_grad_adam_cpu_op, a, b, scale, w, m, v)


def _run_adam(run, a, b, scale, w, m, v, precision="ieee") -> None:
    slot = torch.tensor(GROUP_SLOT)
    ok = torch.tensor(GROUP_OK, dtype=torch.bool)
    step = torch.tensor(STEP)
    b1, b2 = HP["betas"]
    run(
        a, b, scale, slot, ok, step, w, m, v, HP["lr"], b1, b2, HP["eps"], input_precision=precision
    )


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [4, 16, 24])
def test_grad_adam_matches_fused_adam_on_the_formed_gradient(impl, rows, moments):
    gen = torch.Generator().manual_seed(rows)
    theta, m, v = _state(moments, gen)
    before = [t.clone() for t in (theta, m, v)]
    ref = [t.clone() for t in (theta, m, v)]
    for i, (n, k) in enumerate(MATS):  # one call per matrix of the row, as the update does
        a, b, scale = _factors(rows, n, k, gen)
        _run_adam(impl.grad_adam, a, b, scale, *(_view(t, i) for t in (theta, m, v)))
        _reference_adam(a, b, scale, *(_view(t, i) for t in ref))
    tol = {} if moments == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(theta, ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m, ref[1], **tol)
    torch.testing.assert_close(v, ref[2], **tol)
    for now, old in zip((theta, m, v), before, strict=True):
        for s in UNTOUCHED:  # skipped group's slot, slot in no group: bit for bit
            assert torch.equal(now[s], old[s]), f"slot {s} changed"
        gaps = torch.cat([now[:, :GAP], now[:, -GAP:]], 1)
        assert torch.equal(gaps, torch.cat([old[:, :GAP], old[:, -GAP:]], 1))
        assert not torch.equal(now[0], old[0])  # a live slot did move


def test_grad_adam_steps_like_torch_optim_adam(impl):
    """Three consecutive steps of one slot equal ``torch.optim.Adam`` given the same
    gradients (its step counting and bias correction included)."""
    gen = torch.Generator().manual_seed(7)
    n, k, rows = 12, 40, 16
    w = torch.randn(1, n, k, generator=gen)
    m, v, step = torch.zeros_like(w), torch.zeros_like(w), torch.zeros(1)
    p = torch.nn.Parameter(w[0].clone())
    opt = torch.optim.Adam([p], lr=HP["lr"], betas=HP["betas"], eps=HP["eps"])
    one, yes = torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool)
    for _ in range(3):
        a, b = torch.randn(1, rows, n, generator=gen), torch.randn(1, rows, k, generator=gen)
        scale = torch.rand(1, generator=gen)
        step += 1
        b1, b2 = HP["betas"]
        impl.grad_adam(a, b, scale, one, yes, step, w, m, v, HP["lr"], b1, b2, HP["eps"])
        p.grad = scale[0] * a[0].T @ b[0]
        opt.step()
    torch.testing.assert_close(w[0], p.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m[0], opt.state[p]["exp_avg"])
    torch.testing.assert_close(v[0], opt.state[p]["exp_avg_sq"])


def test_grad_adam_tf32_switch_and_bad_precision(triton_ops):
    gen = torch.Generator().manual_seed(3)
    theta, m, v = _state(torch.float32, gen)
    ref = [t.clone() for t in (theta, m, v)]
    a, b, scale = _factors(16, *MATS[0], gen)
    # The interpreter computes every dot in fp32 (this checks that "tf32" is accepted); a
    # GPU rounds the gradient's products to tf32: within the tolerance below.
    _run_adam(triton_ops.grad_adam, a, b, scale, *(_view(t, 0) for t in (theta, m, v)), "tf32")
    _reference_adam(a, b, scale, *(_view(t, 0) for t in ref))
    torch.testing.assert_close(theta, ref[0], rtol=1e-3, atol=1e-4)
    with pytest.raises(ValueError, match="'fp16' is not one of ieee, tf32, tf32x3"):
        _run_adam(triton_ops.grad_adam, a, b, scale, *(_view(t, 0) for t in ref), "fp16")


def test_grad_adam_bad_input_names_the_argument():
    gen = torch.Generator().manual_seed(0)
    theta, m, v = _state(torch.float32, gen)
    a, b, scale = _factors(4, *MATS[0], gen)
    w, mm, vv = (_view(t, 0) for t in (theta, m, v))
    with pytest.raises(ValueError, match=r"w must be \[S, N, K\] fp32, got \[5, 12, 40\] bfloat16"):
        _run_adam(_grad_adam_cpu_op, a, b, scale, w.bfloat16(), mm, vv)
    with pytest.raises(ValueError, match=r"m must be \[5, 12, 40\] fp32 or bf16"):
        _run_adam(_grad_adam_cpu_op, a, b, scale, w, mm.half(), vv)
    with pytest.raises(ValueError, match=r"w must be \[S, 12, 40\]"):
        _run_adam(_grad_adam_cpu_op, a, b, scale, _view(theta, 2), mm, vv)
    with pytest.raises(ValueError, match=r"step must be \[5\] fp32"):
        grad_adam(
            a, b, scale, torch.tensor(GROUP_SLOT), torch.tensor(GROUP_OK), torch.ones(4),
            w, mm, vv, **HP,
        )  # fmt: skip
    with pytest.raises(ValueError, match="beta2 must be in"):
        grad_adam(
            a, b, scale, torch.tensor(GROUP_SLOT), torch.tensor(GROUP_OK), torch.tensor(STEP),
            w, mm, vv, lr=1e-3, betas=(0.9, 1.0), eps=1e-8,
        )  # fmt: skip


def _reference_matmul(x, w, slots, transpose_w) -> torch.Tensor:
    out = torch.zeros(x.shape[0], x.shape[1], w.shape[1] if transpose_w else w.shape[2])
    for g, s in enumerate(slots):
        if s >= 0:
            ws = w[s].T if transpose_w else w[s]
            out[g] = torch.bmm(x[g : g + 1], ws[None])[0]
    return out


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("rows", [4, 16, 24])
@pytest.mark.parametrize("transpose_w", [True, False], ids=["x_wT", "x_w"])
def test_slot_matmul_matches_bmm(impl, transpose_w, rows, split_k):
    gen = torch.Generator().manual_seed(rows + split_k)
    theta = torch.randn(SLOTS, _row_len(), generator=gen)
    before = theta.clone()
    w = _view(theta, 2)  # [S, 40, 12]: N=40, K=12 (transposed) or K=40, N=12
    k = w.shape[2] if transpose_w else w.shape[1]
    x = torch.randn(len(GROUP_SLOT), rows, k, generator=gen)
    ref = _reference_matmul(x, w, GROUP_SLOT, transpose_w)
    out = torch.full_like(ref, float("nan"))  # padding groups must be written (zeros)
    ptr = out.data_ptr()
    impl.slot_matmul(x, w, torch.tensor(GROUP_SLOT), out, transpose_w, split_k=split_k)
    torch.testing.assert_close(out, ref)
    assert out.data_ptr() == ptr and torch.equal(theta, before)


def test_slot_matmul_bad_input_names_the_argument():
    x, w = torch.zeros(2, 4, 8), torch.zeros(3, 5, 8)
    slots, out = torch.tensor([0, -1]), torch.zeros(2, 4, 5)
    with pytest.raises(ValueError, match=r"w must be \[S, K, N\] with K=8"):
        slot_matmul(x, w, slots, out, transpose_w=False)
    with pytest.raises(ValueError, match=r"out must be \[2, 4, 5\] fp32, got \[2, 4, 6\]"):
        slot_matmul(x, w, slots, torch.zeros(2, 4, 6))
    with pytest.raises(ValueError, match="group_slot must be int32 or int64"):
        slot_matmul(x, w, slots.float(), out)
    with pytest.raises(ValueError, match="split_k must be >= 0"):
        slot_matmul(x, w, slots, out, split_k=-1)
    from algorithms.esamp.kernels.op_slot_matmul import slot_matmul_launch

    with pytest.raises(ValueError, match="split_k must be >= 0"):  # launched directly
        slot_matmul_launch(x, w, slots, out, transpose_w=True, split_k=-1)


def test_meta_tensors_run_the_fake_impls():
    meta = functools.partial(torch.zeros, device="meta")
    i64 = dict(dtype=torch.long, device="meta")
    w = meta(4, 10 * 24)[:, :240].view(4, 10, 24)
    grad_adam(
        meta(2, 16, 10), meta(2, 16, 24), meta(2), torch.zeros(2, **i64),
        torch.zeros(2, dtype=torch.bool, device="meta"), meta(4), w, w, w, **HP,
    )  # fmt: skip
    out = slot_matmul(meta(2, 16, 24), w, torch.zeros(2, **i64), meta(2, 16, 10))
    assert out.device.type == "meta"
    head = torch.zeros(100, 24, dtype=torch.bfloat16, device="meta")
    dots = candidate_dot(head, meta(4, 24), torch.zeros(6, **i64), torch.zeros(6, **i64), meta(6))
    assert dots.device.type == "meta"


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_dispatch_mode_sees_each_call_as_one_op():
    gen = torch.Generator().manual_seed(1)
    theta, m, v = _state(torch.float32, gen)
    a, b, scale = _factors(4, *MATS[0], gen)
    views = [_view(t, 0) for t in (theta, m, v)]
    out = torch.zeros(len(GROUP_SLOT), 4, MATS[0][0])
    slots, ok, step = torch.tensor(GROUP_SLOT), torch.tensor(GROUP_OK), torch.tensor(STEP)
    head, f, pairs = theta[:, : MATS[0][1]], b[0], slots.clamp(min=0)
    dots = torch.zeros(len(GROUP_SLOT))
    with _Ops() as ops:
        grad_adam(a, b, scale, slots, ok, step, *views, **HP)
        slot_matmul(b, views[0], slots, out)
        candidate_dot(head, f, pairs, pairs, dots)
    assert ops.names == [
        "tllm_esamp.grad_adam.default",
        "tllm_esamp.slot_matmul.default",
        "tllm_esamp.candidate_dot.default",
    ]


def test_triton_kernels_equal_the_cpu_ops_on_random_layouts(triton_ops):
    """Property: for random shapes, slot assignments and skips, the Triton kernels equal
    the CPU ops (themselves checked against torch above)."""
    hyp = pytest.importorskip("hypothesis")
    st = hyp.strategies

    @hyp.settings(max_examples=12, deadline=None, derandomize=True)
    @hyp.given(
        rows=st.integers(1, 20), n=st.integers(1, 24), k=st.integers(1, 40),
        slots=st.integers(1, 4), data=st.data(),
    )  # fmt: skip
    def check(rows, n, k, slots, data):
        gen = torch.Generator().manual_seed(rows * 1000 + n * 10 + k)
        perm = data.draw(st.permutations(list(range(slots)) + [-1, -1]))
        groups = data.draw(st.integers(1, len(perm)))
        gs = torch.tensor(perm[:groups])
        ok = torch.tensor(data.draw(st.lists(st.booleans(), min_size=groups, max_size=groups)))
        a, b = (
            torch.randn(groups, rows, n, generator=gen),
            torch.randn(groups, rows, k, generator=gen),
        )
        scale, step = torch.rand(groups, generator=gen), torch.randint(1, 9, (slots,)).float()
        # w, m, v rows of different lengths and offsets: each tensor's own strides matter.
        state = [torch.randn(slots, n * k + 1 + 2 * i, generator=gen).abs() for i in range(3)]
        twin = [t.clone() for t in state]
        for run, st8 in ((triton_ops.grad_adam, state), (_grad_adam_cpu_op, twin)):
            views = [t[:, 1 + i : 1 + i + n * k].view(slots, n, k) for i, t in enumerate(st8)]
            run(a, b, scale, gs, ok, step, *views, 1e-3, 0.9, 0.999, 1e-8)
        for x, y in zip(state, twin, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        out, out_ref = torch.zeros(groups, rows, k), torch.zeros(groups, rows, k)
        w = state[0][:, 1:].view(slots, n, k)
        triton_ops.slot_matmul(a, w, gs, out, transpose_w=False)
        slot_matmul(a, w, gs, out_ref, transpose_w=False)
        torch.testing.assert_close(out, out_ref)

    check()


_TRITON_TYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.uint8: "u8",
}


def _compile_sm90(launch):
    """Compile a launch for an H100/H200 (sm_90) without one, specialised as Triton's JIT
    would (ints equal to 1 as constants, multiples of 16 and 16-byte aligned pointers
    marked divisible); returns its PTX and cuobjdump's resource usage ('' without it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from algorithms.esamp.kernels import triton_impl

    fn = JITFunction(getattr(triton_impl, f"_{launch.kernel}_kernel"))
    sig, consts, attrs = {}, dict(launch.constexprs), {}
    for i, (name, arg) in enumerate(zip(fn.arg_names, launch.args, strict=False)):
        if isinstance(arg, torch.Tensor):
            sig[name] = "*" + _TRITON_TYPES[arg.dtype]
            aligned = arg.data_ptr() % 16 == 0
        elif isinstance(arg, float):
            sig[name], aligned = "fp32", False
        elif arg == 1:
            consts[name] = 1
            continue
        else:
            sig[name], aligned = "i32", arg % 16 == 0
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    sig.update({name: "constexpr" for name in consts})
    src = ASTSource(fn, sig, consts, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=launch.options)
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    if not cuobjdump.exists():
        return compiled.asm["ptx"], ""
    cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"tllm_{launch.kernel}_{os.getpid()}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    try:
        proc = subprocess.run(
            [cuobjdump, "--dump-resource-usage", cubin], capture_output=True, text=True
        )
    finally:
        cubin.unlink()
    return compiled.asm["ptx"], proc.stdout


def test_kernels_compile_for_sm90_without_spills():
    """The interpreter runs any tile shape and ignores the dot's precision; the GPU compiler
    does neither: compile the default launches at the 7B layout's strides (rows 4: the padded
    dot) for sm_90 and check that no register spills to the stack, that "ieee" is plain fp32
    FMAs and "tf32" tensor-core MMAs, and that bf16 moments are stored rounded to nearest."""
    pytest.importorskip("triton", reason="Triton is not installed here")
    from algorithms.esamp.kernels import op_grad_adam, op_slot_matmul

    n, k, rows = 64, 256, 4
    state = [torch.zeros(2, 3 * n * k) for _ in range(3)]
    w, m, v = (t[:, n * k : 2 * n * k].view(2, n, k) for t in state)
    m16, v16 = m.bfloat16(), v.bfloat16()
    a, b = torch.zeros(3, rows, n), torch.zeros(3, rows, k)
    slot, ok, step = torch.tensor([0, 1, -1]), torch.ones(3, dtype=torch.bool), torch.ones(2)
    hyper = (1e-3, 0.9, 0.999, 1e-8)
    adam = [
        op_grad_adam.grad_adam_launch(a, b, torch.ones(3), slot, ok, step, w, mm, vv, *hyper, p)
        for mm, vv, p in ((m, v, "ieee"), (m16, v16, "tf32"))
    ]
    matmul = op_slot_matmul.slot_matmul_launch(b, w, slot, torch.zeros(3, rows, n), True, "ieee", 2)
    ptx = {}
    for name, launch in zip(("ieee", "tf32", "matmul"), (*adam, matmul), strict=True):
        ptx[name], usage = _compile_sm90(launch)
        assert "REG:" in usage or usage == "", usage
        assert "STACK:0" in usage or usage == "", f"{name} spills: {usage}"
    assert "mma" not in ptx["ieee"] and "fma.rn.f32" in ptx["ieee"]
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in ptx["tf32"]
    assert "cvt.rn.bf16" in ptx["tf32"] and "bf16" not in ptx["ieee"]


def test_package_imports_and_runs_on_cpu_without_triton():
    """A CPU machine may lack Triton: importing the package must not need it, and the CPU
    ops still run (in a fresh interpreter where importing Triton fails)."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from algorithms.esamp.kernels import slot_matmul, triton_available\n"
        "x, w = torch.ones(1, 2, 3), torch.ones(2, 4, 3)\n"
        "out = slot_matmul(x, w, torch.tensor([1]), torch.zeros(1, 2, 4))\n"
        "assert not triton_available() and out.eq(3).all(), out\n"
    )
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_update_moves_at_most_26_bytes_per_parameter():
    h, i, rows = 3584, 384, 16  # one 7B-shaped matrix, 8 groups
    params = 8 * h * i
    assert grad_adam_bytes(8, rows, i, h) / params <= 26
    assert grad_adam_bytes(8, rows, i, h, moment_bytes=2) / params <= 18
    assert slot_matmul_bytes(8, rows, i, h) / params < 4.2


# candidate_dot: H not a multiple of the interpreted block (16); rows of weight and f are
# strided views (row stride > H).
CAND_H, CAND_V, CAND_R = 77, 50, 6


def _candidates(n: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``weight [V, H]`` (``dtype``), ``f [R, H]`` views with padded rows, and ``n`` pairs
    drawn with repeats (few rows and tokens), the first pair repeated at the end."""
    weight = torch.randn(CAND_V, CAND_H + 5, generator=gen).to(dtype)[:, 2 : 2 + CAND_H]
    f = torch.randn(CAND_R, CAND_H + 3, generator=gen)[:, 1 : 1 + CAND_H]
    rows = torch.randint(0, CAND_R, (n,), generator=gen)
    tokens = torch.randint(0, CAND_V, (n,), generator=gen)
    if n > 1:
        rows[-1], tokens[-1] = rows[0], tokens[0]
    return weight, f, rows, tokens


def _reference_dot(weight, f, rows, tokens) -> torch.Tensor:
    return (weight[tokens].double() * f[rows].double()).sum(-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [1, 13, 64])
def test_candidate_dot_matches_the_fp64_gather(impl, n, dtype):
    """N = 1, N not a multiple of the block of pairs (4), N a multiple; repeated pairs."""
    gen = torch.Generator().manual_seed(n)
    weight, f, rows, tokens = _candidates(n, dtype, gen)
    before = weight.clone(), f.clone()
    buf = torch.full((n + 2,), float("nan"))
    out = buf[1:-1]  # the pads around must stay untouched
    ref = _reference_dot(weight, f, rows, tokens)
    impl.candidate_dot(weight, f, rows, tokens, out)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert buf[0].isnan() and buf[-1].isnan()
    assert out.data_ptr() == buf.data_ptr() + 4
    assert torch.equal(weight, before[0]) and torch.equal(f, before[1])
    if n > 1:
        assert out[0] == out[-1]  # the repeated pair


def test_candidate_dot_strided_indices_and_output(impl):
    """Index and output vectors with a stride (views of wider tensors), int32 indices."""
    gen = torch.Generator().manual_seed(5)
    weight, f, rows, tokens = _candidates(9, torch.bfloat16, gen)
    idx = torch.stack([rows, tokens], 1).int()  # rows: column 0, tokens: column 1
    buf = torch.zeros(9, 3)
    impl.candidate_dot(weight, f, idx[:, 0], idx[:, 1], buf[:, 1])
    ref = _reference_dot(weight, f, rows, tokens)
    torch.testing.assert_close(buf[:, 1].double(), ref, rtol=1e-5, atol=1e-5)
    assert not buf[:, 0].any() and not buf[:, 2].any()


def test_candidate_dot_reference_chunks_join_up():
    """The PyTorch reference (CPU op, CUDA fallback) gathers a chunk of pairs at a time: chunks
    of 5 over 13 pairs (two full, one ragged) give the same sums."""
    from algorithms.esamp.kernels import op_candidate_dot

    gen = torch.Generator().manual_seed(13)
    weight, f, rows, tokens = _candidates(13, torch.bfloat16, gen)
    out = torch.full((13,), float("nan"))
    op_candidate_dot.reference(weight, f, rows, tokens, out, chunk=5)
    ref = _reference_dot(weight, f, rows, tokens)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_candidate_dot_equals_the_fp64_gather_on_random_shapes(triton_ops):
    """Property: random N, H, table sizes and dtypes, the Triton kernel and the CPU op
    both equal the fp64 gather."""
    hyp = pytest.importorskip("hypothesis")
    st = hyp.strategies

    @hyp.settings(max_examples=12, deadline=None, derandomize=True)
    @hyp.given(
        n=st.integers(1, 40), h=st.integers(1, 70), v=st.integers(1, 30), r=st.integers(1, 8),
        dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    )  # fmt: skip
    def check(n, h, v, r, dtype):
        gen = torch.Generator().manual_seed(n * 10_000 + h * 100 + v)
        weight = torch.randn(v, h, generator=gen).to(dtype)
        f = torch.randn(r, h, generator=gen)
        rows = torch.randint(0, r, (n,), generator=gen)
        tokens = torch.randint(0, v, (n,), generator=gen)
        ref = _reference_dot(weight, f, rows, tokens)
        for run in (triton_ops.candidate_dot, candidate_dot):
            out = torch.full((n,), float("nan"))
            run(weight, f, rows, tokens, out)
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)

    check()


def test_candidate_dot_bad_input_names_the_argument():
    w, f = torch.zeros(10, 8, dtype=torch.bfloat16), torch.zeros(3, 8)
    rows, tokens, out = (
        torch.zeros(5, dtype=torch.long),
        torch.zeros(5, dtype=torch.long),
        torch.zeros(5),
    )
    with pytest.raises(
        ValueError,
        match=r"weight must be \[V, H\] float16, bfloat16 or float32, got \[10, 8\] int64",
    ):
        candidate_dot(w.long(), f, rows, tokens, out)
    with pytest.raises(
        ValueError, match=r"f must be \[R, 8\] fp32 \(H of weight\), got \[3, 8\] bfloat16"
    ):
        candidate_dot(w, f.bfloat16(), rows, tokens, out)
    with pytest.raises(
        ValueError, match=r"f must be \[R, 8\] fp32 \(H of weight\), got \[3, 7\] float32"
    ):
        candidate_dot(w, f[:, :7], rows, tokens, out)
    with pytest.raises(
        ValueError, match=r"weight must have unit stride along H .* strides \(1, 10\)"
    ):
        candidate_dot(torch.zeros(8, 10, dtype=torch.bfloat16).T, f, rows, tokens, out)
    with pytest.raises(ValueError, match=r"tokens must be \[N\] int32 or int64, got \[5\] float32"):
        candidate_dot(w, f, rows, tokens.float(), out)
    with pytest.raises(
        ValueError, match=r"rows must be \[5\] int32 or int64 \(one per token\), got \[4\] int64"
    ):
        candidate_dot(w, f, rows[:4], tokens, out)
    with pytest.raises(
        ValueError, match=r"out must be \[5\] fp32 \(one per token\), got \[5\] bfloat16"
    ):
        candidate_dot(w, f, rows, tokens, out.bfloat16())
    # CPU tensors with a meta one dispatch to the no-op meta kernel: the check itself.
    from algorithms.esamp.kernels.op_candidate_dot import check_candidate_dot

    with pytest.raises(ValueError, match=r"tensors on different devices: .*'out': 'meta'"):
        check_candidate_dot(w, f, rows, tokens, out.to("meta"))
    with pytest.raises(ValueError, match="5 pairs index an empty table"):
        candidate_dot(w[:0], f, rows, tokens, out)


def test_candidate_dot_reads_the_gathered_rows_about_once():
    """At 7B shapes (128 rows x 64 candidates, H 3584, bf16 head) the op moves the gathered
    head rows (58.7 MB) plus under 5%: indices, results and f."""
    rows_once = 128 * 64 * 3584 * 2
    moved = candidate_dot_bytes(128 * 64, 3584, 2, f_rows=128)
    assert rows_once < moved < 1.05 * rows_once
    assert candidate_dot_bytes(1, 10, 4) == 10 * 4 + 8 + 8 + 4


def test_candidate_dot_compiles_for_sm90_with_vector_loads():
    """Compiled for sm_90 at the 7B head's layout (H 3584, bf16): no register spills, head and
    prediction rows read by 16-byte vector loads, bf16 upcast and fp32 FMAs."""
    pytest.importorskip("triton", reason="Triton is not installed here")
    from algorithms.esamp.kernels import op_candidate_dot

    weight, f = torch.zeros(64, 3584, dtype=torch.bfloat16), torch.zeros(8, 3584)
    idx, out = torch.zeros(512, dtype=torch.long), torch.zeros(512)
    ptx, usage = _compile_sm90(op_candidate_dot.candidate_dot_launch(weight, f, idx, idx, out))
    assert "STACK:0" in usage or usage == "", f"candidate_dot spills: {usage}"
    assert "ld.global.v4.b32" in ptx and "cvt.f32.bf16" in ptx and "fma.rn.f32" in ptx

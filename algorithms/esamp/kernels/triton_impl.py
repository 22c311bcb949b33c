"""The Triton kernels and their launchers (imported only where Triton is installed).

Kernels are plain functions decorated by :func:`jit_kernels`, so a test can decorate its
own copy under ``TRITON_INTERPRET=1`` (the variable is read at decoration time) and run the
very same launchers on CPU tensors. Launchers only read tensor metadata: no host sync, no
allocation (``slot_matmul`` with ``split_k > 1`` zeroes ``out`` first, one extra launch),
so they can be captured in a CUDA graph once each kernel has compiled.

The kernels call only Triton builtins, no ``@triton.jit`` library helpers (``tl.cdiv``,
``tl.zeros``): those are decorated when Triton is imported, which in a test process may be
before ``TRITON_INTERPRET`` is set, and then cannot run under the interpreter."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import triton
import triton.language as tl

from algorithms.esamp.kernels.checks import check_precision


def _grad_adam_kernel(
    a_ptr,  # [G, M, N] fp32
    b_ptr,  # [G, M, K] fp32
    scale_ptr,  # [G] fp32
    slot_ptr,  # [G] int
    ok_ptr,  # [G] (bool as uint8, int or float): 0 skips the group
    step_ptr,  # [S] fp32, already counting this step
    w_ptr,  # [S, N, K] fp32 (strided view)
    m_ptr,  # [S, N, K] fp32 or bf16
    v_ptr,
    M,
    N,
    K,
    s_ag,
    s_am,
    s_an,
    s_bg,
    s_bm,
    s_bk,
    s_ws,
    s_wn,
    s_wk,
    s_ms,
    s_mn,
    s_mk,
    s_vs,
    s_vn,
    s_vk,
    lr,
    beta1,
    beta2,
    eps,
    # 1 - beta and log(beta), from the host's fp64 (1 - beta2 in fp32 is off by 1e-5)
    one_minus_beta1,
    one_minus_beta2,
    log_beta1,
    log_beta2,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    # One [BLOCK_N, BLOCK_K] tile of one group's matrix: form that tile of the gradient in
    # registers, then Adam on it, reading and writing each element of w, m, v once.
    tile = tl.program_id(0)
    g = tl.program_id(1)
    slot = tl.load(slot_ptr + g).to(tl.int64)
    ok = tl.load(ok_ptr + g)
    if (slot < 0) | (ok == 0):
        return  # nothing read, nothing written: the slot keeps its state bit for bit
    tiles_k = (K + BLOCK_K - 1) // BLOCK_K
    offs_n = (tile // tiles_k) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = (tile % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    in_n = offs_n < N
    in_k = offs_k < K
    a_base = a_ptr + g.to(tl.int64) * s_ag
    b_base = b_ptr + g.to(tl.int64) * s_bg

    # grad tile = a[g][:, n]^T @ b[g][:, k]; M (rows) padded to BLOCK_M by masked loads.
    acc = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)
    for m0 in range(0, M, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        in_m = offs_m < M
        at = tl.load(
            a_base + offs_m[:, None] * s_am + offs_n[None, :] * s_an,
            mask=in_m[:, None] & in_n[None, :],
            other=0.0,
        )
        bt = tl.load(
            b_base + offs_m[:, None] * s_bm + offs_k[None, :] * s_bk,
            mask=in_m[:, None] & in_k[None, :],
            other=0.0,
        )
        acc = tl.dot(tl.trans(at), bt, acc, input_precision=INPUT_PRECISION)
    grad = acc * tl.load(scale_ptr + g)

    # torch._fused_adam_'s formula: bias corrections in fp64 (beta^t = exp(t log beta)).
    t = tl.load(step_ptr + slot).to(tl.float64)
    bc1 = 1.0 - tl.exp(t * log_beta1)
    bc2 = 1.0 - tl.exp(t * log_beta2)
    step_size = (lr / bc1).to(tl.float32)
    bc2_sqrt = tl.sqrt(bc2).to(tl.float32)

    mask = in_n[:, None] & in_k[None, :]
    w_ptrs = w_ptr + slot * s_ws + offs_n[:, None] * s_wn + offs_k[None, :] * s_wk
    m_ptrs = m_ptr + slot * s_ms + offs_n[:, None] * s_mn + offs_k[None, :] * s_mk
    v_ptrs = v_ptr + slot * s_vs + offs_n[:, None] * s_vn + offs_k[None, :] * s_vk
    w = tl.load(w_ptrs, mask=mask)
    m = tl.load(m_ptrs, mask=mask).to(tl.float32)
    v = tl.load(v_ptrs, mask=mask).to(tl.float32)
    m = beta1 * m + one_minus_beta1 * grad
    v = beta2 * v + one_minus_beta2 * grad * grad
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    w = w - tl.div_rn(step_size * m, denom)
    tl.store(w_ptrs, w, mask=mask)
    tl.store(m_ptrs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptrs, v.to(v_ptr.dtype.element_ty), mask=mask)


def _slot_matmul_kernel(
    x_ptr,  # [G, M, K] fp32
    w_ptr,  # [S, ., .] fp32: element (k, n) of slot s at s * s_ws + k * s_wk + n * s_wn
    slot_ptr,  # [G] int
    out_ptr,  # [G, M, N] fp32
    M,
    N,
    K,
    s_xg,
    s_xm,
    s_xk,
    s_ws,
    s_wk,
    s_wn,
    s_og,
    s_om,
    s_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    # One [BLOCK_M, BLOCK_N] tile of out[g], over every SPLIT_K-th BLOCK_K chunk of K (with
    # SPLIT_K > 1 the partial sums are added atomically into a zeroed out).
    tile = tl.program_id(0)
    g = tl.program_id(1)
    part = tl.program_id(2)
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    offs_m = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m = offs_m < M
    in_n = offs_n < N
    slot = tl.load(slot_ptr + g).to(tl.int64)
    k_end = tl.where(slot >= 0, K, 0)  # a padding group reads nothing and writes zeros
    x_base = x_ptr + g.to(tl.int64) * s_xg
    w_base = w_ptr + tl.maximum(slot, 0) * s_ws
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(part * BLOCK_K, k_end, SPLIT_K * BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < K
        xt = tl.load(
            x_base + offs_m[:, None] * s_xm + offs_k[None, :] * s_xk,
            mask=in_m[:, None] & in_k[None, :],
            other=0.0,
        )
        wt = tl.load(
            w_base + offs_k[:, None] * s_wk + offs_n[None, :] * s_wn,
            mask=in_k[:, None] & in_n[None, :],
            other=0.0,
        )
        acc = tl.dot(xt, wt, acc, input_precision=INPUT_PRECISION)
    o_ptrs = out_ptr + g.to(tl.int64) * s_og + offs_m[:, None] * s_om + offs_n[None, :] * s_on
    mask = in_m[:, None] & in_n[None, :]
    if SPLIT_K == 1:
        tl.store(o_ptrs, acc, mask=mask)
    else:
        tl.atomic_add(o_ptrs, acc, mask=mask)


def _candidate_dot_kernel(
    w_ptr,  # [V, H] fp16/bf16/fp32, unit stride along H
    f_ptr,  # [R, H] fp32, unit stride along H
    rows_ptr,  # [N] int
    tokens_ptr,  # [N] int
    out_ptr,  # [N] fp32
    N,
    H,
    s_wv,
    s_fr,
    s_rows,
    s_tokens,
    s_out,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # BLOCK_P pairs: their head rows W[token] and prediction rows f[row] streamed along H in
    # BLOCK_H chunks; products summed in a [BLOCK_P, BLOCK_H] fp32 accumulator, reduced once.
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    in_p = offs_p < N
    tok = tl.load(tokens_ptr + offs_p * s_tokens, mask=in_p, other=0).to(tl.int64)
    row = tl.load(rows_ptr + offs_p * s_rows, mask=in_p, other=0).to(tl.int64)
    w_rows = w_ptr + tok[:, None] * s_wv
    f_rows = f_ptr + row[:, None] * s_fr
    acc = tl.full((BLOCK_P, BLOCK_H), 0.0, tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = in_p[:, None] & (offs_h < H)[None, :]
        w = tl.load(w_rows + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(f_rows + offs_h[None, :], mask=mask, other=0.0)
        acc += w * x
    # tl.sum is a @triton.jit helper (see the module's note); tl.reduce is a builtin, and the
    # interpreter runs it with _sum_combine as np.sum.
    dots = tl.reduce(acc, 1, tl.standard._sum_combine)
    tl.store(out_ptr + offs_p * s_out, dots, mask=in_p)


def jit_kernels() -> SimpleNamespace:
    """Freshly decorated kernels (interpreted when ``TRITON_INTERPRET=1`` is set now)."""
    return SimpleNamespace(
        grad_adam=triton.jit(_grad_adam_kernel),
        slot_matmul=triton.jit(_slot_matmul_kernel),
        candidate_dot=triton.jit(_candidate_dot_kernel),
    )


@functools.cache
def _kernels() -> SimpleNamespace:
    return jit_kernels()


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _log(beta: float) -> float:
    return math.log(beta) if beta > 0 else -math.inf


def _rows_block(rows: int) -> int:
    # Rows padded to a power of two >= 16 by masked loads (fp32 tl.dot needs a reduction of
    # >= 8 on NVIDIA); more than 64 rows loop (grad_adam) or tile (slot_matmul).
    return min(64, max(16, triton.next_power_of_2(rows)))


@dataclass(frozen=True)
class Launch:
    """One kernel launch: which kernel, its grid, positional arguments, compile-time
    constants and warps (what a test needs to compile it for a GPU it does not have)."""

    kernel: str
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constexprs: dict[str, Any]
    num_warps: int

    def run(self, kernels: SimpleNamespace | None = None) -> None:
        fn = getattr(kernels or _kernels(), self.kernel)
        fn[self.grid](*self.args, **self.constexprs, **self.options)

    @property
    def options(self) -> dict[str, Any]:
        # FP contraction (FMA) on, as nvcc compiles PyTorch's own kernels; said explicitly
        # because Triton 3.9 warns that its default will change.
        return dict(num_warps=self.num_warps, enable_fp_fusion=True)


def grad_adam_launch(
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
    input_precision: str = "ieee",
    *,
    block_n: int = 32,
    block_k: int = 128,
    num_warps: int = 8,
) -> Launch | None:
    """The fused gradient + Adam kernel's launch (None: nothing to do). Arguments as
    :func:`algorithms.esamp.kernels.grad_adam`; the caller has checked them."""
    check_precision(input_precision)
    groups, rows, n = a.shape
    k = b.shape[2]
    if groups == 0 or n == 0 or k == 0:
        return None
    if ok.dtype == torch.bool:
        ok = ok.view(torch.uint8)  # Triton loads bool pointers as int1; same bytes
    args = (
        a, b, scale, group_slot, ok, step, w, m, v,
        rows, n, k,
        *a.stride(), *b.stride(), *w.stride(), *m.stride(), *v.stride(),
        lr, beta1, beta2, eps, 1.0 - beta1, 1.0 - beta2, _log(beta1), _log(beta2),
    )  # fmt: skip
    consts = dict(
        BLOCK_M=_rows_block(rows), BLOCK_N=block_n, BLOCK_K=block_k, INPUT_PRECISION=input_precision
    )
    grid = (triton.cdiv(n, block_n) * triton.cdiv(k, block_k), groups)
    return Launch("grad_adam", grid, args, consts, num_warps)


def grad_adam(*args: Any, kernels: SimpleNamespace | None = None, **kwargs: Any) -> None:
    """Run the fused gradient + Adam kernel (arguments as :func:`grad_adam_launch`)."""
    launch = grad_adam_launch(*args, **kwargs)
    if launch is not None:
        launch.run(kernels)


def auto_split_k(tiles: int, k: int, block_k: int, device: torch.device) -> int:
    """Enough K-splits for about two programs per SM (the weights' read is the whole cost,
    so every SM must stream some); 1 where a single pass already fills the GPU."""
    chunks = triton.cdiv(k, block_k)
    want = triton.cdiv(2 * _sm_count(device), max(tiles, 1))
    return max(1, min(want, chunks, 32))


def slot_matmul_launch(
    x: torch.Tensor,
    w: torch.Tensor,
    group_slot: torch.Tensor,
    out: torch.Tensor,
    transpose_w: bool = True,
    input_precision: str = "ieee",
    split_k: int = 0,
    *,
    block_n: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
) -> Launch | None:
    """The slot-indexed grouped matmul's launch (None: nothing to launch). Arguments as
    :func:`algorithms.esamp.kernels.slot_matmul`; ``split_k`` 0 picks it from the SM
    count; the caller has checked the rest. With ``split_k > 1`` the kernel adds into
    ``out``, which must be zero first (:func:`slot_matmul` zeroes it)."""
    check_precision(input_precision)
    if split_k < 0:
        raise ValueError(f"split_k must be >= 0 (0: automatic), got {split_k}")
    groups, rows, k = x.shape
    n = out.shape[2]
    if groups == 0 or rows == 0 or n == 0 or k == 0:
        return None
    block_m = _rows_block(rows)
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(n, block_n)
    if split_k == 0:
        split_k = auto_split_k(tiles * groups, k, block_k, x.device)
    # w[s] as a [K, N] operand: transpose_w reads w [S, N, K] with its strides swapped.
    s_ws, s_w1, s_w2 = w.stride()
    s_wk, s_wn = (s_w2, s_w1) if transpose_w else (s_w1, s_w2)
    args = (
        x, w, group_slot, out,
        rows, n, k,
        *x.stride(), s_ws, s_wk, s_wn, *out.stride(),
    )  # fmt: skip
    consts = dict(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        INPUT_PRECISION=input_precision,
    )
    return Launch("slot_matmul", (tiles, groups, split_k), args, consts, num_warps)


def slot_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    group_slot: torch.Tensor,
    out: torch.Tensor,
    *args: Any,
    kernels: SimpleNamespace | None = None,
    **kwargs: Any,
) -> None:
    """Run the slot-indexed grouped matmul (arguments as :func:`slot_matmul_launch`);
    zeroes ``out`` first where the kernel adds into it (``split_k > 1``) or has no K."""
    launch = slot_matmul_launch(x, w, group_slot, out, *args, **kwargs)
    if launch is None or launch.constexprs["SPLIT_K"] > 1:
        out.zero_()
    if launch is not None:
        launch.run(kernels)


def candidate_dot_launch(
    weight: torch.Tensor,
    f: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    out: torch.Tensor,
    *,
    block_p: int = 4,
    block_h: int = 512,
    num_warps: int = 4,
) -> Launch | None:
    """The candidate dot kernel's launch (None: no pairs). Arguments as
    :func:`algorithms.esamp.kernels.candidate_dot`; the caller has checked them. ``H = 0``
    still launches (it writes zeros)."""
    n, h = tokens.shape[0], weight.shape[1]
    if n == 0:
        return None
    args = (
        weight, f, rows, tokens, out,
        n, h,
        weight.stride(0), f.stride(0), rows.stride(0), tokens.stride(0), out.stride(0),
    )  # fmt: skip
    consts = dict(BLOCK_P=block_p, BLOCK_H=block_h)
    return Launch("candidate_dot", (triton.cdiv(n, block_p),), args, consts, num_warps)


def candidate_dot(*args: Any, kernels: SimpleNamespace | None = None, **kwargs: Any) -> None:
    """Run the candidate dot kernel (arguments as :func:`candidate_dot_launch`)."""
    launch = candidate_dot_launch(*args, **kwargs)
    if launch is not None:
        launch.run(kernels)

"""The op ``tllm_esamp::grad_adam``: one Adam step per live group, gradient formed inside the
kernel."""

from __future__ import annotations

import torch

from algorithms.esamp.kernels.checks import (
    FP32,
    MOMENT_DTYPES,
    _expect,
    _fp32,
    _group_vector,
    _same_device,
    _shape,
    _slot_vector,
    check_precision,
)
from algorithms.esamp.kernels.launch import Launch, bool_bytes, cdiv, log_beta, rows_block, runner
from algorithms.esamp.params import AdamHyper, fused_adam_

SCHEMA = (
    "grad_adam(Tensor a, Tensor b, Tensor scale, Tensor group_slot, Tensor ok, Tensor step, "
    "Tensor(a!) w, Tensor(b!) m, Tensor(c!) v, float lr, float beta1, float beta2, float eps, "
    "str input_precision='ieee') -> ()"
)


def grad_adam(
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    group_slot: torch.Tensor,
    ok: torch.Tensor,
    step: torch.Tensor,
    w: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    input_precision: str = "ieee",
) -> None:
    """For each group with a slot ``s = group_slot[g] >= 0`` and ``ok[g]``: ``grad = scale[g]
    * a[g]^T @ b[g]``, then ``torch._fused_adam_``'s step of ``w[s]``, ``m[s]``, ``v[s]`` at
    count ``step[s]`` (already incremented); other slots are left bit for bit.

    ``a [G, M, N]``, ``b [G, M, K]``, ``scale [G]``, ``step [S]`` fp32, ``w [S, N, K]`` fp32
    and ``m``/``v`` fp32 or bf16, any strided views. Several matrices at once: ``w``/``m``/``v``
    ``[S, E, N, K]``, ``a [G, E, M, N]``, ``b [G, M, K]`` (shared) or ``[G, E_b, M, K]``
    (matrix ``e`` uses ``b[:, e % E_b]``). A slot may be in at most one live group."""
    b1, b2 = betas
    torch.ops.tllm_esamp.grad_adam(
        a, b, scale, group_slot, ok, step, w, m, v, lr, b1, b2, eps, input_precision
    )


def check_grad_adam(
    a, b, scale, group_slot, ok, step, w, m, v, lr, beta1, beta2, eps, input_precision
) -> None:
    """Raise ``ValueError`` naming the bad argument and what is allowed."""
    _same_device(a=a, b=b, scale=scale, group_slot=group_slot, ok=ok, step=step, w=w, m=m, v=v)
    ok_a = a.dim() in (3, 4) and a.dtype == torch.float32
    _expect("a", a, ok_a, "[G, M, N] or [G, E, M, N] fp32")
    e = a.shape[1] if a.dim() == 4 else None  # E matrices of a slot at once
    g, rows, n = a.shape[0], a.shape[-2], a.shape[-1]
    b_ok = b.dim() == 3 and tuple(b.shape[:2]) == (g, rows)
    b_ok = b_ok or (
        e is not None
        and b.dim() == 4
        and (b.shape[0], b.shape[2]) == (g, rows)
        and b.shape[1] >= 1
        and e % b.shape[1] == 0
    )
    if not (b_ok and b.dtype == torch.float32):
        also = "" if e is None else f" or [{g}, E_b, {rows}, K] with {e} % E_b == 0"
        raise ValueError(
            f"b must be [{g}, {rows}, K]{also} fp32 (a is {_shape(a)}), got {_shape(b)}"
        )
    k = b.shape[-1]
    dims = (n, k) if e is None else (e, n, k)  # a slot's
    ok_w = w.dim() == len(dims) + 1 and w.dtype == torch.float32
    _expect("w", w, ok_w, "{} fp32", ("S", *dims[:-2], "N", "K"))
    slots = w.shape[0]
    _expect("w", w, tuple(w.shape[1:]) == dims, "{} (a^T b's shape)", ("S", *dims))
    for name, t in (("m", m), ("v", v)):
        ok_t = t.shape == w.shape and t.dtype in MOMENT_DTYPES
        _expect(name, t, ok_t, "{} fp32 or bf16 (w's shape)", w.shape)
    _group_vector("scale", scale, g)
    _expect("scale", scale, scale.dtype == torch.float32, "fp32")
    _slot_vector(group_slot, g)
    _group_vector("ok", ok, g)
    _fp32("step", step, (slots,), "one count per slot of w")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {beta}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    check_precision(input_precision)


def reference(
    a, b, scale, group_slot, ok, step, w, m, v, lr, beta1, beta2, eps, input_precision="ieee"
) -> None:
    """The PyTorch reference of :func:`grad_adam`: ``fused_adam_`` on each slot's rows."""
    if w.shape[0] == 0:
        return
    if w.dim() == 4:  # E matrices of each slot: one at a time (b shared or cycling)
        for e in range(w.shape[1]):
            b_e = b if b.dim() == 3 else b[:, e % b.shape[1]]
            reference(a[:, e], b_e, scale, group_slot, ok, step, w[:, e], m[:, e], v[:, e],
                      lr, beta1, beta2, eps)  # fmt: skip
        return
    hp = AdamHyper(lr=lr, eps=eps, betas=(beta1, beta2))
    for g in range(a.shape[0]):
        slot = group_slot[g]
        skip = ~((slot >= 0) & (ok[g] != 0))
        idx = slot.clamp(min=0).reshape(1)
        grad = scale[g] * (a[g].transpose(0, 1) @ b[g])
        # The slot's rows gathered (no host read of the slot), stepped, written back.
        rows = [x.index_select(0, idx)[0].float() for x in (w, m, v)]
        fused_adam_(rows[:1], [grad], rows[1:2], rows[2:], [step[idx[0]]], hp, skip.float())
        for dst, new in zip((w, m, v), rows, strict=True):
            dst.index_copy_(0, idx, new.to(dst.dtype)[None])


def grad_adam_launch(
    a, b, scale, group_slot, ok, step, w, m, v, lr, beta1, beta2, eps, input_precision="ieee",
    *, block_n: int = 32, block_k: int = 128, num_warps: int = 8,
) -> Launch | None:  # fmt: skip
    """The fused gradient + Adam kernel's launch (None: nothing to do)."""
    # Several matrices of a slot (w [S, E, N, K]): one more grid axis; b may be shared by
    # all (3 dims) or cycle over fewer matrices than E.
    w, m, v = (t if t.dim() == 4 else t.unsqueeze(1) for t in (w, m, v))
    e = w.shape[1]
    a = a if a.dim() == 4 else a.unsqueeze(1)
    b = b if b.dim() == 4 else b.unsqueeze(1)
    groups, _, rows, n = a.shape
    k = b.shape[3]
    if groups == 0 or n == 0 or k == 0 or e == 0:
        return None
    args = (
        a, b, scale, group_slot, bool_bytes(ok), step, w, m, v,
        rows, n, k, b.shape[1],
        *a.stride(), *b.stride(), *w.stride(), *m.stride(), *v.stride(),
        lr, beta1, beta2, eps, 1.0 - beta1, 1.0 - beta2, log_beta(beta1), log_beta(beta2),
    )  # fmt: skip
    consts = dict(
        BLOCK_M=rows_block(rows), BLOCK_N=block_n, BLOCK_K=block_k, INPUT_PRECISION=input_precision
    )
    grid = (cdiv(n, block_n) * cdiv(k, block_k), groups, e)
    return Launch("grad_adam", grid, args, consts, num_warps)


run_triton = runner(grad_adam_launch)


def grad_adam_bytes(
    groups: int,
    rows: int,
    n: int,
    k: int,
    moment_bytes: int = FP32,
    param_bytes: int = FP32,
    matrices: int = 1,
    *,
    b_matrices: int = 1,
) -> int:
    """Bytes one ``grad_adam`` call moves: w, m, v read and written once per parameter (24
    bytes with fp32 moments, 16 with bf16), the factors read once, the per-group scalars."""
    e = matrices
    params = groups * e * n * k
    state = params * 2 * (param_bytes + 2 * moment_bytes)
    factors = groups * rows * (e * n + b_matrices * k) * FP32
    scalars = groups * (FP32 + 8 + 1 + FP32)  # scale, slot, ok, step
    return state + factors + scalars


def _traffic(a, b, scale, group_slot, ok, step, w, m, v, *args, **kwargs) -> int:
    groups, rows, n = a.shape[0], a.shape[-2], a.shape[-1]
    e = w.shape[1] if w.dim() == 4 else 1
    b_mats = b.shape[1] if b.dim() == 4 else 1
    return grad_adam_bytes(
        groups, rows, n, b.shape[-1], m.element_size(), w.element_size(), e, b_matrices=b_mats
    )

"""The op ``tllm_esamp::silu_mul``: a SwiGLU block's activations ``s = silu(a)``, ``p = s *
u`` in one pass."""

from __future__ import annotations

import torch

from algorithms.esamp.kernels.checks import FP32, _expect, _fp32, _same_device
from algorithms.esamp.kernels.launch import Launch, cdiv, runner

SCHEMA = "silu_mul(Tensor a, Tensor u, Tensor(a!) s, Tensor(b!) p) -> ()"


def silu_mul(a: torch.Tensor, u: torch.Tensor, s: torch.Tensor, p: torch.Tensor) -> None:
    """``s = silu(a)`` and ``p = s * u``, all ``[G, M, I]`` fp32 (any strides), in one pass."""
    torch.ops.tllm_esamp.silu_mul(a, u, s, p)


def check_silu_mul(a, u, s, p) -> None:
    """Raise ``ValueError`` naming the bad argument and what is allowed."""
    _same_device(a=a, u=u, s=s, p=p)
    _expect("a", a, a.dim() == 3 and a.dtype == torch.float32, "[G, M, I] fp32")
    for name, t in (("u", u), ("s", s), ("p", p)):
        _fp32(name, t, tuple(a.shape), "a's shape")


def reference(a, u, s, p) -> None:
    """The PyTorch reference of :func:`silu_mul`: ``torch``'s silu and mul."""
    torch._C._nn.silu(a, out=s)  # F.silu has no out=
    torch.mul(s, u, out=p)


def silu_mul_launch(a, u, s, p, *, block_m=16, block_i=128, num_warps=4) -> Launch | None:
    """The SwiGLU activation kernel's launch (None: nothing to do)."""
    groups, rows, inter = a.shape
    if groups == 0 or rows == 0 or inter == 0:
        return None
    args = (a, u, s, p, rows, inter, *a.stride(), *u.stride(), *s.stride(), *p.stride())
    tiles = cdiv(rows, block_m) * cdiv(inter, block_i)
    consts = dict(BLOCK_M=block_m, BLOCK_I=block_i)
    return Launch("silu_mul", (tiles, groups), args, consts, num_warps)


run_triton = runner(silu_mul_launch)


def _traffic(a, *args, **kwargs) -> int:
    """``silu_mul``'s bytes: ``a`` and ``u`` read, ``s`` and ``p`` written (fp32)."""
    return 4 * a.numel() * FP32

"""The kernels as torch operators (namespace ``tllm_esamp``): a dispatch mode sees each call as
one op with its tensor arguments; CPU (and CUDA where Triton is missing) runs the PyTorch
reference (:mod:`~algorithms.esamp.kernels.reference`), CUDA the Triton kernel
(:mod:`~algorithms.esamp.kernels.triton_impl`), meta and fake tensors nothing at all (the ops
return nothing and only write their mutated arguments).

Defined with ``torch.library.Library`` rather than ``torch.library.custom_op``: a call then
costs the host a few microseconds instead of about fifty (custom_op wraps every call in
Python autograd and view-tracking layers), and an eager ESamp step makes dozens of calls.
The ops have no autograd formula (they run under ``no_grad``)."""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from algorithms.esamp.kernels import reference, traffic
from algorithms.esamp.kernels.checks import (
    check_block_backward,
    check_candidate_dot,
    check_grad_adam,
    check_loss_dy,
    check_silu_mul,
    check_slot_matmul,
    check_stale_max,
    check_update_tail,
)

log = logging.getLogger("tllm")

_LIB = torch.library.Library("tllm_esamp", "DEF")  # kept alive: the registrations live here
_LIB.define(
    "grad_adam(Tensor a, Tensor b, Tensor scale, Tensor group_slot, Tensor ok, Tensor step, "
    "Tensor(a!) w, Tensor(b!) m, Tensor(c!) v, float lr, float beta1, float beta2, float eps, "
    "str input_precision='ieee') -> ()"
)
_LIB.define(
    "slot_matmul(Tensor x, Tensor w, Tensor group_slot, Tensor(a!) out, bool transpose_w=True, "
    "str input_precision='ieee', int split_k=0, Tensor? add=None) -> ()"
)
_LIB.define(
    "candidate_dot(Tensor weight, Tensor f, Tensor rows, Tensor tokens, Tensor(a!) out) -> ()"
)
_LIB.define(
    "loss_dy(Tensor h, Tensor tp, Tensor mask, Tensor(a!) parts, Tensor(b!) dy, "
    "str reduction) -> ()"
)
_LIB.define(
    "block_backward(Tensor dp, Tensor a, Tensor u, Tensor s, Tensor p, Tensor h_in, "
    "Tensor dy, Tensor(a!) du, Tensor(b!) da, Tensor(c!) parts, "
    "str input_precision='ieee') -> ()"
)
_LIB.define(
    "update_tail(Tensor loss_parts, Tensor parts, Tensor group_slot, Tensor mask, "
    "Tensor(a!) step, Tensor(b!)? applied, Tensor(c!) losses, Tensor(d!) ok, "
    "Tensor(e!) scale, Tensor(f!) norm, float grad_clip, float clip_eps) -> ()"
)
_LIB.define("silu_mul(Tensor a, Tensor u, Tensor(a!) s, Tensor(b!) p) -> ()")
_LIB.define(
    "stale_max(Tensor submitted, Tensor applied, Tensor group_slot, Tensor(a!) stale) -> ()"
)


@functools.cache
def triton_available() -> bool:
    """Whether Triton is installed here (the CUDA kernels need it; CPU never does). Looked
    up without importing it: it is imported by the first CUDA call."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _warn_no_triton() -> None:
    log.warning(
        "esamp kernels: Triton is not installed; CUDA tensors run the PyTorch reference "
        "(correct, but several launches and temporaries per call instead of one kernel)"
    )


def _implementations(
    name: str, check: Callable[..., None], run_reference: Callable[..., None]
) -> tuple[Callable[..., None], Callable[..., None]]:
    """The op's CPU and CUDA implementations. Both check the arguments; CPU runs the PyTorch
    reference, CUDA the Triton kernel (the reference, with a warning, where Triton is
    missing)."""
    schema = getattr(torch.ops.tllm_esamp, name).default._schema
    # The dispatcher leaves out trailing arguments that equal their defaults.
    defaults = tuple(arg.default_value for arg in schema.arguments)

    def on_cpu(*args: Any) -> None:
        args = args + defaults[len(args) :]
        check(*args)
        run_reference(*args)

    def on_cuda(*args: Any) -> None:
        if not triton_available():
            _warn_no_triton()
            return on_cpu(*args)
        from algorithms.esamp.kernels import triton_impl

        args = args + defaults[len(args) :]
        check(*args)
        getattr(triton_impl, name)(*args)

    return on_cpu, on_cuda


def _without_precision(run_reference: Callable[..., None]) -> Callable[..., None]:
    # The reference's products are plain fp32: input_precision (the last argument) is not its.
    return lambda *args: run_reference(*args[:-1])


def _slot_matmul_reference(x, w, group_slot, out, transpose_w, _precision, _split_k, add) -> None:
    reference.slot_matmul(x, w, group_slot, out, transpose_w, add)


def _stale_max_reference(submitted, applied, group_slot, stale) -> None:
    if submitted.shape[0]:
        reference.stale_max(submitted, applied, group_slot, stale)


def _nothing(*args, **kwargs) -> None:
    return None


def _register() -> Mapping[str, Callable[..., None]]:
    """Register every op's CPU and CUDA implementation with the library; returns the CUDA
    ones by name (the GPU rehearsal runs them on its fake device)."""
    impls: dict[str, Callable[..., None]] = {}
    for name, check, ref in (
        ("grad_adam", check_grad_adam, _without_precision(reference.grad_adam)),
        ("slot_matmul", check_slot_matmul, _slot_matmul_reference),
        ("candidate_dot", check_candidate_dot, reference.candidate_dot),
        ("loss_dy", check_loss_dy, reference.loss_dy),
        ("block_backward", check_block_backward, _without_precision(reference.block_backward)),
        ("update_tail", check_update_tail, reference.update_tail),
        ("silu_mul", check_silu_mul, reference.silu_mul),
        ("stale_max", check_stale_max, _stale_max_reference),
    ):
        cpu, impls[name] = _implementations(name, check, ref)
        _LIB.impl(name, cpu, "CPU")
        _LIB.impl(name, impls[name], "CUDA")
        # Meta and FakeTensor: shapes are the caller's (out= style), so nothing to do.
        torch.library.register_fake(f"tllm_esamp::{name}", _nothing, lib=_LIB)
    return MappingProxyType(impls)


CUDA_IMPLS = _register()


# What each call moves, for byte counters that go by operator (tllm_core.testing.fake_cuda):
# its arguments hold every slot's weights or the whole head, of which it reads a part.
def _grad_adam_traffic(a, b, scale, group_slot, ok, step, w, m, v, *args, **kwargs) -> int:
    groups, rows, n = a.shape[0], a.shape[-2], a.shape[-1]
    e = w.shape[1] if w.dim() == 4 else 1
    b_mats = b.shape[1] if b.dim() == 4 else 1
    return traffic.grad_adam_bytes(
        groups, rows, n, b.shape[-1], m.element_size(), w.element_size(), e, b_matrices=b_mats
    )


def _slot_matmul_traffic(
    x, w, group_slot, out, transpose_w=True, input_precision="ieee", split_k=0, add=None
) -> int:
    groups, rows, k = x.shape[0], x.shape[-2], x.shape[-1]
    e = w.shape[1] if w.dim() == 4 else 1
    return traffic.slot_matmul_bytes(
        groups, rows, out.shape[-1], k, e,
        shared_x=x.dim() == 3, summed=out.dim() == 3, add=add is not None,
    )  # fmt: skip


def _candidate_dot_traffic(weight, f, rows, tokens, out, *args, **kwargs) -> int:
    return traffic.candidate_dot_bytes(
        tokens.numel(), weight.shape[-1], weight.element_size(), f.shape[0]
    )


def _loss_dy_traffic(h, tp, mask, parts, *args, **kwargs) -> int:
    return traffic.loss_dy_bytes(*h.shape, parts.shape[1])


def _block_backward_traffic(dp, a, u, s, p, h_in, dy, du, da, parts, *args, **kwargs) -> int:
    groups, rows, inter = dp.shape
    return traffic.block_backward_bytes(groups, rows, inter, h_in.shape[2], parts.shape[1])


def _update_tail_traffic(
    loss_parts, parts, group_slot, mask, step, applied, *args, **kwargs
) -> int:
    groups, rows = mask.shape
    cols = loss_parts.shape[1] + parts.shape[1]
    return traffic.update_tail_bytes(groups, rows, cols, applied is not None)


for _name, _traffic in (
    ("grad_adam", _grad_adam_traffic),
    ("slot_matmul", _slot_matmul_traffic),
    ("candidate_dot", _candidate_dot_traffic),
    ("loss_dy", _loss_dy_traffic),
    ("block_backward", _block_backward_traffic),
    ("update_tail", _update_tail_traffic),
    ("silu_mul", lambda a, *args, **kwargs: traffic.silu_mul_bytes(a.numel())),
    ("stale_max", lambda submitted, *args, **kwargs: traffic.stale_max_bytes(submitted.shape[0])),
):
    getattr(torch.ops.tllm_esamp, _name).default.tllm_bytes = _traffic

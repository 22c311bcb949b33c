"""The kernels as torch custom ops (namespace ``tllm_esamp``): a dispatch mode sees each
call as one op with its tensor arguments; CPU (and any device without Triton) runs the
PyTorch reference (:mod:`~algorithms.esamp.kernels.reference`), CUDA the Triton kernel
(:mod:`~algorithms.esamp.kernels.triton_impl`), meta/fake tensors nothing at all (the ops
return nothing and only write their mutated arguments)."""

import functools
import importlib.util
import logging

import torch

from algorithms.esamp.kernels import reference
from algorithms.esamp.kernels.checks import check_grad_adam, check_slot_matmul

log = logging.getLogger("tllm")


@functools.cache
def triton_available() -> bool:
    """Whether Triton is installed here (the CUDA kernels need it; CPU never does). Looked
    up without importing it: it is imported by the first CUDA call."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _warn_no_triton() -> None:
    log.warning(
        "esamp kernels: Triton is not installed; CUDA tensors run the PyTorch reference "
        "(correct, but one launch sequence per group instead of one kernel)"
    )


@torch.library.custom_op("tllm_esamp::grad_adam", mutates_args=("w", "m", "v"))
def grad_adam_op(
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
) -> None:
    check_grad_adam(
        a, b, scale, group_slot, ok, step, w, m, v, lr, beta1, beta2, eps, input_precision
    )
    if w.device.type == "cuda":
        _warn_no_triton()  # the CUDA kernel below is registered only with Triton
    reference.grad_adam(a, b, scale, group_slot, ok, step, w, m, v, lr, beta1, beta2, eps)


@grad_adam_op.register_fake
def _grad_adam_fake(*args, **kwargs) -> None:
    return None


@torch.library.custom_op("tllm_esamp::slot_matmul", mutates_args=("out",))
def slot_matmul_op(
    x: torch.Tensor,
    w: torch.Tensor,
    group_slot: torch.Tensor,
    out: torch.Tensor,
    transpose_w: bool = True,
    input_precision: str = "ieee",
    split_k: int = 0,
) -> None:
    check_slot_matmul(x, w, group_slot, out, transpose_w, input_precision, split_k)
    if out.device.type == "cuda":
        _warn_no_triton()
    reference.slot_matmul(x, w, group_slot, out, transpose_w)


@slot_matmul_op.register_fake
def _slot_matmul_fake(*args, **kwargs) -> None:
    return None


if triton_available():

    @grad_adam_op.register_kernel("cuda")
    def _grad_adam_cuda(
        a, b, scale, group_slot, ok, step, w, m, v, lr, beta1, beta2, eps, input_precision="ieee"
    ) -> None:
        from algorithms.esamp.kernels import triton_impl

        check_grad_adam(
            a, b, scale, group_slot, ok, step, w, m, v, lr, beta1, beta2, eps, input_precision
        )
        triton_impl.grad_adam(
            a, b, scale, group_slot, ok, step, w, m, v, lr, beta1, beta2, eps, input_precision
        )

    @slot_matmul_op.register_kernel("cuda")
    def _slot_matmul_cuda(
        x, w, group_slot, out, transpose_w=True, input_precision="ieee", split_k=0
    ) -> None:
        from algorithms.esamp.kernels import triton_impl

        check_slot_matmul(x, w, group_slot, out, transpose_w, input_precision, split_k)
        triton_impl.slot_matmul(x, w, group_slot, out, transpose_w, input_precision, split_k)

"""The kernels as torch operators (namespace ``tllm_esamp``): a dispatch mode sees each call as
one op with its tensor arguments; CPU (and CUDA where Triton is missing) runs the op's PyTorch
reference, CUDA its Triton kernel, meta and fake tensors nothing at all (the ops return
nothing and only write their mutated arguments). Each op is one module (``op_<name>.py``:
schema, checks, reference, launch, bytes); this one registers them. The references are
written for clarity, but run on any device without a host read (a Python loop over groups;
a skipped group writes back what it read, so its rows end bit for bit as they were).

Defined with ``torch.library.Library`` rather than ``torch.library.custom_op``: a call then
costs the host a few microseconds instead of about fifty (custom_op wraps every call in
Python autograd and view-tracking layers), and an eager ESamp step makes dozens of calls.
The ops have no autograd formula (they run under ``no_grad``)."""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType, ModuleType
from typing import Any

import torch

from algorithms.esamp.kernels import (
    op_block_backward,
    op_candidate_dot,
    op_grad_adam,
    op_loss_dy,
    op_silu_mul,
    op_slot_matmul,
    op_stale_max,
    op_update_tail,
)

log = logging.getLogger("tllm")

OP_MODULES: tuple[ModuleType, ...] = (
    op_grad_adam,
    op_slot_matmul,
    op_candidate_dot,
    op_loss_dy,
    op_block_backward,
    op_update_tail,
    op_silu_mul,
    op_stale_max,
)
_LIB = torch.library.Library("tllm_esamp", "DEF")  # kept alive: the registrations live here
for _op in OP_MODULES:
    _LIB.define(_op.SCHEMA)


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


def _implementations(op: ModuleType) -> tuple[Callable[..., None], Callable[..., None]]:
    """The op's CPU and CUDA implementations. Both check the arguments; CPU runs the PyTorch
    reference, CUDA the Triton kernel (the reference, with a warning, where Triton is
    missing)."""
    schema = getattr(torch.ops.tllm_esamp, op.NAME).default._schema
    # The dispatcher leaves out trailing arguments that equal their defaults.
    defaults = tuple(arg.default_value for arg in schema.arguments)
    check = getattr(op, f"check_{op.NAME}")

    def on_cpu(*args: Any) -> None:
        args = args + defaults[len(args) :]
        check(*args)
        op.reference(*args)

    def on_cuda(*args: Any) -> None:
        if not triton_available():
            _warn_no_triton()
            return on_cpu(*args)
        args = args + defaults[len(args) :]
        check(*args)
        op.run_triton(*args)

    return on_cpu, on_cuda


def _nothing(*args, **kwargs) -> None:
    return None


def _register() -> Mapping[str, Callable[..., None]]:
    """Register every op's CPU and CUDA implementation with the library and its byte count
    (``tllm_bytes``, for counters that go by operator: tllm_core.testing.fake_cuda); returns
    the CUDA ones by name (the GPU rehearsal runs them on its fake device)."""
    impls: dict[str, Callable[..., None]] = {}
    for op in OP_MODULES:
        cpu, impls[op.NAME] = _implementations(op)
        _LIB.impl(op.NAME, cpu, "CPU")
        _LIB.impl(op.NAME, impls[op.NAME], "CUDA")
        # Meta and FakeTensor: shapes are the caller's (out= style), so nothing to do.
        torch.library.register_fake(f"tllm_esamp::{op.NAME}", _nothing, lib=_LIB)
        getattr(torch.ops.tllm_esamp, op.NAME).default.tllm_bytes = op._traffic
    return MappingProxyType(impls)


CUDA_IMPLS = _register()

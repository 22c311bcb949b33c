"""Registers the ``op_<name>.py`` modules as torch operators (namespace ``tllm_esamp``): CPU
(and CUDA without Triton) runs the PyTorch reference, CUDA the Triton kernel, meta and fake
tensors nothing (the ops only write their mutated arguments). ``torch.library.Library``
rather than ``custom_op``: a call costs a few microseconds instead of about fifty."""

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
    """Whether Triton is installed here (looked up without importing it)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _warn_no_triton() -> None:
    log.warning(
        "esamp kernels: Triton is not installed; CUDA tensors run the PyTorch reference "
        "(correct, but several launches and temporaries per call instead of one kernel)"
    )


def _implementations(op: ModuleType, name: str) -> tuple[Callable[..., None], Callable[..., None]]:
    """The op's CPU and CUDA implementations, both checking the arguments first."""
    schema = getattr(torch.ops.tllm_esamp, name).default._schema
    # The dispatcher leaves out trailing arguments that equal their defaults.
    defaults = tuple(arg.default_value for arg in schema.arguments)
    check = getattr(op, f"check_{name}")

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


def _register() -> Mapping[str, Callable[..., None]]:
    """Register every op's implementations and byte count (``tllm_bytes``: fake_cuda's
    counters); the CUDA ones by name (the GPU rehearsal runs them)."""
    impls = {}
    for op in OP_MODULES:
        name = op.SCHEMA.split("(", 1)[0]
        on_cpu, impls[name] = _implementations(op, name)
        _LIB.impl(name, on_cpu, "CPU")
        _LIB.impl(name, impls[name], "CUDA")
        # Meta and FakeTensor: shapes are the caller's (out= style), so nothing to do.
        torch.library.register_fake(f"tllm_esamp::{name}", lambda *a, **k: None, lib=_LIB)
        getattr(torch.ops.tllm_esamp, name).default.tllm_bytes = op._traffic
    return MappingProxyType(impls)


CUDA_IMPLS = _register()

"""What every op's Triton launch shares: the :class:`Launch` record and the integer helpers
(building a launch needs no Triton; running one imports it)."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from algorithms.esamp.kernels.checks import check_precision
from tllm_core import pow2_rows


def triton_impl() -> ModuleType:
    """The Triton kernels' module (imports Triton: only where a launch runs)."""
    return importlib.import_module("algorithms.esamp.kernels.triton_impl")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def log_beta(beta: float) -> float:
    return math.log(beta) if beta > 0 else -math.inf


def rows_block(rows: int) -> int:
    # Rows padded to a power of two >= 16 by masked loads (fp32 tl.dot needs a reduction of
    # >= 8 on NVIDIA); more than 64 rows loop (grad_adam) or tile (slot_matmul).
    return min(64, max(16, pow2_rows(rows)))


def bool_bytes(t: torch.Tensor) -> torch.Tensor:
    # Triton loads bool pointers as int1; the same bytes as uint8.
    return t.view(torch.uint8) if t.dtype == torch.bool else t


@dataclass(frozen=True)
class Launch:
    """One kernel launch (what a test needs to compile it for a GPU it does not have)."""

    kernel: str
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constexprs: dict[str, Any]
    num_warps: int

    def __post_init__(self) -> None:  # every launcher's one check (tests launch directly)
        check_precision(self.constexprs.get("INPUT_PRECISION", "ieee"))

    def run(self, kernels: SimpleNamespace | None = None) -> None:
        fn = getattr(kernels or triton_impl()._kernels(), self.kernel)
        fn[self.grid](*self.args, **self.constexprs, **self.options)

    @property
    def options(self) -> dict[str, Any]:
        # FP contraction (FMA) on, as nvcc compiles PyTorch's own kernels; said explicitly
        # because Triton 3.9 warns that its default will change.
        return dict(num_warps=self.num_warps, enable_fp_fusion=True)


def runner(launch_fn: Callable[..., Launch | None]) -> Callable[..., None]:
    """``launch_fn``'s kernel as a function of the same arguments (``kernels``: whose)."""

    def run(*args: Any, kernels: SimpleNamespace | None = None, **kwargs: Any) -> None:
        launch = launch_fn(*args, **kwargs)
        if launch is not None:
            launch.run(kernels)

    return run

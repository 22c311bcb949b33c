"""ESamp's device memory planned from shapes before anything is allocated, so a setting that
does not fit is refused at start (docs/consumers/esamp.md, "The memory plan"). Torch only."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch

from algorithms.esamp.cuda import RESULT_ROWS, plan_size
from algorithms.esamp.guide_workspace import GuideShape, guidance_workspace_bytes
from algorithms.esamp.params import DistillerShape
from tllm_core import pow2_rows

GIB = 2**30
MIB = 2**20
# The side stream's cuBLAS + cuBLASLt workspaces (torch's default on sm90: 32 MiB each).
CUBLAS_WORKSPACE_BYTES = 2 * 32 * MIB
# Tensors allocated at construction, each rounded up by at most 2 MiB by the caching allocator.
ALLOCATIONS = 26


@dataclass(frozen=True)
class MemoryPlan:
    hidden_size: int
    intermediate_size: int
    num_blocks: int
    vocab_size: int
    slots: int  # S: distiller slots (concurrent prompt groups)
    graph_rows: int  # M: rows per slot the update graph holds
    rows_per_step: int  # R: vLLM's max_num_seqs (decode rows of one step)
    params: int  # P
    state_bytes: int
    inputs_bytes: int
    update_workspace_bytes: int
    predict_workspace_bytes: int
    guidance_workspace_bytes: int
    cublas_workspace_bytes: int = CUBLAS_WORKSPACE_BYTES
    rounding_bytes: int = ALLOCATIONS * 2 * MIB

    @property
    def total_bytes(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self) if f.name.endswith("_bytes"))

    def as_dict(self) -> dict[str, int | float]:
        total = self.total_bytes
        return {**asdict(self), "total_bytes": total, "total_gib": round(total / GIB, 4)}

    def describe(self) -> str:
        gib = lambda b: f"{b / GIB:.3f} GiB"  # noqa: E731
        return (
            f"{gib(self.total_bytes)} = state {gib(self.state_bytes)} ({self.slots} slots x "
            f"{self.params} params x weights + 2 Adam moments) + update inputs "
            f"{gib(self.inputs_bytes)} + update workspace {gib(self.update_workspace_bytes)} "
            f"+ predict {gib(self.predict_workspace_bytes)} + guidance "
            f"{gib(self.guidance_workspace_bytes)} + cuBLAS workspaces "
            f"{gib(self.cublas_workspace_bytes)} + allocator rounding "
            f"{gib(self.rounding_bytes)} (rows per step {self.rows_per_step}, "
            f"graph rows per slot {self.graph_rows})"
        )


def default_slots(rows_per_step: int, graph_rows: int) -> int:
    """Slots for ``rows_per_step`` rows in groups of ``graph_rows``."""
    return max(1, math.ceil(rows_per_step / graph_rows))


def plan_memory(
    hidden_size: int,
    vocab_size: int,
    *,
    slots: int,
    graph_rows: int,
    rows_per_step: int,
    intermediate_size: int = 384,
    num_blocks: int = 2,
    max_candidates: int = 64,
    optimizer_stats: bool = False,
    moment_bytes: int = 4,
    mode: str = "auto",
    dtype: torch.dtype = torch.bfloat16,
    noise: bool = False,
    diagnostics: bool = False,
) -> MemoryPlan:
    """The plan for these shapes (each term: docs/consumers/esamp.md)."""
    sh = DistillerShape(hidden_size, intermediate_size, num_blocks)
    p, h, i, nb = sh.num_params, hidden_size, intermediate_size, num_blocks
    s, m = slots, pow2_rows(graph_rows)
    t = s * m
    # The CUDA distiller's packed buffers, row plan, result ring and kept forward (exact).
    ring = RESULT_ROWS * s * (8 + (16 if optimizer_stats else 0)) + s * 16 + 8
    kept_forward = nb * ((t + 1) * h + 4 * t * i) * 4
    plan = 8 * plan_size(t, s)
    guide = GuideShape(
        rows_per_step, h, vocab_size, max_candidates, mode, s, dtype, noise, diagnostics
    )
    dims = (hidden_size, intermediate_size, num_blocks, vocab_size, s, m, rows_per_step, p)
    return MemoryPlan(
        *dims,
        state_bytes=s * (p * (4 + 2 * moment_bytes) + 4) + s * 8 + p * 4,
        inputs_bytes=2 * t * h * 4 + 3 * (t + 1) * h * 4 + plan + ring + kept_forward,
        update_workspace_bytes=t * ((3 + 3 * nb) * h + 9 * nb * i) * 4,
        predict_workspace_bytes=t * ((2 + nb) * h + 5 * nb * i) * 4,
        guidance_workspace_bytes=guidance_workspace_bytes(guide),
    )


def check_plan(plan: MemoryPlan, device_bytes: int, max_fraction: float) -> None:
    """Refuse a plan over ``max_fraction`` of ``device_bytes`` (ValueError with the numbers)."""
    limit = max_fraction * device_bytes
    if plan.total_bytes > limit:
        raise ValueError(
            f"esamp: the memory plan needs {plan.describe()}, more than max_memory_fraction "
            f"{max_fraction} of the device's {device_bytes / GIB:.2f} GiB "
            f"({limit / GIB:.3f} GiB). Lower cuda_capacity or cuda_graph_max_rows, or raise "
            "max_memory_fraction."
        )


def device_total_bytes(device: torch.device | str) -> int | None:
    """Total memory of a CUDA device; None elsewhere (the CPU state grows instead)."""
    dev = torch.device(device)
    return int(torch.cuda.mem_get_info(dev)[1]) if dev.type == "cuda" else None

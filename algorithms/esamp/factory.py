"""Picks the distiller for a device and builds it from an ESamp config."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from algorithms.esamp.cpu import GroupedDistiller
from algorithms.esamp.cuda import CudaGroupedDistiller
from algorithms.esamp.slots import SlotDistiller
from tllm_core import pow2_rows

if TYPE_CHECKING:
    from algorithms.esamp.config import ESampConfig


def uses_gpu_path(device: torch.device) -> bool:
    """Whether a distiller on ``device`` takes the CUDA path (fake-device tests patch it)."""
    return device.type == "cuda"


def _use_side_thread(mode: str) -> bool:
    """``cpu_update`` resolved: 'auto' means a side thread only if a core is left idle."""
    if mode != "auto":
        return mode == "thread"
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return torch.get_num_threads() < cores


# Config fields the distiller takes as they are.
_DISTILLER_FIELDS = tuple(
    "intermediate_size num_blocks lr eps grad_clip loss_reduction optimizer_stats seed".split()
)


def distiller_for(
    cfg: ESampConfig, hidden_size: int, device: torch.device, slots: int
) -> SlotDistiller:
    """The distiller ``cfg`` asks for on ``device`` (``slots``: the CUDA one's capacity)."""
    # zero_output: the blocks start at zero (f(x) = x) and the distiller subtracts the input.
    zero_output = cfg.init == "zero_output"
    kw = {name: getattr(cfg, name) for name in _DISTILLER_FIELDS}
    kw.update(init="zero" if zero_output else cfg.init, zero_output=zero_output)
    # Not under inference mode: state made there could not be trained in place.
    with torch.inference_mode(False):
        if not uses_gpu_path(device):
            side = _use_side_thread(cfg.cpu_update)
            return GroupedDistiller(hidden_size, device=device, side_thread=side, **kw)
        rows = pow2_rows(cfg.cuda_graph_max_rows)
        if slots * rows < cfg.cuda_rows_per_step:  # the CUDA path packs every decode row
            name = "max_groups" if cfg.max_groups else "cuda_capacity"
            raise ValueError(
                f"esamp: {name} {slots} x cuda_graph_max_rows {cfg.cuda_graph_max_rows} (rounded "
                f"to {rows}) = {slots * rows} packed rows, fewer than cuda_rows_per_step "
                f"{cfg.cuda_rows_per_step}: the CUDA path packs every decode row of a step into "
                f"them; raise {name} or cuda_graph_max_rows, or lower cuda_rows_per_step"
            )
        # Allocated and captured now, inside vLLM's load_model (before it sizes the KV cache).
        return CudaGroupedDistiller(
            hidden_size,
            device=device,
            use_cuda_graph=cfg.use_cuda_graph,
            capacity=slots,
            graph_max_rows=cfg.cuda_graph_max_rows,
            moments_dtype=getattr(torch, cfg.cuda_adam_moments),
            tf32=cfg.cuda_tf32,
            **kw,
        )

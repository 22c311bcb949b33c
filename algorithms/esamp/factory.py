"""Picks the distiller implementation for a device."""

from __future__ import annotations

from typing import Any

import torch

from algorithms.esamp.cpu import GroupedDistiller
from algorithms.esamp.cuda import CudaGroupedDistiller
from algorithms.esamp.slots import SlotDistiller


def make_distiller(
    hidden_size: int,
    device: torch.device | str,
    use_cuda_graph: bool = True,
    side_thread: bool = False,
    graph_max_rows: int = 16,
    **kwargs: Any,
) -> SlotDistiller:
    """The CUDA implementation (side stream, graphs captured here, fixed capacity) for CUDA
    devices, else the CPU one (updates on a side thread when ``side_thread``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaGroupedDistiller(
            hidden_size,
            device=device,
            use_cuda_graph=use_cuda_graph,
            graph_max_rows=graph_max_rows,
            **kwargs,
        )
    return GroupedDistiller(hidden_size, device=device, side_thread=side_thread, **kwargs)

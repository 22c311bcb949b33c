"""Named step temporaries carved out of one flat device allocation (no allocation per step)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# Byte alignment of each part (cuBLAS wants 16; 256 keeps every part on its own cache lines).
ALIGN = 256

WorkspaceSpec = Sequence[tuple[str, tuple[int, ...], torch.dtype]]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _part_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def workspace_bytes(spec: WorkspaceSpec) -> int:
    """Bytes of :func:`carve_workspace`'s one allocation for ``spec`` (parts aligned to ``ALIGN``)."""
    return sum(_aligned(_part_bytes(shape, dtype)) for _, shape, dtype in spec)


def carve_workspace(
    spec: WorkspaceSpec, device: torch.device | str
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(flat, parts)``: one zeroed uint8 allocation and a view per part of ``spec``."""
    flat = torch.zeros(workspace_bytes(spec), dtype=torch.uint8, device=device)
    return flat, carve_workspace_from(flat, spec)


def carve_workspace_from(flat: torch.Tensor, spec: WorkspaceSpec) -> dict[str, torch.Tensor]:
    """The parts of ``spec`` as views of ``flat`` (uint8, at least :func:`workspace_bytes`)."""
    if flat.dtype != torch.uint8 or flat.numel() < workspace_bytes(spec):
        raise ValueError(
            f"need a uint8 tensor of at least {workspace_bytes(spec)} bytes, got "
            f"{flat.dtype} of {flat.numel()}"
        )
    names = [name for name, _, _ in spec]
    if len(set(names)) != len(names):
        raise ValueError(f"workspace part names must be distinct, got {names}")
    parts, off = {}, 0
    for name, shape, dtype in spec:
        n = _part_bytes(shape, dtype)
        parts[name] = flat[off : off + n].view(dtype).view(shape)
        off += _aligned(n)
    return parts

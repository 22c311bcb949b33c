"""Argument checks and constants shared by the kernels' ops (metadata only: no
device reads, so they are safe inside a CUDA graph capture)."""

from __future__ import annotations

import torch

# tl.dot's choices for fp32 inputs: exact fp32 ("ieee"), TF32 tensor cores ("tf32"), or
# three TF32 products that recover about fp32 accuracy ("tf32x3").
INPUT_PRECISIONS = ("ieee", "tf32", "tf32x3")
MOMENT_DTYPES = (torch.float32, torch.bfloat16)
# An LM head's weight dtypes (candidate_dot upcasts each element to fp32).
HEAD_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SLOT_DTYPES = (torch.int32, torch.int64)
FP32 = 4  # bytes


def check_precision(input_precision: str) -> None:
    if input_precision not in INPUT_PRECISIONS:
        raise ValueError(
            f"input_precision {input_precision!r} is not one of {', '.join(INPUT_PRECISIONS)}"
        )


def _shape(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _same_device(**tensors: torch.Tensor) -> None:
    first = next(iter(tensors.values())).device
    if any(t.device != first for t in tensors.values()):
        devices = {n: str(t.device) for n, t in tensors.items()}
        raise ValueError(f"tensors on different devices: {devices}")


def _expect(name: str, t: torch.Tensor, ok: bool, want: str, *args: object) -> None:
    """Unless ``ok``, raise ``ValueError`` "NAME must be WANT.format(*ARGS), got SHAPE DTYPE"
    (a tuple as ``[a, b]``); formatted only then, as the checks run on every eager call."""
    if not ok:
        args = ["[" + ", ".join(map(str, a)) + "]" if isinstance(a, tuple) else a for a in args]
        raise ValueError(f"{name} must be {want.format(*args)}, got {_shape(t)}")


def _group_vector(name: str, t: torch.Tensor, groups: int) -> None:
    _expect(name, t, t.dim() == 1 and t.shape[0] == groups, "[{}]", groups)


def _slot_vector(group_slot: torch.Tensor, groups: int) -> None:
    # Each group's slot (-1: none).
    _group_vector("group_slot", group_slot, groups)
    _expect("group_slot", group_slot, group_slot.dtype in _SLOT_DTYPES, "int32 or int64")


# block_backward: rows are tiled by up to this many for the Gram matrices; each pair of row
# tiles of a group writes one column of the norm parts.
NORM_TILE_ROWS = 32


# block_backward: hidden columns per program (norm_parts with a hidden size: the columns
# that let a group's row-tile pairs spread over that many programs).
NORM_CHUNK_HIDDEN = 512


def norm_parts(rows: int, hidden: int = 0) -> int:
    """Columns of ``block_backward``'s norm parts: one per pair of row tiles, times the
    shares of ``hidden`` (``NORM_CHUNK_HIDDEN`` columns each) where given."""
    tiles = max(1, -(-rows // NORM_TILE_ROWS))
    return tiles * tiles * max(1, -(-hidden // NORM_CHUNK_HIDDEN))


def _fp32(name: str, t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    ok = tuple(t.shape) == shape and t.dtype == torch.float32
    _expect(name, t, ok, "{} fp32 ({})", shape, what)

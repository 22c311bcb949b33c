"""What each kernel must move through memory (bytes), for docs and the benchmarks' floors."""

from __future__ import annotations

FP32 = 4


def grad_adam_bytes(
    groups: int, rows: int, n: int, k: int, moment_bytes: int = FP32, param_bytes: int = FP32
) -> int:
    """Bytes one ``grad_adam`` call moves for ``groups`` live groups of an ``[n, k]`` matrix
    with ``rows`` rows each: w, m, v read and written once per parameter, the factors
    ``a [rows, n]`` and ``b [rows, k]`` read once (tiles re-read them from L2, not DRAM),
    plus the per-group scalars. With fp32 moments: 24 bytes per parameter and the factors'
    share (16 with bf16 moments)."""
    params = groups * n * k
    state = params * 2 * (param_bytes + 2 * moment_bytes)
    factors = groups * rows * (n + k) * FP32
    scalars = groups * (FP32 + 8 + 1 + FP32)  # scale, slot, ok, step
    return state + factors + scalars


def slot_matmul_bytes(groups: int, rows: int, n: int, k: int) -> int:
    """Bytes one ``slot_matmul`` call moves for ``groups`` live groups: each group's weight
    ``[n, k]`` read once, ``x [rows, k]`` read, ``out [rows, n]`` written."""
    return groups * (n * k + rows * k + rows * n) * FP32 + groups * 8


def candidate_dot_bytes(n: int, h: int, weight_bytes: int, f_rows: int = 0) -> int:
    """Bytes one ``candidate_dot`` call moves for ``n`` (row, token) pairs of hidden size
    ``h``: each pair's head row read once (``weight_bytes`` per element; a token repeated
    across rows is counted each time), its two int64 indices read and its fp32 result
    written, plus the prediction ``f [f_rows, h]`` read once (its rows are re-read from L2,
    not DRAM)."""
    return n * h * weight_bytes + n * (8 + 8 + FP32) + f_rows * h * FP32

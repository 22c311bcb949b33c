"""What each kernel must move through memory (bytes), for docs and the benchmarks' floors."""

from __future__ import annotations

FP32 = 4


def grad_adam_bytes(
    groups: int,
    rows: int,
    n: int,
    k: int,
    moment_bytes: int = FP32,
    param_bytes: int = FP32,
    matrices: int = 1,
    *,
    b_matrices: int = 1,
) -> int:
    """Bytes one ``grad_adam`` call moves for ``groups`` live groups of ``matrices`` ``[n,
    k]`` matrices with ``rows`` rows each: w, m, v read and written once per parameter, the
    factors ``a [rows, n]`` (per matrix) and the ``b_matrices`` ``b [rows, k]`` (matrices
    sharing one read it once) read once (tiles re-read them from L2, not DRAM), plus the
    per-group scalars. With fp32 moments: 24 bytes per parameter and the factors' share
    (16 with bf16 moments)."""
    e = matrices
    params = groups * e * n * k
    state = params * 2 * (param_bytes + 2 * moment_bytes)
    factors = groups * rows * (e * n + b_matrices * k) * FP32
    scalars = groups * (FP32 + 8 + 1 + FP32)  # scale, slot, ok, step
    return state + factors + scalars


def slot_matmul_bytes(
    groups: int,
    rows: int,
    n: int,
    k: int,
    matrices: int = 1,
    *,
    shared_x: bool = True,
    summed: bool = False,
    add: bool = False,
) -> int:
    """Bytes one ``slot_matmul`` call moves for ``groups`` live groups: each group's weight
    ``[n, k]`` (per matrix) read once, ``x [rows, k]`` read (once where the matrices share
    it), ``out [rows, n]`` written (once where summed over the matrices), ``add [rows, n]``
    read."""
    e = matrices
    x_reads = 1 if shared_x else e
    outs = 1 if summed else e
    per_group = e * n * k + x_reads * rows * k + outs * rows * n + (rows * n if add else 0)
    return groups * per_group * FP32 + groups * 8


def candidate_dot_bytes(n: int, h: int, weight_bytes: int, f_rows: int = 0) -> int:
    """Bytes one ``candidate_dot`` call moves for ``n`` (row, token) pairs of hidden size
    ``h``: each pair's head row read once (``weight_bytes`` per element; a token repeated
    across rows is counted each time), its two int64 indices read and its fp32 result
    written, plus the prediction ``f [f_rows, h]`` read once (its rows are re-read from L2,
    not DRAM)."""
    return n * h * weight_bytes + n * (8 + 8 + FP32) + f_rows * h * FP32


def loss_dy_bytes(groups: int, rows: int, hidden: int, parts: int = 1) -> int:
    """``loss_dy``: ``h`` and ``tp`` read, ``dy`` written (``[groups, rows, hidden]`` fp32
    each), the mask read (by each of a group's ``parts`` programs) and the loss parts
    written."""
    return 3 * groups * rows * hidden * FP32 + groups * parts * (rows + FP32)


def block_backward_bytes(groups: int, rows: int, inter: int, hidden: int, parts: int) -> int:
    """``block_backward``: ``dp``, ``a``, ``u``, ``s``, ``p`` read and ``du``, ``da`` written
    (``[rows, inter]`` each), ``h_in`` and ``dy`` read (``[rows, hidden]``) per group (a
    group's row tiles re-read them from L2, not DRAM), its norm parts written."""
    per_group = (7 * rows * inter + 2 * rows * hidden + parts) * FP32
    return groups * per_group


def update_tail_bytes(groups: int, rows: int, parts: int, applied: bool = True) -> int:
    """``update_tail``: per group its ``parts`` loss and norm parts, slot and mask row read;
    loss, ok, scale and norm written; its slot's step (and ``applied`` count) read and
    written."""
    per_group = FP32 * parts + 8 + rows + 3 * FP32 + 1 + 2 * FP32 + (16 if applied else 0)
    return groups * per_group


def silu_mul_bytes(numel: int) -> int:
    """``silu_mul``: ``a`` and ``u`` read, ``s`` and ``p`` written (fp32)."""
    return 4 * numel * FP32


def stale_max_bytes(groups: int) -> int:
    """``stale_max``: per group its submitted count, slot and slot's applied count read
    (int64), the maximum read and written."""
    return groups * 3 * 8 + 2 * 8

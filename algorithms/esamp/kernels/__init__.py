"""ESamp's fused GPU kernels, as torch operators (``torch.ops.tllm_esamp``; a dispatch mode
sees each call as one op):

- :func:`grad_adam`: each group's weight gradient ``scale * a^T b`` formed tile by tile in
  registers and consumed at once by an Adam step of that group's slot (never stored), so
  the update moves each parameter and its moments once: 24 bytes per parameter with fp32
  moments, 16 with bf16 (:func:`grad_adam_bytes`);
- :func:`slot_matmul`: ``out[g] = x[g] @ w[slot[g]]^T`` (or ``@ w[slot[g]]``) reading only
  the listed slots' weights, out= style (no allocation);
- :func:`silu_mul`: a SwiGLU block's activations ``s = silu(a)``, ``p = s * u`` in one
  launch;
- :func:`loss_dy`, :func:`block_backward`, :func:`update_tail`: the rest of the update's
  backward, one launch each: the loss and its gradient; per SwiGLU block the elementwise
  backward with the block's share of each group's gradient norm (from Gram matrices);
  norm, finite check, clip coefficient and the step counts;
- :func:`stale_max`: the prediction's staleness measurement (largest lag of its groups'
  slots) in one launch;
- :func:`candidate_dot`: guidance's dist logits for (row, token) pairs,
  ``out[j] = W[tokens[j]] . f[rows[j]]`` in fp32, reading each pair's head row once in its
  own dtype (no gathered or upcast copy), out= style (:func:`candidate_dot_bytes`).

The first two take ``w`` (and ``m``/``v``) as strided views into the slots' flat ``[S, P]``
state rows. CUDA runs Triton kernels (Triton is imported only there); CPU and meta run the
PyTorch reference and a no-op. One module per op (``op_<name>.py``) holds its schema,
checks, reference, launch and byte count. Importing this package needs neither Triton nor a GPU.
"""

from __future__ import annotations

from algorithms.esamp.kernels import ops  # noqa: F401  (defines the ops)
from algorithms.esamp.kernels.checks import (
    HEAD_DTYPES,
    INPUT_PRECISIONS,
    MOMENT_DTYPES,
    NORM_TILE_ROWS,
    norm_parts,
)
from algorithms.esamp.kernels.op_block_backward import block_backward, block_backward_bytes
from algorithms.esamp.kernels.op_candidate_dot import candidate_dot, candidate_dot_bytes
from algorithms.esamp.kernels.op_grad_adam import grad_adam, grad_adam_bytes
from algorithms.esamp.kernels.op_loss_dy import loss_dy, loss_dy_bytes
from algorithms.esamp.kernels.op_silu_mul import silu_mul, silu_mul_bytes
from algorithms.esamp.kernels.op_slot_matmul import slot_matmul, slot_matmul_bytes
from algorithms.esamp.kernels.op_stale_max import stale_max, stale_max_bytes
from algorithms.esamp.kernels.op_update_tail import update_tail, update_tail_bytes
from algorithms.esamp.kernels.ops import triton_available

__all__ = [
    "HEAD_DTYPES",
    "INPUT_PRECISIONS",
    "MOMENT_DTYPES",
    "NORM_TILE_ROWS",
    "block_backward",
    "block_backward_bytes",
    "candidate_dot",
    "candidate_dot_bytes",
    "grad_adam",
    "grad_adam_bytes",
    "loss_dy",
    "loss_dy_bytes",
    "norm_parts",
    "silu_mul",
    "silu_mul_bytes",
    "slot_matmul",
    "slot_matmul_bytes",
    "stale_max",
    "stale_max_bytes",
    "triton_available",
    "update_tail",
    "update_tail_bytes",
]

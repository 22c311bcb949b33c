"""What the tests of ESamp's kernels share: the Triton kernels decorated for Triton's
interpreter (so their launchers run on CPU tensors)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def interpreted_kernels() -> SimpleNamespace:
    """ESamp's kernels (``triton_impl.jit_kernels``) decorated with ``TRITON_INTERPRET=1``
    set (Triton reads it when a kernel is decorated), the variable then put back as it
    was; skips the test without Triton."""
    pytest.importorskip("triton", reason="Triton is not installed here")
    from algorithms.esamp.kernels import triton_impl

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        return triton_impl.jit_kernels()

"""What the tests of ESamp's kernels share: the Triton kernels decorated for Triton's
interpreter (so their launchers run on CPU tensors), and the update graph over every slot."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


def interpreted_kernels() -> SimpleNamespace:
    """ESamp's kernels (``triton_impl.jit_kernels``) decorated with ``TRITON_INTERPRET=1``
    set (Triton reads it when a kernel is decorated), the variable then put back as it
    was; skips the test without Triton."""
    pytest.importorskip("triton", reason="Triton is not installed here")
    from algorithms.esamp.kernels import triton_impl

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        return triton_impl.jit_kernels()


def train_dense(theta, m, v, step, valid, xp, tp, mask, shape, hp, applied=None, stats=None):
    """``graph_update.train_groups`` with packed group ``s`` = slot ``s`` of every slot of the
    state (``valid [S]``: slots with rows; ``xp``/``tp`` ``[S, M, H]``): returns per slot."""
    from algorithms.esamp.graph_update import train_groups

    gs = torch.where(valid, torch.arange(theta.shape[0], device=theta.device), -1)
    return train_groups(theta, m, v, step, gs, xp, tp, mask, shape, hp, applied, stats)

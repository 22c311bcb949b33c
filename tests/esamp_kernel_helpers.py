"""What the tests of ESamp's kernels share: the Triton kernels decorated for Triton's
interpreter (so their launchers run on CPU tensors), and the update graph over every slot."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch


def interpreted_kernels() -> SimpleNamespace:
    """ESamp's kernels (``triton_impl.jit_kernels``) decorated with ``TRITON_INTERPRET=1``
    set (Triton reads it when a kernel is decorated), the variable then put back as it
    was; skips the test without Triton, or where Triton's interpreter cannot run them."""
    pytest.importorskip("triton", reason="Triton is not installed here")
    from algorithms.esamp.kernels import triton_impl

    if problem := _interpreter_problem():
        pytest.skip(problem)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        return triton_impl.jit_kernels()


@functools.cache
def _interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run the kernels here, or None. A loop bound computed
    from ``program_id`` (as the kernels have) fails in Triton 3.6's interpreter with
    numpy >= 2.5 (its ``__index__`` converts a one-element array)."""
    import numpy
    import triton
    import triton.language as tl

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")

        @triton.jit
        def probe(out_ptr):
            for i in range(tl.program_id(0), 1):
                tl.store(out_ptr + i, 1.0)

    out = torch.zeros(1)
    try:
        probe[(1,)](out)
    except Exception as err:  # noqa: BLE001 - any failure means: cannot run here
        return (
            f"Triton {triton.__version__}'s interpreter cannot run the kernels with numpy "
            f"{numpy.__version__}: {type(err).__name__}: {err}"
        )
    return None if out.item() == 1.0 else "Triton's interpreter ran a probe kernel wrongly"


def triton_under_test() -> tuple[SimpleNamespace | None, Callable[[Callable], Callable]]:
    """The Triton kernels a test runs and how to call them: where a CUDA device is, the
    compiled kernels (None: the default ones) on copies of the call's tensors there; else
    the interpreted ones (:func:`interpreted_kernels`) on the CPU tensors themselves."""
    if torch.cuda.is_available():
        return None, on_device(torch.device("cuda"))
    return interpreted_kernels(), lambda fn: fn


def on_device(device: torch.device) -> Callable[[Callable], Callable]:
    """``fn`` run on copies of its tensor arguments on ``device``, each copied back after
    (outputs are written in place). A view is moved with its whole base and keeps its
    strides and offset there, so writes outside it show up back here too."""

    def wrap(fn: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

            def move(t: Any) -> Any:
                if not isinstance(t, torch.Tensor):
                    return t
                base = t if t._base is None else t._base
                if id(base) not in moved:
                    assert base.is_contiguous(), "on_device moves contiguous bases only"
                    moved[id(base)] = (base, base.to(device, copy=True))
                there = moved[id(base)][1]
                offset = there.storage_offset() + t.storage_offset() - base.storage_offset()
                return there.as_strided(t.size(), t.stride(), offset)

            res = fn(*map(move, args), **{k: move(v) for k, v in kwargs.items()})
            for base, there in moved.values():
                base.copy_(there)
            return res.to(args[0].device) if isinstance(res, torch.Tensor) else res

        return call

    return wrap


def train_dense(theta, m, v, step, valid, xp, tp, mask, shape, hp, applied=None, stats=None):
    """``graph_update.train_groups`` with packed group ``s`` = slot ``s`` of every slot of the
    state (``valid [S]``: slots with rows; ``xp``/``tp`` ``[S, M, H]``): returns per slot."""
    from algorithms.esamp.graph_update import train_groups

    gs = torch.where(valid, torch.arange(theta.shape[0], device=theta.device), -1)
    return train_groups(theta, m, v, step, gs, xp, tp, mask, shape, hp, applied, stats)

"""Count the bytes an operation sequence moves, from the tensor sizes of the aten operations
it dispatches (a ``TorchDispatchMode``; torch only).

Each operation counts the bytes of its tensor inputs (read) plus the tensors it writes: its
new outputs and the arguments its schema marks as written (an in-place or ``out=``
operation thus counts its target twice, read and written; a fused optimizer's parameters
and moments too, though it returns nothing). Views,
reshapes and other aliasing operations move nothing and count nothing; ``torch.empty``-like
allocations count nothing either. This is what the operations ask of memory if every
operand is read and written once, not a cache simulation: a fused kernel that keeps
intermediates in registers moves less than the unfused sequence, and that difference is
what the count shows. The mode is thread-local: work on other threads is not counted.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Operations that allocate without reading or writing data, or only describe shapes.
_FREE = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "lift_fresh",
    "_unsafe_view",
}


def _bytes(tensors: Any) -> int:
    return sum(
        t.numel() * t.element_size() for t in tree_leaves(tensors) if isinstance(t, torch.Tensor)
    )


class BytesCounter(TorchDispatchMode):
    """``with BytesCounter() as c: ...`` then ``c.total`` (bytes) and ``c.by_op`` (a Counter
    of bytes by operation name)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if not func.is_view and name not in _FREE:
            self.by_op[name] += _moved(func, args, kwargs, out)
        return out


def _moved(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Bytes ``func`` reads and writes: every argument is read except ``out=`` ones; those
    and the arguments marked as written are written; so are outputs that alias no input."""
    schema = func._schema
    n = 0
    for i, arg in enumerate(schema.arguments):
        size = _bytes(args[i] if i < len(args) else kwargs.get(arg.name))
        written = arg.alias_info is not None and arg.alias_info.is_write
        n += size * ((not arg.is_out) + written)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    for ret, o in zip(schema.returns, outs, strict=False):
        if ret.alias_info is None:
            n += _bytes(o)
    return n

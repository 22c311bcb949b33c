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

from torch.utils._python_dispatch import TorchDispatchMode

# The counting rules are shared with the fake-device check (tllm_core.testing.fake_cuda).
from tllm_core.testing.fake_cuda_checker import NO_DATA, op_bytes


class BytesCounter(TorchDispatchMode):
    """``with BytesCounter() as c: ...`` then ``c.total`` (bytes) and ``c.by_op`` (a Counter
    of bytes by operation name)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.calls = 0  # operations counted (a launch each; views and allocations not)

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if not func.is_view and name not in NO_DATA:
            self.by_op[name] += op_bytes(func, args, kwargs, out)
            self.calls += 1
        return out

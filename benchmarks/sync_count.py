"""Count the operations that synchronise a CUDA device with the host, with a
``TorchDispatchMode`` (torch only).

Counted: ``aten._local_scalar_dense`` (``.item()``, ``int()``, ``float()``, ``bool()`` of a
tensor), ``nonzero``, the ``unique`` family, boolean-mask indexing (``index`` /
``index_put_`` with a bool index, ``masked_select``: their output size needs the mask's
count), and copies between the host and another device (``_to_copy`` / ``copy_``).

On CPU the ops that would sync on CUDA are counted all the same (a host<->device copy cannot
happen there, so that kind reads 0). Not seen on CPU: ``.cpu()`` / ``.tolist()`` of a
tensor that would live on the device (on CPU they dispatch nothing). The mode is
thread-local: work on other threads is not counted.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ALWAYS = {"_local_scalar_dense", "nonzero", "masked_select"}
_UNIQUE = ("unique", "_unique")  # unique_dim, _unique2, unique_consecutive, ...
_BOOL_INDEX = {"index", "index_put", "index_put_", "_index_put_impl_"}
_COPIES = {"_to_copy", "copy_"}


def _is_bool(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _device(a: Any) -> torch.device | None:
    return a.device if isinstance(a, torch.Tensor) else None


def sync_kind(func: Any, args: tuple, kwargs: dict, out: Any) -> str | None:
    """The kind of synchronisation ``func`` would cause on CUDA, or None."""
    name = func._schema.name.split("::")[-1]
    if name in _ALWAYS:
        return name
    if name.startswith(_UNIQUE):
        return "unique"
    if name in _BOOL_INDEX and len(args) > 1:
        idx = args[1]
        if isinstance(idx, (list, tuple)) and any(_is_bool(i) for i in idx):
            return "bool_index"
    if name in _COPIES:
        src = args[1] if name == "copy_" else args[0]
        dst = args[0] if name == "copy_" else out
        a, b = _device(src), _device(dst)
        blocking = not kwargs.get("non_blocking", len(args) > 2 and args[2] is True)
        if a is not None and b is not None and (a.type == "cpu") != (b.type == "cpu"):
            # A non-blocking copy from pinned memory to the device does not wait.
            if blocking or b.type == "cpu":
                return "host_device_copy"
    return None


class SyncCounter(TorchDispatchMode):
    """``with SyncCounter() as c: ...`` then ``c.total`` / ``c.kinds`` (a Counter by kind)."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = sync_kind(func, args, kwargs, out)
        if kind is not None:
            self.kinds[kind] += 1
        return out

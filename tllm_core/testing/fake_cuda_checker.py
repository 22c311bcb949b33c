"""The rule table of :class:`~tllm_core.testing.fake_cuda.FakeCuda` and of
:mod:`tllm_core.testing.counters` (host waits: :func:`host_wait_kind`, :func:`copy_rule`;
bytes: :func:`op_bytes`), and the ``TorchDispatchMode`` that applies it to every aten
operation touching the fake device."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

# Operations that allocate without reading or writing data, or only describe shapes.
NO_DATA = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "lift_fresh",
        "_unsafe_view",
    }
)
# The rule table (the fake device's and SyncCounter's): operations whose result needs the
# device's values on the host (a Python value, or an output size that depends on them).
VALUE_SHAPED = frozenset({"nonzero", "masked_select", "equal", "bincount", "_local_scalar_dense"})
_BOOL_INDEX = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
# A 0-dim host tensor is a kernel argument for these (no copy).
_SCALAR_OK = frozenset({"fill", "fill_", "masked_fill", "masked_fill_"})
_MATMUL = frozenset({
    "mm", "bmm", "addmm", "addmv", "mv", "addbmm", "baddbmm", "dot", "vdot", "linear",
    "matmul", "_addmm_activation", "_scaled_mm", "_int_mm", "_grouped_mm",
})  # fmt: skip


def tensor_bytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if _tensor(t))


def _tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor)


def _name(func: Any) -> str:
    return func._schema.name.split("::")[-1]


def host_wait_kind(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Why ``func`` makes the host wait for a CUDA device (None: it does not): its name for
    :data:`VALUE_SHAPED`, ``unique``, ``repeat_interleave`` with tensor repeats and no
    ``output_size``, ``bool_index`` (indexing or assigning through a boolean mask)."""
    name = _name(func)
    if name in VALUE_SHAPED:
        return name
    if name.startswith(("unique", "_unique")):
        return "unique"
    if name == "repeat_interleave":  # tensor repeats: the output size is their sum
        shaped = func._overloadname != "self_int" and kwargs.get("output_size") is None
        return name if shaped else None
    if name in _BOOL_INDEX and len(args) > 1 and isinstance(args[1], (list, tuple)):
        if any(_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            return "bool_index"
    return None


def copy_rule(to_device: bool, non_blocking: bool, host_pinned: bool) -> tuple[bool, bool]:
    """``(host waits, pageable)`` for a copy between host and device: only a non-blocking
    one with pinned host memory (or to the device: staged) leaves the host free; one to the
    device from memory that is not pinned is pageable."""
    return not (non_blocking and (host_pinned or to_device)), to_device and not host_pinned


# Gathers and scatters touch the indexed elements only, not their whole source or target:
# operation -> (argument holding the indices, argument gathered from or scattered into).
SPARSE = MappingProxyType(
    {
        "index_select": (2, 0),
        "gather": (2, 0),
        "scatter": (2, 0),
        "scatter_": (2, 0),
        "scatter_add": (2, 0),
        "scatter_add_": (2, 0),
        "index_copy_": (2, 0),
        "index_copy": (2, 0),
        "index_add_": (2, 0),
        "index_fill_": (2, 0),
    }
)


def _sparse_bytes(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """A gather/scatter: the indices, and the elements of the source/target it touches."""
    idx_i, big_i = SPARSE[_name(func)]
    schema = func._schema
    n = 0
    big = args[big_i]
    for i, arg in enumerate(schema.arguments):
        if i == big_i:
            continue
        n += tensor_bytes(args[i] if i < len(args) else kwargs.get(arg.name))
    index = args[idx_i]
    rows = index.numel()
    if _name(func).startswith(("index_select", "index_copy", "index_add", "index_fill")):
        dim = args[1] if len(args) > 1 and isinstance(args[1], int) else 0
        rows = index.numel() * (big.numel() // max(1, big.shape[dim])) if big.dim() else 1
    touched = rows * big.element_size()
    # Read and written where the operation scatters into it in place; an ``out=`` argument
    # (the gathered rows, ``index_select(..., out=)``) is counted with the other operands.
    alias = schema.arguments[big_i].alias_info
    written = alias is not None and alias.is_write
    return (
        n + touched * (2 if written else 1) + sum(tensor_bytes(o) for o in fresh_outputs(func, out))
    )


def op_bytes(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Bytes ``func`` reads and writes: arguments read (but ``out=``), written ones and new
    outputs written; views and :data:`NO_DATA` nothing; gathers and scatters the elements
    they index; an overload with ``tllm_bytes(*args, **kwargs)`` what that returns."""
    if func.is_view or _name(func) in NO_DATA:
        return 0
    stated = getattr(func, "tllm_bytes", None)
    if stated is not None:  # an operator that states its own traffic (see docs/fake-cuda.md)
        return int(stated(*args, **kwargs))
    if _name(func) in SPARSE and isinstance(args[SPARSE[_name(func)][1]], torch.Tensor):
        return _sparse_bytes(func, args, kwargs, out)
    schema = func._schema
    n = 0
    for i, arg in enumerate(schema.arguments):
        size = tensor_bytes(args[i] if i < len(args) else kwargs.get(arg.name))
        written = arg.alias_info is not None and arg.alias_info.is_write
        n += size * ((not arg.is_out) + written)
    for o in fresh_outputs(func, out):
        n += tensor_bytes(o)
    return n


def fresh_outputs(func: Any, out: Any) -> list[Any]:
    """Outputs that alias no input (new storage)."""
    if func.is_view:
        return []
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o for r, o in zip(func._schema.returns, outs, strict=False) if r.alias_info is None]


def _composite(func: Any) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


class Checker(TorchDispatchMode):
    """Classifies every aten operation of the fake device (see the module docstring)."""

    def __init__(self, fc: Any) -> None:
        super().__init__()
        self.fc = fc

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fc, name = self.fc, _name(func)
        pin = bool(kwargs.get("pin_memory"))
        if pin:  # a CPU-only build has no pinned allocator: mark the host tensor instead
            kwargs = {**kwargs, "pin_memory": False}
        if getattr(fc._quiet, "on", False):
            return func(*args, **kwargs)
        if fc.computes:
            out = func(*args, **kwargs)
            if fc._capture is not None and not func.is_view and _name(func) not in NO_DATA:
                fc._capture.ops.append((func, args, kwargs, out))  # replayed into ``out``
            return out
        if _composite(func):
            # Under inference mode composite operations (``to``, ``item``...) reach the mode
            # whole: taken apart, the mode sees what they are made of.
            with self:  # the parts come back to this mode
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        leaves = [t for t in tree_leaves((args, kwargs)) if _tensor(t)]
        kernel = fc.kernels.get(func._schema.name)
        if kernel is not None and any(fc.is_fake(t) for t in leaves):
            with self:  # its checks and the launch it builds, seen as on the device
                kernel(*args, **kwargs)
        dev = kwargs.get("device")
        if not any(fc.is_fake(t) for t in leaves) and not (
            dev is not None and torch.device(dev) == fc.device
        ):
            out = func(*args, **kwargs)
            if fc.order is not None:  # the host reading or writing pinned memory
                fc.order.operation(False, func, args, kwargs, out)
            if pin:
                fc.mark_pinned(out)
            return out  # host work
        if name in {"_to_copy", "copy_"}:
            return self._copy(func, name, args, kwargs)
        if host_wait_kind(func, args, kwargs):
            out = _on_host_ones(func, args, kwargs)
            self._account(func, name, args, kwargs, out)
            # After the operation's accesses: the host waits for it too.
            fc._host_wait(f"aten.{name} (its result needs the values on the host)")
            return out
        host = [t for t in leaves if t.device.type == "cpu"]
        if any(t.dim() or not self._scalar_ok(func, name) for t in host):
            fc._flag("pageable_copy", f"aten.{name} with a host tensor argument")
        elif host and name in _SCALAR_OK:  # CUDA reads the value; meta wants a device one
            args, kwargs = tree_map(_scalar_to_meta, (args, kwargs))
        out = func(*args, **kwargs)
        self._account(func, name, args, kwargs, out)
        return out

    @staticmethod
    def _scalar_ok(func: Any, name: str) -> bool:
        return (
            torch.Tag.pointwise in func.tags or name in _SCALAR_OK or name.startswith("_foreach_")
        )

    def _copy(self, func: Any, name: str, args: tuple, kwargs: dict) -> Any:
        fc = self.fc
        src, dst = (args[1], args[0]) if name == "copy_" else (args[0], None)
        to = dst.device if dst is not None else torch.device(kwargs.get("device") or src.device)
        non_blocking = kwargs.get(
            "non_blocking", args[2] if name == "copy_" and len(args) > 2 else False
        )
        if fc.is_fake(src) and to.type == "cpu":
            fc._launch(f"aten.{name}", 2 * tensor_bytes(src))
            if fc.order is not None:
                fc.order.tensors(True, [(src, False)] + ([(dst, True)] if dst is not None else []))
            if copy_rule(False, non_blocking, dst is not None and fc.is_pinned(dst))[0]:
                fc._host_wait(f"aten.{name} device -> host")
            if dst is not None:
                return dst.fill_(1)  # what the host reads back: ones, as below
            return torch.ones(src.shape, dtype=kwargs.get("dtype") or src.dtype)
        waits = False
        if src.device.type == "cpu" and to == fc.device:
            waits, pageable = copy_rule(True, non_blocking, fc.is_pinned(src))
            if pageable:  # flagged as such, not also as a wait
                waits = False
                fc._flag("pageable_copy", f"aten.{name} host -> device from pageable memory")
        out = func(*args, **kwargs)
        self._account(func, name, args, kwargs, out)
        if waits:  # after the copy's accesses: the host waits for it
            fc._host_wait(f"aten.{name} host -> device, blocking")
        return out

    def _account(self, func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        fc = self.fc
        if fc.order is not None:
            fc.order.operation(True, func, args, kwargs, out)
        if not func.is_view and name not in NO_DATA:
            fc._launch(f"aten.{name}", op_bytes(func, args, kwargs, out))
        for o in fresh_outputs(func, out):
            for t in tree_leaves(o):
                if _tensor(t) and fc.is_fake(t):
                    fc._allocated(f"aten.{name}", t)
        if name in _MATMUL:
            fc._matmul()


def _scalar_to_meta(t: Any) -> Any:
    if _tensor(t) and t.device.type == "cpu" and t.dim() == 0:
        return torch.empty((), dtype=t.dtype, device="meta")
    return t


def _on_host_ones(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on host stand-ins of its device arguments, all ones (masks all True:
    value-dependent shapes at their maximum); tensor results go back to the device."""
    meta = torch.device("meta")

    def to_host(t: Any) -> Any:
        return torch.ones(t.shape, dtype=t.dtype) if _tensor(t) and t.device == meta else t

    host_args, host_kwargs = tree_map(to_host, args), tree_map(to_host, kwargs)
    out = func(*host_args, **host_kwargs)
    if func._schema.returns and func._schema.returns[0].alias_info is not None:
        return args[0]  # in place: the device tensor itself
    return tree_map(
        lambda t: torch.empty(t.shape, dtype=t.dtype, device=meta) if _tensor(t) else t, out
    )

"""Edits (write port ``Edit``): a consumer's plan and the buffers a tap reads (docs/ports.md)."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tllm_core.api.port_names import format_port_name, parse_port_name
from tllm_core.api.ports import ReadPort
from tllm_core.api.transfers import index_to

if TYPE_CHECKING:  # only a type here: rows needs pydantic, the taps run without it
    from tllm_core.api.rows import RowInfo

EditTarget = int | str | ReadPort


def apply_edit(
    s: torch.Tensor,
    mask: torch.Tensor,
    keep: torch.Tensor,
    add: torch.Tensor,
    direction: torch.Tensor,
) -> torch.Tensor:
    """``keep·(s − (s·u)u) + add`` on rows where ``mask`` ([n, 1] bool) is set, ``s`` bit for
    bit elsewhere. Tensor operations only: this runs inside compiled forwards."""
    edited = (s - (s * direction).sum(-1, keepdim=True) * direction) * keep + add
    return torch.where(mask, edited, s)


class EditPlan:
    """Edits a consumer asks for before this step's forward: rows index ``rows``; ``target``
    is a layer index, a port declared in an ``Edit`` write port, or its name (``"attn.3"``)."""

    def __init__(
        self,
        rows: RowInfo,
        allowed: dict[str, str],
        hidden_size: int,
        resolve_layer: Callable[[int], int] | None = None,
        transforms: set[str] = frozenset(),
        widths: dict[str, int] | None = None,
    ):
        self.rows = rows
        self._allowed = allowed  # port key -> tap key
        self._transforms = transforms  # port keys whose Edit port has a transform
        self._hidden_size = hidden_size
        self._widths = widths or {}  # port key -> width, where not the hidden size (router)
        self._resolve = resolve_layer
        # port key -> list of (row indices, kind, tensor)
        self.ops: dict[str, list[tuple[np.ndarray, str, torch.Tensor]]] = {}

    def _key(self, target: EditTarget) -> str:
        if isinstance(target, ReadPort):
            key = (target.resolve(self._resolve) if self._resolve else target).key
        else:
            name = parse_port_name(target, what="edit target")
            layer = name.layer
            if layer is not None and self._resolve:
                layer = self._resolve(layer)
            key = format_port_name(name.prefix, layer)
        if key not in self._allowed:
            raise ValueError(
                f"{key!r} was not declared as an edit port by this consumer "
                f"(declared: {sorted(self._allowed)})"
            )
        return key

    def _push(
        self, target: EditTarget, rows: np.ndarray, kind: str, value: torch.Tensor | None = None
    ) -> None:
        """Queue an edit (``value`` None: a transform) of ``rows``, checked as indices in
        ``[0, len(self.rows))`` (a negative one would wrap to a buffer row never reset)."""
        key = self._key(target)
        width = self._widths.get(key, self._hidden_size)
        if value is None and key not in self._transforms:
            raise ValueError(f"{key!r}: this consumer's Edit port declares no transform")
        if value is not None and value.shape[-1] != width:
            raise ValueError(
                f"edit vector for {key!r} has size {value.shape[-1]}, the tapped tensor's "
                f"width is {width}"
            )
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        n = len(self.rows)
        bad = rows[(rows < 0) | (rows >= n)]
        if bad.size:
            raise ValueError(
                f"edit row index {int(bad[0])} is out of range: this plan has {n} rows "
                f"(valid: 0..{n - 1})"
            )
        value = torch.empty(0) if value is None else value
        if value.dim() == 2 and value.shape[0] != rows.size:
            raise ValueError(
                f"edit values have {value.shape[0]} rows for {rows.size} selected rows"
            )
        if rows.size:
            self.ops.setdefault(key, []).append((rows, kind, value))

    def width(self, target: EditTarget) -> int:
        """The last dimension of ``target``'s values (a router's: its number of experts)."""
        return self._widths.get(self._key(target), self._hidden_size)

    def remap(self, index: np.ndarray) -> None:
        """Translate row indices of a subset of the step's rows to the step's (``index[j]``)."""
        for ops in self.ops.values():
            for i, (rows, kind, value) in enumerate(ops):
                ops[i] = (index[rows], kind, value)

    def transform(self, target: EditTarget, rows: np.ndarray) -> None:
        """Run the consumer's ``Edit(target, transform=...)`` on ``rows`` in this step."""
        self._push(target, rows, "transform")

    def add(self, target: EditTarget, rows: np.ndarray, vector: torch.Tensor) -> None:
        """Add ``vector`` (``[H]`` or ``[len(rows), H]``) to the target at ``rows``."""
        self._push(target, rows, "add", vector)

    def replace(self, target: EditTarget, rows: np.ndarray, values: torch.Tensor) -> None:
        """Replace the target at ``rows`` with ``values``."""
        self._push(target, rows, "replace", values)

    def ablate(self, target: EditTarget, rows: np.ndarray, direction: torch.Tensor) -> None:
        """Remove the component along ``direction`` (normalised) from the target at ``rows``."""
        self._push(target, rows, "ablate", direction)


KEEP = 32  # values kept per tap; the oldest goes first


class EditValues:
    """One tap's edit values moved to its buffers' device and dtype (an ablation's normalised):
    a 1-D value once, kept by identity and version; others every step (counted in ``prepared``)."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        # (id, version, ablate) -> (the tensor, kept so its id is not reused; prepared; tag;
        # a host tensor's copy to compare with)
        self._kept: dict[tuple[int, int, bool], tuple[Any, ...]] = {}
        self._tags = itertools.count(1)
        self._warned = False
        self.prepared = 0

    def get(self, value: torch.Tensor, ablate: bool) -> tuple[torch.Tensor, int]:
        """``value`` prepared, and a tag: equal tags are the same prepared value."""
        if value.dim() != 1 or value.is_inference():
            if value.device.type == "cpu" and self.device.type != "cpu" and not self._warned:
                self._warned = True
                warnings.warn(
                    f"edit values of shape {tuple(value.shape)} on the CPU are copied to "
                    f"{self.device} every step (from pageable memory: the host waits); make "
                    f"per-row edit values on the model's device",
                    stacklevel=3,
                )
            return self._prepare(value, ablate)
        key = (id(value), value._version, ablate)
        hit = self._kept.get(key)
        if hit is not None and hit[0] is value and (hit[3] is None or torch.equal(value, hit[3])):
            return hit[1], hit[2]
        if len(self._kept) >= KEEP:
            del self._kept[next(iter(self._kept))]
        prepared, tag = self._prepare(value, ablate)
        # A host vector can change without a new version (through ``.numpy()``).
        snapshot = value.clone() if value.device.type == "cpu" and prepared is not value else None
        self._kept[key] = (value, prepared, tag, snapshot)
        return prepared, tag

    def _prepare(self, value: torch.Tensor, ablate: bool) -> tuple[torch.Tensor, int]:
        self.prepared += 1
        if ablate:
            d = value.float()
            value = d / d.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return value.to(device=self.device, dtype=self.dtype), next(self._tags)


IndexTo = Callable[[np.ndarray, torch.device], torch.Tensor]


class EditBuffers:
    """Per-row edit state of one tap, read inside the forward by :func:`apply_edit` and
    written by index on the device (no host wait given the runtime's pooled ``index``)."""

    def __init__(self, max_tokens: int, width: int, dtype: torch.dtype, device: torch.device):
        self.mask = torch.zeros(max_tokens, 1, dtype=torch.bool, device=device)
        self.keep = torch.ones(max_tokens, 1, dtype=dtype, device=device)
        self.add = torch.zeros(max_tokens, width, dtype=dtype, device=device)
        self.dir = torch.zeros(max_tokens, width, dtype=dtype, device=device)
        # (owner, module, row mask) per in-graph transform on this tap, in consumer order.
        self.transforms: list[tuple[str, torch.nn.Module, torch.Tensor]] = []
        self.values = EditValues(torch.device(device), dtype)
        # Per row, the tag (EditValues) of the direction written this step; 0: none.
        self._ablated = np.zeros(max_tokens, np.int64)
        self.rows_used = 0  # rows [0, rows_used) may hold non-identity values

    def add_transform(self, owner: str, module: torch.nn.Module) -> None:
        self.transforms.append((owner, module, torch.zeros_like(self.mask)))

    def mark_used(self, rows: int) -> None:
        """Rows ``[0, rows)`` were written from outside (another rank's buffers)."""
        self.rows_used = max(self.rows_used, int(rows))

    def reset(self) -> None:
        n = self.rows_used
        if n:
            self.mask[:n].fill_(False)
            self.keep[:n].fill_(1)
            self.add[:n].zero_()
            self.dir[:n].zero_()
            for _, _, mask in self.transforms:
                mask[:n].fill_(False)
            self._ablated[:n] = 0
            self.rows_used = 0

    def check(
        self, ops: list[tuple[np.ndarray, str, torch.Tensor]], what: str, index: IndexTo = index_to
    ) -> None:
        """``ValueError`` before writing if ``ops`` ablate a second direction on a row."""
        for rows, kind, value in ops:
            if kind != "ablate":
                continue
            prior = self._ablated[rows]
            if not prior.any():
                continue
            new, tag = self.values.get(value, ablate=True)
            if not ((prior != 0) & (prior != tag)).any():
                continue  # the same direction tensor: nothing to compare
            old = self.dir.index_select(0, index(rows, self.dir.device))
            new = new if new.dim() == 2 else new.expand_as(old)
            had = old.abs().sum(-1) > 0
            if bool((had & ~torch.isclose(old, new, atol=1e-6).all(-1)).any()):
                raise ValueError(
                    f"{what}: a second, different ablation direction on a row that another "
                    f"consumer already ablates in this step (one direction per row and tap)"
                )

    def write(
        self,
        ops: list[tuple[np.ndarray, str, torch.Tensor]],
        owner: str = "",
        index: IndexTo = index_to,
    ) -> None:
        """Compose ``ops`` (one consumer's, in order) into the buffers."""
        dev = self.add.device
        for rows, kind, value in ops:
            idx = index(rows, dev)
            self.rows_used = max(self.rows_used, int(rows.max()) + 1)
            if kind == "transform":
                for name, _, mask in self.transforms:
                    if name == owner:
                        mask.index_fill_(0, idx, True)
                continue
            v, tag = self.values.get(value, ablate=kind == "ablate")
            v = v if v.dim() == 2 else v.expand(len(rows), -1)
            if kind == "add":
                self.add.index_add_(0, idx, v)
            elif kind == "replace":
                self.keep.index_fill_(0, idx, 0)
                self.dir.index_fill_(0, idx, 0)
                self.add.index_copy_(0, idx, v)
                self._ablated[rows] = 0
            elif kind == "ablate":
                self.dir.index_copy_(0, idx, v)
                self._ablated[rows] = tag
            self.mask.index_fill_(0, idx, True)

"""Forward hooks on a transformers model that capture and edit tap sites the way the engine's
taps do (``tllm_core/vllm_bridge/sites.py``): rows are the step's packed token rows, a request's
forward covering rows ``[offset, offset + n)``; edits go through the same
:func:`~tllm_core.api.edits.apply_edit` and in-graph transforms, changed rows are counted."""

from __future__ import annotations

from typing import Any

import torch

from tllm_core.api.edits import EditBuffers, apply_edit
from tllm_core.testing.hf_model import final_norm_module, site_module


class Window:
    """Which packed rows the running forward covers (set by the kit per request)."""

    def __init__(self) -> None:
        self.offset = 0
        self.rows = 0
        self.active = False  # hooks act only in the kit's own forwards (a test may call the model)


class HfTap:
    """One tap: captures into ``capture`` (``[T, width]`` for the step) and edits via ``edit``."""

    def __init__(self, key: str, width: int, dtype: torch.dtype, window: Window):
        self.key = key
        self.width = width
        self.dtype = dtype
        self.window = window
        self.capture: torch.Tensor | None = None
        self.edit: EditBuffers | None = None
        self.edited = torch.zeros(1, dtype=torch.int64)
        self.written = False

    def begin(self, total: int) -> None:
        self.capture = torch.zeros(total, self.width, dtype=self.dtype)
        self.edited.zero_()
        self.written = False

    def process(self, s: torch.Tensor) -> torch.Tensor | None:
        """``s`` ``[n, width]``: this request's rows; returns the edited tensor (None: as is)."""
        lo, n = self.window.offset, self.window.rows
        new = None
        if self.edit is not None:
            e = self.edit
            mask = e.mask[lo : lo + n]
            new = apply_edit(s, mask, e.keep[lo : lo + n], e.add[lo : lo + n], e.dir[lo : lo + n])
            for _, module, rows in e.transforms:
                rows = rows[lo : lo + n]
                new = torch.where(rows, module(new, rows), new)
                mask = mask | rows
            changed = ((new != s) & (new == new)).any(-1, keepdim=True) & mask
            self.edited += changed.sum()
            s = new
        assert self.capture is not None
        self.capture[lo : lo + n] = s.detach().to(self.dtype)
        self.written = True
        return new


def _tensor_of(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _with_tensor(out: Any, t: torch.Tensor) -> Any:
    return (t, *out[1:]) if isinstance(out, tuple) else t


def install(hf: Any, site: str, layer: int | None, tap: HfTap) -> Any:
    """Hook ``tap`` on ``site`` (``final``: the final norm's output); returns the hook handle."""
    module = final_norm_module(hf) if site == "final" else site_module(hf, site, layer or 0)

    def hook(_module: Any, _args: Any, out: Any) -> Any:
        if not tap.window.active:
            return None
        t = _tensor_of(out)  # [1, n, width]: one request per forward
        new = tap.process(t[0])
        return None if new is None else _with_tensor(out, new[None])

    return module.register_forward_hook(hook)

"""Forward hooks on a transformers model that capture and edit tap sites as the engine's taps
do, over the step's packed rows (a request's forward covers ``[offset, offset + n)``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from tllm_core.api.edits import EditBuffers, apply_edit
from tllm_core.testing.hf_model import final_norm_module, site_module


class Window:
    """Which packed rows the running forward covers (per thread: forwards may run side by
    side)."""

    def __init__(self) -> None:
        self._here = threading.local()
        self.active = False  # hooks act only in the kit's own forwards (a test may call the model)
        self.lockstep: Lockstep | None = None

    def set(self, offset: int, rows: int) -> None:
        self._here.span = (offset, rows)

    @property
    def span(self) -> tuple[int, int]:
        """``(offset, rows)`` of the forward running on this thread."""
        return getattr(self._here, "span", (0, 0))


class LockstepBroken(RuntimeError):
    """Another forward of the step failed (or was late) while this one waited at a tap."""


class Lockstep:
    """The step's forwards, one thread each, meet at every tap with a transform, which then
    runs once over all the step's rows as the engine's does (a failure breaks the meeting)."""

    def __init__(self, parties: int, timeout: float) -> None:
        self.timeout = timeout
        self._barrier = threading.Barrier(parties, action=self._run, timeout=timeout)
        self._lock = threading.Lock()
        self._parts: list[tuple[int, torch.Tensor]] = []
        self._run_on: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
        self._out: tuple[torch.Tensor, torch.Tensor] | None = None

    def meet(
        self,
        key: str,
        lo: int,
        part: torch.Tensor,
        run: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand in this forward's rows ``[lo, lo + len(part))``; ``run`` (the same for every
        party) maps the step's rows to ``(new rows, row mask)``; returns this forward's slice."""
        with self._lock:
            self._parts.append((lo, part))
            self._run_on = run
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise LockstepBroken(
                f"tap {key!r}: another request's forward of this step failed, or the step's "
                f"forwards did not all reach the tap within {self.timeout:g} s"
            ) from None
        assert self._out is not None
        new, mask = self._out
        return new[lo : lo + len(part)], mask[lo : lo + len(part)]

    def _run(self) -> None:
        parts = sorted(self._parts, key=lambda p: p[0])
        self._parts = []
        assert self._run_on is not None
        self._out = self._run_on(torch.cat([p for _, p in parts]))

    def abort(self) -> None:
        self._barrier.abort()


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
        self._count = threading.Lock()

    def begin(self, total: int) -> None:
        self.capture = torch.zeros(total, self.width, dtype=self.dtype)
        self.edited.zero_()
        self.written = False

    def process(self, s: torch.Tensor) -> torch.Tensor | None:
        """``s`` ``[n, width]``: this request's rows; returns the edited tensor (None: as is)."""
        lo, n = self.window.span
        new = None
        if self.edit is not None:
            e = self.edit
            mask = e.mask[lo : lo + n]
            new = apply_edit(s, mask, e.keep[lo : lo + n], e.add[lo : lo + n], e.dir[lo : lo + n])
            if e.transforms:
                step = self.window.lockstep
                if step is None:
                    new, mask = self._transform(new, lo, mask)
                else:
                    new, mask = step.meet(self.key, lo, new, self._transform_step)
            changed = ((new != s) & (new == new)).any(-1, keepdim=True) & mask
            with self._count:
                self.edited += changed.sum()
            s = new
        assert self.capture is not None
        self.capture[lo : lo + n] = s.detach().to(self.dtype)
        self.written = True
        return new

    def _transform(
        self, new: torch.Tensor, lo: int, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The in-graph transforms on rows ``[lo, lo + len(new))``, in consumer order."""
        assert self.edit is not None
        for _, module, rows in self.edit.transforms:
            rows = rows[lo : lo + len(new)]
            new = torch.where(rows, module(new, rows), new)
            mask = mask | rows
        return new, mask

    def _transform_step(self, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.edit is not None
        return self._transform(new, 0, self.edit.mask[: len(new)])


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

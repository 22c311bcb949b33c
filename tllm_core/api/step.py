"""What one engine step computed: the bridge fills it, the runtime and producers read it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tllm_core.api.port_names import tap_port_name
from tllm_core.api.rows import RowInfo


class StaleTapError(RuntimeError):
    """A tap's buffer was not written by this step's forward."""


@dataclass
class StepCapture:
    """One engine step: ``rows`` are all packed token rows; sampling row ``j`` is token row
    ``sample_token_row[j]``. ``tensors[tap_key]``: what a tap captured; taps in the forward set
    ``stamps[tap_key]`` to the step number in-graph, so a stale buffer is detected."""

    step: int
    rows: RowInfo
    sample_token_row: np.ndarray  # int64 [S]
    sample_kept: np.ndarray  # bool [S]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    stamps: dict[str, torch.Tensor] = field(default_factory=dict)
    # Rows each edit tap changed in this step's forward (one-element tensors, written in-graph).
    edited: dict[str, torch.Tensor] = field(default_factory=dict)
    # Static facts of taps whose tensor is not hidden-size rows (``router.{i}``: ``top_k``...).
    tap_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The stamps then edit counts from a read already queued (runtime/stamp_copies.py).
    stamp_values: Callable[[], list[int]] | None = None
    # bool [rows]: rows of requests that had stopped before this step (async scheduling still
    # ran them once); taken by no bundle (None: none)
    past_stop: np.ndarray | None = None
    _stale: set[str] | None = None
    _edited_rows: dict[str, int] = field(default_factory=dict)
    # Inside unconfirmed(): the tap keys handed out without the stamp read.
    _unconfirmed: set[str] | None = None

    @contextmanager
    def unconfirmed(self) -> Iterator[set[str]]:
        """Within the block, :meth:`tensor` hands out buffers without reading the stamps (no
        host wait before sampling) and collects their keys in the set yielded."""
        self._unconfirmed = set()
        try:
            yield self._unconfirmed
        finally:
            self._unconfirmed = None

    def written(self, keys: set[str], out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Whether this step's forward stamped every tap in ``keys``, a 0-dim device bool (None:
        no stamp); ``out``: 2 bools to compute in."""
        ok = None
        for k in sorted(keys):
            stamp = self.stamps.get(k)
            if stamp is None:
                continue
            into = None if out is None else out[0 if ok is None else 1]
            hit = torch.eq(stamp.reshape(()), self.step, out=into)  # stamps have one element
            ok = hit if ok is None else ok.logical_and_(hit)
        return ok

    def sample_rows(self) -> RowInfo:
        """RowInfo of the sampling rows, in logits order."""
        return self.rows.take(self.sample_token_row)

    @property
    def confirmed(self) -> bool:
        """Whether the stamps have been read (:meth:`confirm` itself reads nothing)."""
        return self._stale is not None

    def confirm(self) -> set[str]:
        """The stale tap keys, from one read of every stamp and edit count."""
        if self._stale is None:
            stamps, edited = list(self.stamps), list(self.edited)
            if self.stamp_values is not None:
                values = self.stamp_values()
            else:
                parts = [self.stamps[k].reshape(1) for k in stamps]
                parts += [self.edited[k].reshape(1) for k in edited]
                values = torch.cat(parts).cpu().tolist() if parts else []
            self._stale = {k for k, v in zip(stamps, values, strict=False) if v != self.step}
            self._edited_rows = dict(zip(edited, values[len(stamps) :], strict=True))
        return self._stale

    def edited_rows(self) -> dict[str, int]:
        """Rows whose tapped tensor each edit tap changed in this step's forward."""
        self.confirm()
        return {k: int(v) for k, v in self._edited_rows.items() if k not in self._stale}

    def tensor(self, key: str) -> torch.Tensor:
        """A tap's tensor for this step; ``StaleTapError`` if its forward did not write it."""
        if self._unconfirmed is not None and self._stale is None:
            self._unconfirmed.add(key)
        elif key in self.confirm():
            raise StaleTapError(
                f"the tap of {tap_port_name(key)!r} was not written by step {self.step}'s "
                f"forward (stale buffer)"
            )
        try:
            return self.tensors[key]
        except KeyError:
            raise KeyError(
                f"tap {key!r} is not captured in this step (captured: {sorted(self.tensors)})"
            ) from None

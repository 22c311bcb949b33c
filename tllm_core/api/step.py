"""What one engine step computed, in engine-neutral form: the contract between the engine
bridge (which fills it) and the runtime and producers (which read it)."""

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
    """One engine step.

    ``rows`` are all packed token rows of the step. Sampling row ``j`` (row ``j`` of the
    logits) is the last token row of the ``j``-th scheduled request, ``sample_token_row[j]``;
    its token is kept unless the request is mid-prefill (``sample_kept[j]`` False).

    ``tensors[tap_key]`` holds what a tap captured: ``[T, ...]`` for token sites, ``[S, ...]``
    for sampling sites. Taps inside the model's forward also write ``stamps[tap_key]``, a
    one-element tensor set to the step number by the traced forward itself, so a buffer
    the forward did not write this step is detected (:meth:`confirm`) instead of delivered.
    """

    step: int
    rows: RowInfo
    sample_token_row: np.ndarray  # int64 [S]
    sample_kept: np.ndarray  # bool [S]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    stamps: dict[str, torch.Tensor] = field(default_factory=dict)
    # Rows each edit tap changed in this step's forward (one-element tensors, written in-graph).
    edited: dict[str, torch.Tensor] = field(default_factory=dict)
    # Static facts of taps whose tensor is not hidden-size rows, by tap key, set by the bridge
    # at install (``router.{i}``: ``width``, ``top_k``, ``renormalize``, ``routing``).
    tap_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Where the stamps then edit counts come from when not read here: a read already
    # queued without waiting (``tllm_core.runtime.stamp_copies``), called when they are needed.
    stamp_values: Callable[[], list[int]] | None = None
    _stale: set[str] | None = None
    _edited_rows: dict[str, int] = field(default_factory=dict)
    # Inside unconfirmed(): the tap keys handed out without the stamp read.
    _unconfirmed: set[str] | None = None

    @contextmanager
    def unconfirmed(self) -> Iterator[set[str]]:
        """Within the block, :meth:`tensor` hands out buffers without reading the stamps
        (the read would make the host wait for the forward, in the sampler: before
        sampling); the keys handed out are collected in the set yielded. Check them on the
        device with :meth:`written`; :meth:`confirm` after sampling reports them."""
        self._unconfirmed = set()
        try:
            yield self._unconfirmed
        finally:
            self._unconfirmed = None

    def written(self, keys: set[str], out: torch.Tensor | None = None) -> torch.Tensor | None:
        """On the device, without a host read: whether this step's forward stamped every
        tap in ``keys`` (a 0-dim bool; None when none of them has a stamp). ``out``: a bool
        tensor of 2 elements on the stamps' device to compute in, so that nothing is
        allocated (the answer is then ``out[0]``; ``out[1]`` is scratch)."""
        ok = None
        for k in sorted(keys):
            stamp = self.stamps.get(k)
            if stamp is None:
                continue
            if out is None:
                hit = (stamp == self.step).all()
                ok = hit if ok is None else ok & hit
            else:  # one-element stamps: their only value compared
                hit = torch.eq(stamp.reshape(()), self.step, out=out[0 if ok is None else 1])
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
        """Read every stamp and edit count once (one host read, or :attr:`stamp_values`);
        returns the stale tap keys."""
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
        """A tap's tensor for this step; ``StaleTapError`` if its forward did not write it
        (inside :meth:`unconfirmed`: not checked here)."""
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

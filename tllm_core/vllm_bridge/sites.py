"""Tap sites inside the decoder: module wrappers that capture, stamp and edit one tensor.

They are installed right after ``load_model`` and before the first forward, so vLLM's
compiler traces them in. Inside traced code only tensor operations on preallocated
buffers happen (no Python side effects, no allocation that depends on host state):
values written into the edit buffers or the step clock before a step change that step's
forward without recompilation, and the same holds under CUDA graphs.

Every tap writes two proofs inside the forward: its ``stamp`` (a copy of the step clock,
so a buffer the forward did not write is detected) and, when it edits, ``edited`` (rows
whose tensor the edit changed). A new site is one :class:`Site` entry in ``SITES``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tllm_core.edits import EditBuffers, apply_edit


@dataclass
class TapBuffers:
    """What one tap writes: captured rows (optional), its stamp and edit count."""

    capture: torch.Tensor | None
    edit: EditBuffers | None
    clock: torch.Tensor  # int64 [1], shared by all taps, set by the host before each step
    stamp: torch.Tensor  # int64 [1]
    edited: torch.Tensor  # int64 [1]


class _Tap(nn.Module):
    """Wraps a module; captures (and optionally edits) one tensor of its output."""

    def __init__(self, inner: nn.Module, buffers: TapBuffers):
        super().__init__()
        self.inner = inner
        self.capture = buffers.capture
        self.edit = buffers.edit
        self.clock = buffers.clock
        self.stamp = buffers.stamp
        self.edited = buffers.edited

    def value(self, out):
        return out

    def rebuild(self, out, new: torch.Tensor, changed: torch.Tensor):
        """The module output carrying ``new`` on rows where ``changed``."""
        return new

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        s = self.value(out)
        n = s.shape[0]
        if self.edit is not None:
            e = self.edit
            mask = e.mask[:n]
            new = apply_edit(s, mask, e.keep[:n], e.add[:n], e.dir[:n])
            for _, module, rows in e.transforms:
                rows = rows[:n]
                new = torch.where(rows, module(new, rows), new)
                mask = mask | rows
            # NaN-safe "value differs" (a NaN row left as it was is not a change)
            changed = ((new != s) & (new == new)).any(-1, keepdim=True) & mask
            self.edited.copy_(changed.sum())
            out = self.rebuild(out, new, changed)
            s = new
        if self.capture is not None:
            # Copy now: on GPU the next fused add-norm overwrites these tensors in place.
            self.capture[:n].copy_(s)
        self.stamp.copy_(self.clock)
        return out


class ResidualTap(_Tap):
    """Decoder layer ``(positions, h, residual) -> (h, residual)``; the residual stream
    after the layer is ``h + residual``."""

    def value(self, out):
        h, r = out
        return h + r

    def rebuild(self, out, new, changed):
        h, r = out
        # torch.where keeps unchanged rows' h bit for bit ((h + r) - r may differ from h).
        return torch.where(changed, new - r, h), r


class OutputTap(_Tap):
    """A block whose output is one tensor (self-attention, MLP)."""


@dataclass(frozen=True)
class Site:
    """Where in decoder layer ``model.model.layers[i]`` a tap sits."""

    tap: type[_Tap]
    attribute: str | None  # child module of the layer; None: the layer itself


SITES: dict[str, Site] = {
    "residual": Site(ResidualTap, None),
    "attn": Site(OutputTap, "self_attn"),
    "mlp": Site(OutputTap, "mlp"),
}


def unwrap(module: nn.Module) -> nn.Module:
    while isinstance(module, _Tap):
        module = module.inner
    return module


def install_tap(layers: nn.ModuleList, site: str, index: int, buffers: TapBuffers) -> None:
    """Wrap the module of ``site`` in decoder layer ``index``."""
    spec = SITES[site]
    if spec.attribute is None:
        layers[index] = spec.tap(layers[index], buffers)
        return
    layer = unwrap(layers[index])
    child = getattr(layer, spec.attribute, None)
    if not isinstance(child, nn.Module):
        from tllm_core.vllm_bridge.version import UnsupportedEngineError

        raise UnsupportedEngineError(
            f"decoder layer {index} ({type(layer).__name__}) has no module "
            f"{spec.attribute!r}: tap site {site!r} is not supported for this model"
        )
    setattr(layer, spec.attribute, spec.tap(child, buffers))

"""Tap sites inside the decoder: module wrappers that capture, stamp and edit one tensor.
Traced into vLLM's compiled graph: only tensor operations on preallocated buffers, so host
writes to the edit buffers or step clock change the next forward without recompiling."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from tllm_core.api.architectures import Architectures, SiteSpec
from tllm_core.api.edits import EditBuffers, apply_edit
from tllm_core.vllm_bridge.errors import UnsupportedEngineError
from tllm_core.vllm_bridge.layouts import builtin_architectures


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
        return self.process(self.inner(*args, **kwargs))

    def process(self, out):
        """Capture (and edit) the tapped tensor of the wrapped module's output ``out``."""
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
    """Output ``(h, residual)``: the value is ``h + residual`` ("sum"), or ``h`` with
    ``stream_first`` ("first"); a bare tensor is the value itself (Granite)."""

    stream_first = False

    def value(self, out):
        if isinstance(out, torch.Tensor):
            return out
        h, r = out[0], out[1]
        return h if self.stream_first else h + r

    def rebuild(self, out, new, changed):
        if isinstance(out, torch.Tensor):
            return torch.where(changed, new, out)
        h, r = out[0], out[1]
        if self.stream_first:
            return (torch.where(changed, new, h), *out[1:])
        # torch.where keeps unchanged rows' h bit for bit ((h + r) - r may differ from h).
        return torch.where(changed, new - r, h), r


class StreamFirstResidualTap(ResidualTap):
    stream_first = True


class OutputTap(_Tap):
    """A block whose output is one tensor (self-attention, MLP)."""


class RouterTap(_Tap):
    """An MoE router gate's logits ``[tokens, experts]``, in fp32. A forward hook, not a
    wrapper: vLLM's MoE runner keeps its own reference to the gate (Qwen3-MoE)."""

    def __init__(self, gate: nn.Module, buffers: TapBuffers):
        super().__init__(None, buffers)
        gate.register_forward_hook(lambda _module, _args, out: self.process(out))

    def value(self, out):
        return (out[0] if isinstance(out, tuple) else out).float()

    def rebuild(self, out, new, changed):
        logits = out[0] if isinstance(out, tuple) else out
        new = new.to(logits.dtype)
        return (new, *out[1:]) if isinstance(out, tuple) else new


# SiteSpec.output -> the tap reading that convention
TAPS: Mapping[str, type[_Tap]] = MappingProxyType(
    {"tensor": OutputTap, "sum": ResidualTap, "first": StreamFirstResidualTap, "router": RouterTap}
)
# Names of an MoE block's router gate (gpt-oss: ``router``), beside its ``experts``.
ROUTER_GATES = ("gate", "router")


def unwrap(module: nn.Module) -> nn.Module:
    while isinstance(module, _Tap):
        module = module.inner
    return module


def _is_core_op(module: nn.Module) -> bool:
    """vLLM's attention kernels: a layer holding one directly (Jamba's ``attn``) does its
    projections itself, so that module's output is not the block's."""
    try:
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    except ImportError:  # another vLLM layout: no such check
        return False
    return isinstance(module, AttentionLayerBase)


def find_block(layer: nn.Module, spec: SiteSpec) -> tuple[str | None, str | None]:
    """``(attribute, None)`` of ``spec``'s module in ``layer``, or ``(None, why)``."""
    for name in spec.children:
        child = getattr(layer, name, None)
        if isinstance(child, nn.Module) and not _is_core_op(child):
            extra = [p for p in spec.partial_if if isinstance(getattr(layer, p, None), nn.Module)]
            if extra:
                return None, (
                    f"its {spec.label} output is {name} + {' + '.join(extra)}, added inline by "
                    f"the layer: no one module carries it"
                )
            return name, None
    children = ", ".join(n for n, _ in layer.named_children()) or "none"
    return None, (
        f"it has no {spec.label} module (looked for {', '.join(spec.children)}; "
        f"its children: {children})"
    )


def find_router(block: nn.Module) -> tuple[nn.Module | None, str | None]:
    """``(router gate, None)`` of an MoE block (``experts`` beside a gate), or ``(None, why)``."""
    block = unwrap(block)  # an ``mlp`` tap may wrap it
    gate = next(
        (g for n in ROUTER_GATES if isinstance(g := getattr(block, n, None), nn.Module)), None
    )
    if gate is not None and isinstance(getattr(block, "experts", None), nn.Module):
        return gate, None
    return None, (
        f"its {type(block).__name__} is a dense MLP, not an MoE block "
        f"(no router gate {' / '.join(ROUTER_GATES)} beside experts)"
    )


def _site_module(
    layers: nn.ModuleList, site: str, index: int, model: str | None, archs: Architectures | None
) -> tuple[SiteSpec, nn.Module, str | None]:
    """``site``'s spec at layer ``index``, the layer and the attribute holding the site's
    module (None: the layer itself); refusals name the layer, the site and why."""
    archs = archs or builtin_architectures()
    layer = unwrap(layers[index])
    of = f" of {model}" if model else ""
    spec = archs.site(site, type(layer).__name__)
    if spec is None:
        raise UnsupportedEngineError(
            f"tap site {site!r} is not defined for decoder layer {index} "
            f"({type(layer).__name__}){of}; its sites: {', '.join(archs.names())}"
        )
    if not spec.children:
        return spec, layer, None
    name, why = find_block(layer, spec)
    if name is not None and spec.output == "router":
        _gate, why = find_router(getattr(layer, name))
        name = None if why else name
    if name is None:
        raise UnsupportedEngineError(
            f"tap site {site!r} is not supported at decoder layer {index} "
            f"({type(layer).__name__}){of}: {why}"
        )
    return spec, layer, name


def tap_info(
    layers: nn.ModuleList,
    site: str,
    index: int,
    model: str | None = None,
    architectures: Architectures | None = None,
) -> dict[str, Any]:
    """What a site's tap holds unless hidden-size rows (``{}``); ``router``: ``width``,
    ``dtype``, ``top_k``, ``renormalize``, ``routing`` (``"softmax_topk"`` or the kind)."""
    spec, layer, name = _site_module(layers, site, index, model, architectures)
    if spec.output != "router":
        return {}
    block = unwrap(getattr(layer, name))
    gate, _why = find_router(block)
    router = getattr(block.experts, "router", None)
    scoring = getattr(router, "scoring_func", None)
    plain = (
        scoring == "softmax"
        and not getattr(router, "use_grouped_topk", False)
        and getattr(router, "custom_routing_function", None) is None
        and getattr(router, "e_score_correction_bias", None) is None
    )
    width = getattr(gate, "output_size", None) or getattr(gate, "out_features", None)
    return {
        "width": int(width if width is not None else gate.weight.shape[0]),
        "dtype": torch.float32,
        "top_k": getattr(router, "top_k", None),
        "renormalize": bool(getattr(router, "renormalize", False)),
        "routing": "softmax_topk" if plain else f"{type(router).__name__} ({scoring})",
    }


def install_tap(
    layers: nn.ModuleList,
    site: str,
    index: int,
    buffers: TapBuffers,
    model: str | None = None,
    architectures: Architectures | None = None,
) -> None:
    """Wrap ``site``'s module in decoder layer ``index`` (a router: hook its gate)."""
    spec, layer, name = _site_module(layers, site, index, model, architectures)
    tap = TAPS[spec.output]
    if name is None:
        layers[index] = tap(layers[index], buffers)
    elif tap is RouterTap:
        RouterTap(find_router(getattr(layer, name))[0], buffers)
    else:
        setattr(layer, name, tap(getattr(layer, name), buffers))


def _at(root: nn.Module, path: str) -> object:
    for part in path.split("."):
        root = getattr(root, part, None)
    return root


def find_layers(model: nn.Module, num_layers: int, architectures: Architectures) -> nn.ModuleList:
    """The ``ModuleList`` of decoder layers: at a registered spec's ``layers`` path, else the
    shallowest list of ``num_layers`` modules."""
    for spec, path in architectures.layer_paths():
        found = _at(model, path)
        if (
            isinstance(found, nn.ModuleList)
            and len(found)
            and (not spec.layer_classes or type(unwrap(found[0])).__name__ in spec.layer_classes)
        ):
            return found
    lists = [
        (name.count("."), name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) == num_layers
    ]
    if not lists:
        tried = ", ".join(p for _, p in architectures.layer_paths()) or "no path"
        raise UnsupportedEngineError(
            f"tllm cannot find the decoder layers of {type(model).__name__}: nothing at "
            f"{tried} and no ModuleList of {num_layers} layers; supported decoder families: "
            f"docs/architectures.md (a plugin describes another through tllm_architectures)"
        )
    return min(lists, key=lambda t: t[:2])[2]

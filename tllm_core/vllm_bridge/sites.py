"""Tap sites inside the decoder: module wrappers that capture, stamp and edit one tensor.

They are installed right after ``load_model`` and before the first forward, so vLLM's
compiler traces them in. Inside traced code only tensor operations on preallocated
buffers happen (no Python side effects, no allocation that depends on host state):
values written into the edit buffers or the step clock before a step change that step's
forward without recompilation, and the same holds under CUDA graphs.

Every tap writes two proofs inside the forward: its ``stamp`` (a copy of the step clock,
so a buffer the forward did not write is detected) and, when it edits, ``edited`` (rows
whose tensor the edit changed). A new site is one :class:`Site` entry in ``SITES``; a site
whose tensor is not hidden-size wide (``router``) says so in :func:`tap_info`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    """Decoder layer ``(positions, h, residual) -> (h, residual)``; the residual stream
    after the layer is ``h + residual`` (Llama-style: the next layer's fused add-norm adds
    them). Two other conventions exist in vLLM's models, seen in the layer's output:

    - a single tensor (Granite): the stream itself;
    - ``stream_first`` (layer classes in :data:`STREAM_FIRST_LAYERS`): ``h`` already is the
      stream and ``residual`` is an intermediate the next layer ignores.
    """

    stream_first = False

    def value(self, out):
        if isinstance(out, torch.Tensor):
            return out
        h, r = out
        return h if self.stream_first else h + r

    def rebuild(self, out, new, changed):
        if isinstance(out, torch.Tensor):
            return torch.where(changed, new, out)
        h, r = out
        if self.stream_first:
            return torch.where(changed, new, h), r
        # torch.where keeps unchanged rows' h bit for bit ((h + r) - r may differ from h).
        return torch.where(changed, new - r, h), r


class StreamFirstResidualTap(ResidualTap):
    stream_first = True


# Decoder layers returning ``(stream, residual)`` whose first element already includes the
# residual (``hidden_states = residual + block(...)``) and whose model applies the final norm
# to that element alone: ``h + residual`` would count the residual twice. GraniteMoeHybrid is
# checked by tests/test_arch_matrix.py; the others are from reading vLLM 0.32's model files.
STREAM_FIRST_LAYERS = frozenset(
    {
        "GraniteMoeHybridAttentionDecoderLayer",
        "GraniteMoeHybridMambaDecoderLayer",
        "CohereDecoderLayer",
        "Cohere2MoeDecoderLayer",
        "CohereCompassDecoderLayer",
        "Exaone4DecoderLayer",
        "HyperCLOVAXDecoderLayer",
        "MuseGlimmerDecoderLayer",
        "PhiMoEDecoderLayer",
        "StablelmDecoderLayer",
    }
)


class OutputTap(_Tap):
    """A block whose output is one tensor (self-attention, MLP)."""


class RouterTap(_Tap):
    """An MoE block's router gate ``x -> logits`` (vLLM's linear layers: ``(logits, bias)``):
    router logits ``[tokens, experts]`` before softmax and top-k, captured and edited in fp32
    and handed on in the gate's dtype.

    Installed as a forward hook on the gate module, not as a wrapper: vLLM's MoE runner keeps
    its own reference to the gate (Qwen3-MoE: ``experts.gate``, called inside the runner)
    besides the block's (OLMoE calls ``self.gate`` itself), and a hook sees every call."""

    def __init__(self, gate: nn.Module, buffers: TapBuffers):
        super().__init__(None, buffers)
        gate.register_forward_hook(lambda _module, _args, out: self.process(out))

    def value(self, out):
        return (out[0] if isinstance(out, tuple) else out).float()

    def rebuild(self, out, new, changed):
        logits = out[0] if isinstance(out, tuple) else out
        new = new.to(logits.dtype)
        return (new, *out[1:]) if isinstance(out, tuple) else new


@dataclass(frozen=True)
class Site:
    """Where in decoder layer ``model.model.layers[i]`` a tap sits."""

    tap: type[_Tap]
    # Child modules of the layer that carry the block's output, tried in order (families name
    # them differently: gpt-oss ``attn``, Jamba ``feed_forward``, Granite-MoE
    # ``block_sparse_moe``); empty: the layer itself.
    attributes: tuple[str, ...] = ()
    what: str = "decoder layer"
    # Sibling modules whose output the layer adds to the block's inline: with one present the
    # block's module carries only part of the site's value, so the site is refused.
    partial_if: tuple[str, ...] = ()


SITES: dict[str, Site] = {
    "residual": Site(ResidualTap),
    "attn": Site(OutputTap, ("self_attn", "attn", "self_attention"), "self-attention block"),
    "mlp": Site(
        OutputTap,
        ("mlp", "feed_forward", "block_sparse_moe"),
        "MLP / MoE block",
        ("shared_mlp", "shared_expert", "shared_experts"),
    ),
    # The gate's module inside the MoE block (one of ``attributes``): see find_router.
    "router": Site(RouterTap, ("mlp", "feed_forward", "block_sparse_moe"), "MoE router"),
}
# Names of an MoE block's router gate (gpt-oss: ``router``), beside its ``experts``.
ROUTER_GATES = ("gate", "router")


def unwrap(module: nn.Module) -> nn.Module:
    while isinstance(module, _Tap):
        module = module.inner
    return module


def _is_core_op(module: nn.Module) -> bool:
    """vLLM's attention / Mamba kernels (``Attention``, ``MLAAttention``, mixers): a layer
    that holds one directly (Jamba's ``attn``) does its projections itself, so the module's
    output is not the block's output."""
    try:
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    except ImportError:  # another vLLM layout: no such check
        return False
    return isinstance(module, AttentionLayerBase)


def find_block(layer: nn.Module, site: str) -> tuple[str | None, str | None]:
    """``(attribute, None)`` of ``site``'s module in ``layer``, or ``(None, why)``."""
    spec = SITES[site]
    for name in spec.attributes:
        child = getattr(layer, name, None)
        if isinstance(child, nn.Module) and not _is_core_op(child):
            extra = [p for p in spec.partial_if if isinstance(getattr(layer, p, None), nn.Module)]
            if extra:
                return None, (
                    f"its {spec.what} output is {name} + {' + '.join(extra)}, added inline by "
                    f"the layer: no one module carries it"
                )
            return name, None
    children = ", ".join(n for n, _ in layer.named_children()) or "none"
    return None, (
        f"it has no {spec.what} module (looked for {', '.join(spec.attributes)}; "
        f"its children: {children})"
    )


def find_router(layer: nn.Module) -> tuple[nn.Module | None, nn.Module | None, str | None]:
    """``(MoE block, its router gate, None)`` of a decoder layer, or ``(None, None, why)``."""
    for name in SITES["router"].attributes:
        block = getattr(layer, name, None)
        if not isinstance(block, nn.Module):
            continue
        block = unwrap(block)  # an ``mlp`` tap may wrap it
        gate = next(
            (g for n in ROUTER_GATES if isinstance(g := getattr(block, n, None), nn.Module)), None
        )
        if gate is not None and isinstance(getattr(block, "experts", None), nn.Module):
            return block, gate, None
        why = (
            f"its {name} ({type(block).__name__}) is a dense MLP, not an MoE block "
            f"(no router gate {' / '.join(ROUTER_GATES)} beside experts)"
        )
        return None, None, why
    looked = ", ".join(SITES["router"].attributes)
    return None, None, f"it has no MLP / MoE block (looked for {looked})"


def _refuse(site: str, index: int, layer: nn.Module, model: str | None, why: str):
    from tllm_core.vllm_bridge.errors import UnsupportedEngineError

    of = f" of {model}" if model else ""
    return UnsupportedEngineError(
        f"tap site {site!r} is not supported at decoder layer {index} "
        f"({type(layer).__name__}){of}: {why}"
    )


def tap_info(
    layers: nn.ModuleList, site: str, index: int, model: str | None = None
) -> dict[str, Any]:
    """What a site's tap holds besides hidden-size rows, read once before it is installed;
    ``{}`` for sites whose tensor has the model's hidden size and dtype. ``router``: ``width``
    (experts) and ``dtype`` (fp32) of its buffers, and how vLLM's router turns the logits into
    experts (``top_k``, ``renormalize``, ``routing``: ``"softmax_topk"`` for softmax then top-k,
    else the router's kind), so that the chosen experts can be computed from the logits."""
    if site != "router":
        return {}
    layer = unwrap(layers[index])
    block, gate, why = find_router(layer)
    if gate is None:
        raise _refuse(site, index, layer, model, why)
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
    layers: nn.ModuleList, site: str, index: int, buffers: TapBuffers, model: str | None = None
) -> None:
    """Wrap the module of ``site`` in decoder layer ``index``; ``model`` (the model class
    name) only makes the error clearer."""
    spec = SITES[site]
    tap = spec.tap
    layer = unwrap(layers[index])
    if not spec.attributes:
        if tap is ResidualTap and type(layer).__name__ in STREAM_FIRST_LAYERS:
            tap = StreamFirstResidualTap
        layers[index] = tap(layers[index], buffers)
        return
    if tap is RouterTap:
        _block, gate, why = find_router(layer)
        if gate is None:
            raise _refuse(site, index, layer, model, why)
        RouterTap(gate, buffers)
        return
    name, why = find_block(layer, site)
    if name is None:
        raise _refuse(site, index, layer, model, why)
    setattr(layer, name, spec.tap(getattr(layer, name), buffers))

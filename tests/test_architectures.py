"""Architecture specs (tllm_core/api/architectures.py) and the bridge's use of them, on stand-in
modules (no engine): merging, a family's own site variant, the layer list found at a path
or by shape, and a plugin's site wrapped, read and edited."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tllm_core.api.architectures import Architectures, ArchitectureSpec, SiteSpec
from tllm_core.vllm_bridge.errors import UnsupportedEngineError
from tllm_core.vllm_bridge.layouts import ARCHITECTURES, builtin_architectures
from tllm_core.vllm_bridge.sites import TapBuffers, find_layers, install_tap

NORM = SiteSpec("post_norm", ("post_attention_layernorm",), output="first")


def test_specs_merge_and_name_conflicts():
    archs = Architectures([*ARCHITECTURES, NORM])
    assert archs.names() == ["attn", "mlp", "post_norm", "residual", "router"]
    # a family's own variant of a site wins at its layer classes only
    assert archs.site("residual", "CohereDecoderLayer").output == "first"
    assert archs.site("residual", "LlamaDecoderLayer").output == "sum"
    with pytest.raises(ValueError, match="site 'attn' is defined twice: by architecture "):
        archs.add(SiteSpec("attn", ("attn",)), "plugin 'x'")
    with pytest.raises(ValueError, match="two default architectures"):
        archs.add(ArchitectureSpec("mine"))
    with pytest.raises(ValueError, match="'CohereDecoderLayer' is described twice"):
        archs.add(ArchitectureSpec("mine", frozenset({"CohereDecoderLayer"})))
    with pytest.raises(ValueError, match=r"unknown tap site 'nope'; the registered sites are "):
        archs.check_site("nope")
    archs.check_site("logits")  # per-step sites need no spec


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "final"}, "taken by a per-step site"),
        ({"name": "x", "output": "pair"}, "output 'pair' is not one of tensor, sum, first"),
        ({"name": "x-y"}, "must be a Python identifier, got 'x-y'"),
        ({"name": "x", "children": ("a.b",)}, "child module name must be a Python identifier"),
    ],
)
def test_bad_site_spec_names_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SiteSpec(**kwargs)


def test_a_plugin_site_conflict_skips_that_plugin(recwarn):
    from tllm_core import hookimpl
    from tllm_core.plugins.registry import Registry

    class Plugin:
        @hookimpl
        def tllm_architectures(self):
            return [SiteSpec("mlp", ("ffn",))]

    reg = Registry()
    before = reg.architectures.names()
    with pytest.raises(ValueError, match="site 'mlp' is defined twice.*plugin 'clash'"):
        reg.register(Plugin(), "clash")
    assert reg.architectures.names() == before and not reg.pm.has_plugin("clash")


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.post_attention_layernorm = _AddNorm()

    def forward(self, h, r):
        return self.post_attention_layernorm(h, r)


class _AddNorm(nn.Module):
    def forward(self, h, r):
        s = h + r
        return s * 2, s


def _buffers(n: int, width: int) -> TapBuffers:
    from tllm_core.api.edits import EditBuffers

    one = torch.zeros(1, dtype=torch.long)
    edit = EditBuffers(n, width, torch.float32, torch.device("cpu"))
    return TapBuffers(torch.zeros(n, width), edit, one, one.clone(), one.clone())


def test_plugin_site_on_a_child_reads_and_edits_the_first_output():
    archs = Architectures([*ARCHITECTURES, NORM])
    layers = nn.ModuleList([_Layer()])
    buffers = _buffers(3, 2)
    install_tap(layers, "post_norm", 0, buffers, architectures=archs)
    h, r = torch.randn(3, 2), torch.randn(3, 2)
    buffers.edit.mask[:1] = True
    buffers.edit.add[:1] = 1.0
    normed, resid = layers[0](h, r)
    want = (h + r) * 2
    want[0] += 1.0
    torch.testing.assert_close(normed, want)
    torch.testing.assert_close(buffers.capture, want)
    torch.testing.assert_close(resid, h + r)  # the rest of the output passes through
    assert int(buffers.edited) == 1
    with pytest.raises(UnsupportedEngineError, match="not defined for decoder layer 0"):
        install_tap(layers, "post_norm", 0, _buffers(3, 2))  # the built-ins lack it


class _Model(nn.Module):
    def __init__(self, where: str):
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.blocks = nn.ModuleList([nn.Linear(1, 1) for _ in range(2)])
        body = nn.Module()
        body.h = nn.ModuleList([nn.Linear(1, 1) for _ in range(3)])
        setattr(self, where, body)


def test_layers_at_a_spec_path_else_by_shape():
    model = _Model("transformer")  # no model.layers: found by shape (3 layers, not 2)
    assert find_layers(model, 3, builtin_architectures()) is model.transformer.h
    spec = ArchitectureSpec("mine", frozenset({"Linear"}), layers="encoder.blocks")
    assert find_layers(model, 3, Architectures([*ARCHITECTURES, spec])) is model.encoder.blocks
    with pytest.raises(UnsupportedEngineError, match="no ModuleList of 5 layers"):
        find_layers(model, 5, builtin_architectures())

"""Third-party ports and their producers, as a separate package would ship them:

- ``rnorm.{i}``: the L2 norm of the residual stream after a layer; it needs no new engine tap
  (it reads the bridge's ``residual`` site);
- ``postnorm.{i}``: the output of a decoder layer's ``post_attention_layernorm`` (the MLP's
  input), a tap site this plugin adds through the ``tllm_architectures`` hook; readable and
  editable like a built-in site.

The whole of it is this file plus an entry point; nothing under ``tllm_core/`` names it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from tllm_core import (
    Consumer,
    ConsumerConfig,
    Edit,
    HiddenStates,
    LayerPort,
    Phase,
    Producer,
    SiteSpec,
    TapRequest,
    hookimpl,
)
from tllm_test_recorder import active

# vLLM's Llama-style layers call ``post_attention_layernorm(h, residual)``, a fused add-norm
# returning ``(norm(h + residual), h + residual)``: the site's value is the first element.
POST_NORM = SiteSpec(
    "post_norm", ("post_attention_layernorm",), output="first", what="post-attention norm"
)


class ResidualNorm(LayerPort):
    """``[rows, 1]``: L2 norm of the residual stream after ``layer``; key ``rnorm.{i}``."""

    prefix = "rnorm"


class ResidualNormProducer(Producer):
    name = "residual-norm"
    ports = (ResidualNorm,)

    def taps(self, port):
        return [TapRequest("residual", port.layer)]

    def read(self, port, step):
        return step.tensor(f"residual.{port.layer}").float().norm(dim=-1, keepdim=True)


class NormRecorder(Consumer):
    name = "normrec"
    description = "Test consumer: records the rnorm port (a third-party producer) per position."

    def __init__(self, config, context):
        super().__init__(config, context)
        self.norms: dict[str, dict[int, float]] = defaultdict(dict)

    def reads(self):
        return [ResidualNorm(-1)]

    def on_bundle(self, bundle):
        (key,) = bundle.hidden
        values = bundle.hidden[key][:, 0].tolist()
        for req, pos, v in zip(bundle.rows.requests, bundle.rows.position, values, strict=True):
            self.norms[f"{req.request_id}/{req.sample_index}"][int(pos)] = v
        self.counters.add("rows", len(values))

    def result(self):
        return {"key": f"rnorm.{self.context.model.num_layers - 1}", "norms": self.norms}


@dataclass(frozen=True)
class PostNorm(LayerPort):
    """``[rows, hidden]``: the post-attention norm's output in ``layer``; key
    ``postnorm.{i}``. (Declared as a dataclass with its fields, as ports were before
    ``LayerPort`` was one: that form still works.)"""

    layer: int
    phase: Phase = Phase.ALL
    prefix = "postnorm"


class PostNormProducer(Producer):
    name = "post-norm"
    ports = (PostNorm,)

    def taps(self, port):
        return [TapRequest(POST_NORM.name, port.layer)]


class SiteRecorderConfig(ConsumerConfig):
    layer: int = 1
    add: float = 0.0  # added to every element of the site's tensor for prompt 1's rows


class SiteRecorder(Consumer):
    name = "siterec"
    description = "Test consumer: records (and edits) the postnorm port of a plugin's site."
    Config = SiteRecorderConfig

    def __init__(self, config, context):
        super().__init__(config, context)
        self.values: dict[str, dict[int, dict[str, list[float]]]] = defaultdict(dict)

    def reads(self):
        return [PostNorm(self.config.layer), HiddenStates(-1)]

    def writes(self):
        return [Edit(PostNorm(self.config.layer))] if self.config.add else []

    def edit(self, rows, plan):
        idx = (rows.prompt_index == 1).nonzero()[0]
        if len(idx):
            vec = torch.full((self.context.model.hidden_size,), self.config.add)
            plan.add(PostNorm(self.config.layer), idx, vec)

    def on_bundle(self, bundle):
        data = {k: v.float().tolist() for k, v in bundle.hidden.items()}
        rows = zip(bundle.rows.requests, bundle.rows.position, strict=True)
        for i, (req, pos) in enumerate(rows):
            row = self.values[f"{req.request_id}/{req.sample_index}"].setdefault(int(pos), {})
            row.update({k: v[i] for k, v in data.items()})

    def result(self):
        return {"values": self.values}


@hookimpl
def tllm_architectures():
    return [POST_NORM] if active() else []


@hookimpl
def tllm_producers():
    return [ResidualNormProducer, PostNormProducer] if active() else []


@hookimpl
def tllm_consumers():
    return [NormRecorder, SiteRecorder] if active() else []

"""A third-party port and its producer: the L2 norm of the residual stream after a layer.

It needs no new engine tap (it reads the bridge's ``residual`` site), so the whole port is
this file plus an entry point; nothing under ``tllm_core/`` names it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from tllm_core import Consumer, LayerPort, Phase, Producer, TapRequest, hookimpl


@dataclass(frozen=True)
class ResidualNorm(LayerPort):
    """``[rows, 1]``: L2 norm of the residual stream after ``layer``; key ``rnorm.{i}``."""

    layer: int
    phase: Phase = Phase.ALL
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


@hookimpl
def tllm_producers():
    return [ResidualNormProducer]


@hookimpl
def tllm_consumers():
    return [NormRecorder]

"""Registers the built-in producers through the ``tllm_producers`` hook."""

from __future__ import annotations

from tllm_core import hookimpl


@hookimpl
def tllm_producers() -> list[type]:
    from producers.attention import AttentionProducer
    from producers.mlp import MlpProducer
    from producers.residual import ResidualProducer
    from producers.router import RouterProducer
    from producers.sampler import SamplerProducer

    return [ResidualProducer, SamplerProducer, AttentionProducer, MlpProducer, RouterProducer]

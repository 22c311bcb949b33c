"""``AttentionOutput``: a decoder layer's self-attention output, before the residual add."""

from __future__ import annotations

from tllm_core import LayerPort, LayerProducer


class AttentionOutput(LayerPort):
    """Self-attention output of decoder layer ``layer`` (``"attn.{i}"``; negative counts from
    the end); editable through ``Edit(AttentionOutput(i))``."""

    prefix = "attn"


class AttentionProducer(LayerProducer):
    name = "attention"
    ports = (AttentionOutput,)

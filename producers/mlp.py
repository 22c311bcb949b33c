"""``MlpOutput``: a decoder layer's MLP block output, before the residual add."""

from __future__ import annotations

from tllm_core import LayerPort, LayerProducer


class MlpOutput(LayerPort):
    """MLP output of decoder layer ``layer`` (``"mlp.{i}"``; negative counts from the end);
    editable through ``Edit(MlpOutput(i))``."""

    prefix = "mlp"


class MlpProducer(LayerProducer):
    name = "mlp"
    ports = (MlpOutput,)

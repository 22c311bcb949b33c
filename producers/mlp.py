"""``MlpOutput``: a decoder layer's MLP block output (before it is added to the residual
stream)."""

from __future__ import annotations

from dataclasses import dataclass

from tllm_core import LayerPort, LayerProducer, Phase


@dataclass(frozen=True)
class MlpOutput(LayerPort):
    """MLP output of decoder layer ``layer`` (negative counts from the end).

    Bundle key: ``"mlp.{absolute index}"``. Editable through ``Edit(MlpOutput(i))``.
    """

    layer: int
    phase: Phase = Phase.ALL
    prefix = "mlp"


class MlpProducer(LayerProducer):
    name = "mlp"
    ports = (MlpOutput,)

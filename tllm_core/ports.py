"""Port specs: what a consumer reads from, and writes into, a running engine.

A consumer declares its ports once, at construction; the runtime sizes capture
buffers and wraps decoder layers from these declarations before the model is
compiled, so nothing about them can change mid-run.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal

FINAL = "final"


class Phase(str, Enum):
    """Which token rows a read port selects.

    ``PREFILL`` rows feed a prompt token; ``DECODE`` rows feed a generated token.
    """

    PREFILL = "prefill"
    DECODE = "decode"
    ALL = "all"

    def selects(self, is_decode: bool) -> bool:
        return self is Phase.ALL or (self is Phase.DECODE) == is_decode


class Delivery(str, Enum):
    """When a consumer receives its bundles.

    ``END_OF_STEP``: on the engine thread after sampling, tensors still on the
    device (valid only during the call). ``BACKGROUND``: host copies handed to
    a worker thread through a bounded queue (see ``overflow``).
    """

    END_OF_STEP = "end_of_step"
    BACKGROUND = "background"


LayerSpec = int | Literal["final"]


@dataclass(frozen=True)
class HiddenStates:
    """Residual stream after decoder layer ``layer`` (negative counts from the end),
    or the final hidden state (``layer="final"``: after the final norm, the LM head's input).

    Bundle key: ``"layer.{absolute index}"`` or ``"final"``.
    """

    layer: LayerSpec
    phase: Phase = Phase.ALL


@dataclass(frozen=True)
class Logits:
    """Raw model logits of the rows that sample a token (before processors/temperature)."""

    phase: Phase = Phase.ALL


@dataclass(frozen=True)
class SampledTokens:
    """The token id sampled for each sampling row."""

    phase: Phase = Phase.ALL


ReadPort = HiddenStates | Logits | SampledTokens


@dataclass(frozen=True)
class ResidualEdit:
    """Write port: edit the residual stream after decoder layer ``layer`` for rows the
    consumer selects in :meth:`Consumer.edit`. Unselected rows are untouched bit for bit."""

    layer: int


@dataclass(frozen=True)
class SamplerGuide:
    """Write port: change the logits of the candidates that survive top-k/top-p/min-p,
    for rows the consumer selects in :meth:`Consumer.guide`, in the same step."""


WritePort = ResidualEdit | SamplerGuide


def layer_key(layer: int | str) -> str:
    """Bundle key for an absolute layer index or ``"final"``."""
    return FINAL if layer == FINAL else f"layer.{int(layer)}"


def parse_layer_spec(text: str) -> LayerSpec:
    """``"final"`` or an integer (negative allowed). Raises ``ValueError`` naming the bad value."""
    text = text.strip()
    if text == FINAL:
        return FINAL
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"bad layer spec {text!r}: expected an integer layer index (negative counts "
            f"from the end) or 'final'"
        ) from None


def resolve_layer(layer: int, num_layers: int) -> int:
    """Absolute index for ``layer``; raises ``ValueError`` naming the model's layer count."""
    idx = layer + num_layers if layer < 0 else layer
    if not 0 <= idx < num_layers:
        raise ValueError(
            f"layer index {layer} is out of range: the model has {num_layers} decoder layers "
            f"(valid: {-num_layers}..{num_layers - 1}, or 'final')"
        )
    return idx

"""``HiddenStates``: the residual stream after a decoder layer, or the final hidden state."""

from __future__ import annotations

from tllm_core import FINAL, HiddenStates, Producer, TapRequest


class ResidualProducer(Producer):
    name = "residual"
    ports = (HiddenStates,)

    def taps(self, port: HiddenStates) -> list[TapRequest]:
        if port.layer == FINAL:
            return [TapRequest("final")]
        return [TapRequest("residual", int(port.layer))]

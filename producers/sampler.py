"""``Logits`` and ``SampledTokens``: what the sampler saw and chose, per sampling row."""

from __future__ import annotations

from tllm_core import Logits, Producer, ReadPort, SampledTokens, TapRequest


class SamplerProducer(Producer):
    name = "sampler"
    ports = (Logits, SampledTokens)

    def taps(self, port: ReadPort) -> list[TapRequest]:
        return [TapRequest("logits" if isinstance(port, Logits) else "sampled")]

"""A third-party consumer, as a separate package would ship it: records every row it sees."""

from __future__ import annotations

import os

from pydantic import Field

from tllm_core import Bundle, Consumer, ConsumerConfig, HiddenStates, Phase, SampledTokens, hookimpl


class RecorderConfig(ConsumerConfig):
    layers: list[int | str] = Field(default_factory=lambda: [0, "final"])
    phase: Phase = Phase.ALL
    keep_hidden: bool = True


class Recorder(Consumer):
    name = "recorder"
    description = "Test consumer: records row metadata, hidden states and sampled tokens."
    Config = RecorderConfig

    def __init__(self, config, context):
        super().__init__(config, context)
        self.rows: list[dict] = []
        self.sampled: list[dict] = []
        self.finished: list[str] = []

    def reads(self):
        ports = [HiddenStates(layer, self.config.phase) for layer in self.config.layers]
        return ports + [SampledTokens(Phase.ALL)]

    def on_bundle(self, bundle: Bundle) -> None:
        r = bundle.rows
        tok = r.token_ids.tolist()
        hidden = (
            {k: v.float().tolist() for k, v in bundle.hidden.items()}
            if self.config.keep_hidden
            else {}
        )
        for i, req in enumerate(r.requests):
            self.rows.append(
                {
                    "step": bundle.step,
                    "request_id": req.request_id,
                    "prompt_index": req.prompt_index,
                    "sample_index": req.sample_index,
                    "position": int(r.position[i]),
                    "is_decode": bool(r.is_decode[i]),
                    "recomputed": bool(r.recomputed[i]),
                    "token_id": tok[i],
                    "hidden": {k: v[i] for k, v in hidden.items()},
                }
            )
        if bundle.sampled_rows is not None and bundle.sampled_token_ids is not None:
            s = bundle.sampled_rows
            for i, t in enumerate(bundle.sampled_token_ids.tolist()):
                req = s.requests[i]
                self.sampled.append(
                    {
                        "request_id": req.request_id,
                        "sample_index": req.sample_index,
                        "position": int(s.position[i]),
                        "token_id": t,
                    }
                )
        self.counters.add("rows", len(r))

    def on_request_finished(self, request) -> None:
        self.finished.append(f"{request.request_id}/{request.sample_index}")

    def result(self):
        return {
            "pid": os.getpid(),
            "rows": self.rows,
            "sampled": self.sampled,
            "finished": self.finished,
        }


class Crasher(Consumer):
    name = "crasher"
    description = "Test consumer: raises on its Nth bundle."

    class Config(ConsumerConfig):
        after: int = 2

    def reads(self):
        return [HiddenStates(0, Phase.DECODE)]

    def on_bundle(self, bundle):
        self.counters.add("bundles")
        if self.counters.get("bundles") >= self.config.after:
            raise RuntimeError("crasher: deliberate failure")


@hookimpl
def tllm_consumers():
    return [Recorder, Crasher]

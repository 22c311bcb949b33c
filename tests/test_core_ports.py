"""Unit tests of the opened core: port/producer plugins, step stamps, edit math and order.

A test double of the step (a fake tap that writes or does not write its stamp) shows that
the runtime only delivers and counts what the forward really wrote.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from tllm_core import (
    Consumer,
    ConsumerConfig,
    Edit,
    GuideView,
    HiddenStates,
    LayerPort,
    Phase,
    Producer,
    RequestSettings,
    ResidualEdit,
    SampledTokens,
    TapRequest,
    WindowSetting,
    hookimpl,
)
from tllm_core.api.consumer import ModelInfo
from tllm_core.api.edits import EditBuffers, EditPlan, apply_edit
from tllm_core.api.port_names import PortName, format_port_name, parse_port_name, tap_port_name
from tllm_core.api.rows import RequestInfo, StepLayout, layout_rows
from tllm_core.api.step import StepCapture
from tllm_core.plugins.registry import Registry
from tllm_core.runtime.runtime import Runtime

if TYPE_CHECKING:
    from tllm_core.testing.fake_cuda import FakeCuda
from tllm_core.runtime.settings import RuntimeSettings
from tllm_core.vllm_bridge.sites import OutputTap, ResidualTap, TapBuffers

H = 4


# -- a third-party port and producer, registered at run time ----------------------------
class DoubledResidual(LayerPort):
    """Test port: twice the residual stream after a layer (reads the residual tap)."""

    prefix = "twice"


class DoubledProducer(Producer):
    name = "doubled"
    ports = (DoubledResidual,)

    def taps(self, port):
        return [TapRequest("residual", port.layer)]

    def read(self, port, step):
        return 2 * step.tensor(f"residual.{port.layer}")


class Reader(Consumer):
    name = "reader"

    def __init__(self, config, context):
        super().__init__(config, context)
        self.bundles = []

    def reads(self):
        return [DoubledResidual(-1), HiddenStates(0, Phase.DECODE), SampledTokens()]

    def on_bundle(self, bundle):
        self.bundles.append(bundle)


class LastReader(Consumer):
    name = "lastreader"

    def __init__(self, config, context):
        super().__init__(config, context)
        self.bundles = []

    def reads(self):
        return [HiddenStates(0, "last"), HiddenStates(1, "last")]

    def on_bundle(self, bundle):
        self.bundles.append(bundle)


class WindowReader(LastReader):
    """Every row of layer 0, narrowed by each request's ``tllm_windowreader_window``."""

    name = "windowreader"

    class Request(RequestSettings):
        window: WindowSetting = None

    def reads(self):
        return [HiddenStates(0)]


class Adder(Consumer):
    name = "adder"

    class Config(ConsumerConfig):
        value: float = 1.0
        replace: bool = False

    def writes(self):
        return [ResidualEdit(1)]

    def edit(self, rows, plan):
        v = torch.full((H,), self.config.value)
        if self.config.replace:
            plan.replace(1, np.arange(len(rows)), v)
        else:
            plan.add(1, np.arange(len(rows)), v)


class Ablator(Consumer):
    name = "ablator"

    class Config(ConsumerConfig):
        axis: int = 0

    def writes(self):
        return [Edit(HiddenStates(-1))]

    def edit(self, rows, plan):
        d = torch.zeros(H)
        d[self.config.axis] = 1.0
        plan.ablate(HiddenStates(1), np.arange(len(rows)), d)


class _Plugin:
    @hookimpl
    def tllm_producers(self):
        return [DoubledProducer]

    @hookimpl
    def tllm_consumers(self):
        return [Reader, LastReader, WindowReader, Adder, Ablator]


def _model() -> ModelInfo:
    return ModelInfo(H, 2, 10, torch.float32, torch.device("cpu"), lambda h: h, None)


def _runtime(*specs: dict) -> Runtime:
    reg = Registry()
    reg.register(_Plugin(), name="test-plugin")
    settings = RuntimeSettings.model_validate({"consumers": list(specs)})
    return Runtime(settings, _model(), reg)


def fake_device_steps(rt: Runtime, fc: FakeCuda, n: int) -> None:
    """``n`` steps of :func:`_step`'s rows through ``rt``, their tensors on ``fc``'s device."""
    for _ in range(n):
        rows, step = _step(rt)
        step.tensors = {k: v.to(fc.device) for k, v in step.tensors.items()}
        step.stamps = {k: v.to(fc.device) for k, v in step.stamps.items()}
        with fc.step():
            rt.begin_step(rows, {})
            rt.end_step(step)


def _step(rt: Runtime, n_prompt: int = 2, decode: int = 1):
    """A step of one request: ``n_prompt`` prefill rows finished earlier, ``decode`` rows now
    (decode rows only), with fake tap buffers for every tap the runtime asked for."""
    req = RequestInfo("r-abcdefgh", "r", 0, 0, n_prompt)
    layout = StepLayout(
        engine_ids=["r-abcdefgh"],
        num_scheduled=np.array([decode]),
        num_computed=np.array([n_prompt]),
        num_tokens=np.array([n_prompt + decode]),
        token_ids=torch.arange(decode),
    )
    rows, srow, kept = layout_rows(layout, [req])
    step_no = rt.step_index + 1
    tensors, stamps = {}, {}
    for t in rt.taps:
        if t.layer is not None:
            tensors[t.key] = torch.randn(decode, H)
            stamps[t.key] = torch.tensor([step_no])
    tensors["sampled"] = torch.tensor([7] * decode)
    return rows, StepCapture(step_no, rows, srow, kept, tensors, stamps)


def test_third_party_port_is_served_by_its_producer():
    rt = _runtime({"name": "reader"})
    assert {t.key for t in rt.taps} == {"residual.1", "residual.0", "sampled"}
    rows, step = _step(rt)
    rt.begin_step(rows, {})
    rt.end_step(step)
    (b,) = rt.slots[0].consumer.bundles
    assert torch.equal(b.hidden["twice.1"], 2 * step.tensors["residual.1"])
    assert torch.equal(b.hidden["layer.0"], step.tensors["residual.0"])
    assert b.sampled_token_ids.tolist() == [7]
    snap = rt.counters.snapshot()
    assert snap["rows_captured.twice.1"] == 1 and snap["rows_captured.sampled"] == 1


def _stale_tap_step(rt):
    """One step whose ``residual.0`` tap the forward skipped (its stamp is the step before);
    returns the step and the reader's bundle."""
    rows, step = _step(rt)
    step.stamps["residual.0"] = torch.tensor([step.step - 1])
    rt.begin_step(rows, {})
    rt.end_step(step)
    (b,) = rt.slots[0].consumer.bundles
    return step, b


def test_stale_tap_is_not_delivered_and_is_counted_as_an_error():
    rt = _runtime({"name": "reader"})
    step, b = _stale_tap_step(rt)
    assert "layer.0" not in b.hidden and "twice.1" in b.hidden
    report = rt.collect()
    assert report["runtime"]["stale_captures"] == 1
    assert "rows_captured.layer.0" not in report["runtime"]
    # Users see the edit/read location by its port name, not the bridge's tap key.
    assert any("'layer.0'" in e["error"] for e in report["errors"])
    assert not any("residual" in e["error"] for e in report["errors"])


def test_a_tap_stale_in_a_requests_last_row_reads_nan_there():
    """Window ``last``: a port whose tap was stale in the request's last step is NaN in its
    last row (as a GPU step delivers stale rows), not a row an earlier step left there."""
    rt = _runtime({"name": "lastreader"})
    rows, step = _step(rt)
    rt.begin_step(rows, {})
    rt.end_step(step)
    rows, step = _step(rt, decode=1)
    step.stamps["residual.0"] = torch.tensor([step.step - 1])
    rt.begin_step(rows, {})
    rt.end_step(step)
    rt.finish_requests(list(rows.requests))
    rt.collect()
    (b,) = rt.slots[0].consumer.bundles
    assert len(b.rows) == 1 and torch.isnan(b.hidden["layer.0"]).all()
    assert torch.equal(b.hidden["layer.1"], step.tensors["residual.1"])


def test_every_tap_stale_in_a_requests_last_step_still_moves_its_last_row():
    """Every port stale in the request's last step: its last row is that step's, reading
    NaN, not the earlier step's row with its values."""
    rt = _runtime({"name": "lastreader"})
    rows, step = _step(rt)
    rt.begin_step(rows, {})
    rt.end_step(step)
    rows, step = _step(rt, n_prompt=3)  # one position on
    for key in step.stamps:
        step.stamps[key] = torch.tensor([step.step - 1])
    rt.begin_step(rows, {})
    rt.end_step(step)
    rt.finish_requests(list(rows.requests))
    rt.collect()
    (b,) = rt.slots[0].consumer.bundles
    assert b.rows.position.tolist() == rows.position.tolist()
    assert all(torch.isnan(t).all() for t in b.hidden.values()) and b.hidden


@pytest.mark.parametrize("in_flight", [False, True])
def test_a_stale_port_in_a_step_and_its_last_rows_is_counted_once(monkeypatch, in_flight):
    """A port read both in a step's bundle (decode rows) and in its last rows: its stale tap
    is one refused read, counted once, whether the stamps are there at once (CPU) or arrive
    later (GPU)."""
    if in_flight:
        _stamps_in_flight(monkeypatch)
    monkeypatch.setattr(
        LastReader, "reads", lambda self: [HiddenStates(0, Phase.DECODE), HiddenStates(0, "last")]
    )
    rt = _runtime({"name": "lastreader"})
    rows, step = _step(rt)
    step.stamps["residual.0"] = torch.tensor([step.step - 1])
    rt.begin_step(rows, {})
    rt.end_step(step)
    report = rt.collect()["runtime"]
    assert (report["stale_captures"], report["stale_captures.layer.0"]) == (1, 1), report


def test_a_requests_last_window_is_read_once_per_step(monkeypatch):
    """A request's window and whether a per-request consumer acts on it are read once per
    step (not again per row, nor again to hold its last row)."""
    calls = {"window": 0, "acted_on_by": 0}
    for name in calls:
        real = getattr(RequestInfo, name)

        def spy(self, *a, real=real, name=name):
            calls[name] += 1
            return real(self, *a)

        monkeypatch.setattr(RequestInfo, name, spy)
    rt = _runtime({"name": "windowreader", "per_request": True})
    rows, step = _step(rt, decode=3)
    rows.requests[0].extra_args.update(
        {"tllm_consumers": "windowreader", "tllm_windowreader_window": "last"}
    )
    rt.begin_step(rows, {})
    rt.end_step(step)
    assert calls == {"window": 1, "acted_on_by": 1}
    rt.finish_requests(list(rows.requests))
    rt.collect()
    (b,) = rt.slots[0].consumer.bundles  # its last row, at its finish
    assert b.rows.position.tolist() == [4]
    assert torch.equal(b.hidden["layer.0"], step.tensors["residual.0"][2:])


def test_held_last_rows_are_taken_with_one_index_copy(monkeypatch):
    """At a request's finish its held rows (token ids and two ports) are taken with one
    index sent to their device, not one per tensor."""
    import tllm_core.runtime.reads as last_rows

    sent = []
    real = last_rows.index_to
    monkeypatch.setattr(last_rows, "index_to", lambda *a: sent.append(a) or real(*a))
    rt = _runtime({"name": "lastreader"})
    rows, step = _step(rt)
    rt.begin_step(rows, {})
    rt.end_step(step)
    rt.finish_requests(list(rows.requests))
    rt.collect()
    (b,) = rt.slots[0].consumer.bundles
    assert len(sent) == 1 and len(b.rows) == 1 and set(b.hidden) == {"layer.0", "layer.1"}


def test_a_sampling_port_alone_in_window_last_holds_the_last_sampled_token(monkeypatch):
    monkeypatch.setattr(LastReader, "reads", lambda self: [SampledTokens("last")])
    rt = _runtime({"name": "lastreader"})
    for token in (7, 9):
        rows, step = _step(rt)
        step.tensors["sampled"] = torch.tensor([token])
        rt.begin_step(rows, {})
        rt.end_step(step)
    rt.finish_requests(list(rows.requests))
    report = rt.collect()
    assert not report["errors"], report["errors"]
    (b,) = rt.slots[0].consumer.bundles
    assert b.sampled_token_ids.tolist() == [9] and b.sampled_rows.position.tolist() == [2]


def _stamps_in_flight(monkeypatch):
    """As on a GPU: the step's stamps are still on their way to the host at its end."""
    from tllm_core.runtime.stamp_copies import StampRead

    monkeypatch.setattr(StampRead, "ready", lambda self: self._values is not None)


def test_stamps_in_flight_deliver_stale_rows_as_nan_and_count_the_step_later(monkeypatch):
    _stamps_in_flight(monkeypatch)
    rt = _runtime({"name": "reader"})
    step, b = _stale_tap_step(rt)
    # Delivered without waiting for the stamps: the stale port's rows read NaN, on the device.
    assert torch.isnan(b.hidden["layer.0"]).all()
    assert torch.equal(b.hidden["twice.1"], 2 * step.tensors["residual.1"])
    # Nothing is counted before the stamps are read...
    assert "rows_captured.twice.1" not in rt.counters.snapshot()
    assert rt.counters.snapshot().get("stale_captures", 0) == 0
    # ...and everything once they are (collect reads them).
    report = rt.collect()
    assert report["runtime"]["stale_captures"] == 1
    assert report["runtime"]["rows_captured.twice.1"] == 1
    assert "rows_captured.layer.0" not in report["runtime"]
    assert any("'layer.0'" in e["error"] and "NaN" in e["error"] for e in report["errors"])


def test_stamps_in_flight_written_taps_are_delivered_as_they_are(monkeypatch):
    _stamps_in_flight(monkeypatch)
    rt = _runtime({"name": "reader"})
    rows, step = _step(rt)
    rt.begin_step(rows, {})
    rt.end_step(step)
    (b,) = rt.slots[0].consumer.bundles
    assert torch.equal(b.hidden["layer.0"], step.tensors["residual.0"])
    report = rt.collect()
    assert report["runtime"].get("stale_captures", 0) == 0 and not report["errors"]
    assert report["runtime"]["rows_captured.layer.0"] == 1


def test_stamps_in_flight_count_edited_rows_once_they_arrive(monkeypatch):
    _stamps_in_flight(monkeypatch)
    rt = _runtime({"name": "reader"})
    rows, step = _step(rt)
    step.edited = {"residual.1": torch.tensor([3])}  # the forward's edit changed 3 rows
    rt.begin_step(rows, {})
    rt.end_step(step)
    assert "rows_edited" not in rt.counters.snapshot()  # the count is still on its way
    report = rt.collect()["runtime"]
    assert report["rows_edited"] == 3 and report["rows_edited.layer.1"] == 3, report


def test_end_step_makes_the_host_wait_for_nothing_on_a_gpu():
    """The step's stamps and edit counts go to the host in one copy into pinned memory, read
    when its event has completed: a blocking read at each step's end would make the host wait
    every step, before the next forward is queued."""
    from tllm_core.testing.fake_cuda import FakeCuda

    rt = _runtime({"name": "reader"})
    with FakeCuda() as fc:
        fake_device_steps(rt, fc, 6)  # past the ring of pinned buffers
    waits = fc.findings(kind="host_wait")
    assert not waits, waits
    assert len(rt.slots[0].consumer.bundles) == 6


def test_registry_parses_ports_and_names_bad_ones():
    reg = Registry()
    reg.register(_Plugin(), name="test-plugin")
    assert reg.parse_port("3") == HiddenStates(3)
    assert reg.parse_port("final", Phase.DECODE) == HiddenStates("final", Phase.DECODE)
    assert reg.parse_port("twice.-1") == DoubledResidual(-1)
    assert type(reg.parse_port("attn.2")).__name__ == "AttentionOutput"
    with pytest.raises(ValueError, match=r"bad port 'attn\.x'.*mlp\.\{i\}"):
        reg.parse_port("attn.x")


def test_port_name_grammar_is_one_parser_and_formatter():
    # Every spelling of the residual stream parses to one name, formatted as its bundle key.
    for spelling in (3, "3", " layer.3 "):
        assert parse_port_name(spelling) == PortName("layer", 3)
        assert str(parse_port_name(spelling)) == "layer.3"
    assert parse_port_name("final").is_final and str(parse_port_name("final")) == "final"
    assert parse_port_name("mlp.-2", ("attn", "mlp")) == PortName("mlp", -2)
    assert parse_port_name("rnorm.1") == PortName("rnorm", 1)  # None: syntax only
    assert PortName("layer", 4).short() == "4" and PortName("attn", 4).short() == "attn.4"
    assert format_port_name("attn", 2) == "attn.2"
    bad = {
        ("resid.1", ("attn", "mlp"), True): r"bad site 'resid\.1'.*'attn\.\{i\}'",
        ("final", ("attn",), False): r"bad site 'final'",
        ("1.5", None, True): r"bad site '1\.5'",
        ("", None, True): r"bad site ''",
        (True, None, True): r"bad site True",
    }
    for (value, prefixes, final), match in bad.items():
        with pytest.raises(ValueError, match=match):
            parse_port_name(value, prefixes, final=final, what="site")
    # The bridge's residual tap is shown by the port's name; other taps keep theirs.
    assert tap_port_name("residual.12") == "layer.12"
    assert tap_port_name("attn.3") == "attn.3" and tap_port_name("final") == "final"


def test_edit_tap_only_on_editable_sites():
    with pytest.raises(ValueError, match="read-only"):
        Registry().producer_for(HiddenStates("final")).edit_tap(HiddenStates("final"))
    with pytest.raises(
        ValueError, match="unknown tap site 'nowhere'; the registered sites are attn"
    ):
        Registry().architectures.check_site("nowhere")
    with pytest.raises(ValueError, match="needs an absolute layer index"):
        TapRequest("nowhere")


# -- edit math ------------------------------------------------------------------------
def test_apply_edit_math_add_replace_ablate():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(4, H, generator=g)
    u = torch.nn.functional.normalize(torch.randn(H, generator=g), dim=0)
    v = torch.randn(H, generator=g)
    buf = EditBuffers(4, H, torch.float32, torch.device("cpu"))
    rows = RowsStub(4)
    plan = EditPlan(rows, {"layer.1": "residual.1"}, H)
    plan.add(1, np.array([0]), v)
    plan.replace(1, np.array([1]), v)
    plan.ablate(1, np.array([2]), 3 * u)  # normalised by the plan
    buf.write(plan.ops["layer.1"])
    out = apply_edit(s, buf.mask, buf.keep, buf.add, buf.dir)
    torch.testing.assert_close(out[0], s[0] + v)
    torch.testing.assert_close(out[1], v)
    torch.testing.assert_close(out[2], s[2] - (s[2] @ u) * u)
    assert torch.equal(out[3], s[3])  # unselected: bit for bit


def test_ablation_then_add_and_two_consumers_compose_in_order():
    """Ablation acts on the incoming stream, adds sum after it, replace discards earlier adds."""
    g = torch.Generator().manual_seed(1)
    s = torch.randn(2, H, generator=g)
    e0 = torch.eye(H)[0]
    buf = EditBuffers(2, H, torch.float32, torch.device("cpu"))
    first = EditPlan(RowsStub(2), {"layer.1": "residual.1"}, H)
    first.add(1, np.array([0, 1]), torch.ones(H))
    second = EditPlan(RowsStub(2), {"layer.1": "residual.1"}, H)
    second.ablate(1, np.array([0, 1]), e0)
    second.replace(1, np.array([1]), torch.full((H,), 5.0))
    second.add(1, np.array([1]), torch.ones(H))
    for p in (first, second):
        buf.check(p.ops["layer.1"], "layer.1")
        buf.write(p.ops["layer.1"])
    out = apply_edit(s, buf.mask, buf.keep, buf.add, buf.dir)
    expect0 = s[0] - s[0, 0] * e0 + torch.ones(H)  # the added ones keep their axis-0 part
    torch.testing.assert_close(out[0], expect0)
    torch.testing.assert_close(out[1], torch.full((H,), 6.0))
    # a third consumer ablating another direction on the same rows is refused before writing
    third = EditPlan(RowsStub(2), {"layer.1": "residual.1"}, H)
    third.ablate(1, np.array([0]), torch.eye(H)[1])
    with pytest.raises(ValueError, match="second, different ablation direction"):
        buf.check(third.ops["layer.1"], "layer.1")


def test_runtime_isolates_a_conflicting_ablation_and_keeps_consumer_order():
    rt = _runtime(
        {"name": "adder", "config": {"value": 2.0}},
        {"name": "ablator", "config": {"axis": 0}},
    )
    (tap,) = rt.edit_taps
    assert tap.key == "residual.1"
    buf = EditBuffers(3, H, torch.float32, torch.device("cpu"))
    rows, _ = _step(rt, decode=3)
    rt.begin_step(rows, {tap.key: buf})
    s = torch.randn(3, H)
    out = apply_edit(s, buf.mask[:3], buf.keep[:3], buf.add[:3], buf.dir[:3])
    expect = s.clone()
    expect[:, 0] = 0
    torch.testing.assert_close(out, expect + 2.0)
    assert rt.collect()["errors"] == []


# -- taps (engine-neutral wrappers) -----------------------------------------------------
class _Layer(torch.nn.Module):
    def forward(self, h, r):
        return h * 2, r + 1


def _tap_buffers(n: int, edit: bool) -> TapBuffers:
    return TapBuffers(
        capture=torch.zeros(n, H),
        edit=EditBuffers(n, H, torch.float32, torch.device("cpu")) if edit else None,
        clock=torch.tensor([5]),
        stamp=torch.tensor([-1]),
        edited=torch.zeros(1, dtype=torch.int64),
    )


def test_residual_tap_captures_stamps_and_counts_changed_rows():
    b = _tap_buffers(4, edit=True)
    plan = EditPlan(RowsStub(3), {"layer.0": "residual.0"}, H)
    plan.add(0, np.array([0, 1]), torch.tensor([1.0, 0, 0, 0]))
    plan.add(0, np.array([2]), torch.zeros(H))  # selected, but changes nothing
    b.edit.write(plan.ops["layer.0"])
    tap = ResidualTap(_Layer(), b)
    h, r = torch.randn(3, H), torch.randn(3, H)
    h2, r2 = tap(h, r)
    assert b.stamp.item() == 5 and b.edited.item() == 2
    torch.testing.assert_close(b.capture[:3], h2 + r2)
    torch.testing.assert_close(h2[0] + r2[0], 2 * h[0] + r[0] + 1 + torch.tensor([1.0, 0, 0, 0]))
    assert torch.equal(h2[2], 2 * h[2])  # unselected or unchanged rows keep h bit for bit


def test_output_tap_edits_the_block_output():
    b = _tap_buffers(2, edit=True)
    plan = EditPlan(RowsStub(2), {"attn.0": "attn.0"}, H)
    plan.replace("attn.0", np.array([1]), torch.ones(H))
    b.edit.write(plan.ops["attn.0"])
    tap = OutputTap(torch.nn.Identity(), b)
    x = torch.randn(2, H)
    y = tap(x)
    assert torch.equal(y[0], x[0]) and torch.equal(y[1], torch.ones(H))
    assert b.edited.item() == 1 and b.stamp.item() == 5


# -- guide view counts only what changed -----------------------------------------------
def test_guide_view_counts_only_changed_rows():
    logits = torch.tensor([[0.0, 1.0, float("-inf")], [2.0, float("-inf"), 3.0]])
    view = GuideView(1, RowsStub(2), logits.clone(), torch.ones(2), np.ones(2, bool), True, {})
    cand = view.candidates()
    view.update_candidates(torch.arange(len(cand)), cand.logits.clone())  # same values back
    assert view.guided_counts() == (0, 0)
    view.update(torch.tensor([1]), torch.tensor([[2.0, 0.0, 4.0]]))
    assert view.guided_counts() == (1, 1) == (view.rows_guided, view.candidates_guided)
    view.rollback()
    assert view.guided_counts()[0] == 0 and torch.equal(view.logits, logits)


class RowsStub:
    """Only ``len`` is used by EditPlan/GuideView bookkeeping in these tests."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def test_per_request_editor_sees_and_edits_only_its_rows():
    rt = _runtime({"name": "adder", "config": {"value": 1.0}, "per_request": True})
    on = RequestInfo("a-abcdefgh", "a", 0, 0, 1, extra_args={"tllm_consumers": "adder"})
    off = RequestInfo("b-abcdefgh", "b", 1, 0, 1)
    layout = StepLayout(
        engine_ids=["a-abcdefgh", "b-abcdefgh"],
        num_scheduled=np.array([2, 3]),
        num_computed=np.array([0, 0]),
        num_tokens=np.array([2, 3]),
        token_ids=torch.arange(5),
    )
    rows, _, _ = layout_rows(layout, [off, on][::-1])
    seen = []
    adder = rt.slots[0].consumer
    orig = adder.edit
    adder.edit = lambda r, plan: (seen.append(len(r)), orig(r, plan))  # type: ignore[method-assign]
    buf = EditBuffers(5, H, torch.float32, torch.device("cpu"))
    rt.begin_step(rows, {"residual.1": buf})
    assert seen == [2]  # the consumer was handed only request a's rows
    assert buf.mask[:, 0].tolist() == [True, True, False, False, False]


class _SetFirst(torch.nn.Module):
    """In-graph transform: set component 0 of each row to 5 (depends on nothing else)."""

    def forward(self, s, rows):
        out = s.clone()
        out[:, 0] = 5.0
        return out


class Clamper(Consumer):
    name = "clamper"

    def __init__(self, config, context):
        super().__init__(config, context)
        self.module = _SetFirst()

    def writes(self):
        return [Edit(HiddenStates(1), transform=self.module)]

    def edit(self, rows, plan):
        plan.transform(1, np.array([0, 2]))


def test_in_graph_transform_runs_on_selected_rows_only():
    reg = Registry()
    reg.register(_Plugin(), name="test-plugin")

    class _More:
        @hookimpl
        def tllm_consumers(self):
            return [Clamper]

    reg.register(_More(), name="more")
    settings = RuntimeSettings.model_validate({"consumers": [{"name": "clamper"}]})
    rt = Runtime(settings, _model(), reg)
    (tap,) = rt.edit_taps
    buf = EditBuffers(4, H, torch.float32, torch.device("cpu"))
    for owner, module in rt.transforms(tap.key):
        buf.add_transform(owner, module)
    rows, _ = _step(rt, decode=3)
    rt.begin_step(rows, {tap.key: buf})
    b = TapBuffers(
        torch.zeros(4, H),
        buf,
        torch.tensor([1]),
        torch.tensor([0]),
        torch.zeros(1, dtype=torch.int64),
    )
    x = torch.randn(3, H)
    y = OutputTap(torch.nn.Identity(), b)(x)
    assert y[0, 0] == 5.0 and y[2, 0] == 5.0 and torch.equal(y[1], x[1])
    assert torch.equal(y[0, 1:], x[0, 1:]) and b.edited.item() == 2
    with pytest.raises(ValueError, match="declares no transform"):
        EditPlan(RowsStub(1), {"layer.1": "residual.1"}, H).transform(1, np.array([0]))


def test_edit_rows_out_of_range_are_refused_before_any_write():
    """A negative row index used to wrap to the buffer's last row, which reset() never
    clears: the edit then stayed on for later steps (issue 26)."""
    v = torch.ones(H)
    for bad in ([-1], [3], [0, 7]):
        plan = EditPlan(RowsStub(3), {"layer.1": "residual.1"}, H)
        with pytest.raises(ValueError, match=rf"row index {bad[-1]} is out of range.*0\.\.2"):
            plan.add(1, np.array(bad), v)
        assert plan.ops == {}
    plan = EditPlan(RowsStub(3), {"layer.1": "residual.1"}, H)
    plan.add(1, np.array([0, 2]), v)  # in range: accepted
    assert plan.ops["layer.1"][0][0].tolist() == [0, 2]


def test_a_bad_remap_is_isolated_to_its_consumer():
    """A per-request consumer's plan is made on its requests' rows and remapped to the
    step's; an index the remap cannot translate fails that consumer, not the step."""

    class Forger(Consumer):
        name = "forger"

        def writes(self):
            return [ResidualEdit(1)]

        def edit(self, rows, plan):  # bypasses the plan's checks, as a buggy consumer might
            plan.ops["layer.1"] = [(np.array([5]), "add", torch.ones(H))]

    class _Forge:
        @hookimpl
        def tllm_consumers(self):
            return [Forger]

    reg = Registry()
    reg.register(_Plugin(), name="test-plugin")
    reg.register(_Forge(), name="forge")
    settings = RuntimeSettings.model_validate(
        {"consumers": [{"name": "forger", "per_request": True}, {"name": "adder"}]}
    )
    rt = Runtime(settings, _model(), reg)
    req = RequestInfo("r-abcdefgh", "r", 0, 0, 2, {"tllm_consumers": "forger"})
    layout = StepLayout(
        engine_ids=["r-abcdefgh"],
        num_scheduled=np.array([1]),
        num_computed=np.array([2]),
        num_tokens=np.array([3]),
        token_ids=torch.arange(1),
    )
    rows, _, _ = layout_rows(layout, [req])
    (tap,) = rt.edit_taps
    buf = EditBuffers(4, H, torch.float32, torch.device("cpu"))
    rt.begin_step(rows, {tap.key: buf})  # does not raise
    assert rt.counters.get("consumer_errors.forger") == 1
    assert rt.bus.errors[0]["where"] == "edit (buffers)"
    assert bool(buf.mask[0]) and buf.add[0, 0] == 1.0  # adder, after it, still edited

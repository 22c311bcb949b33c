"""The runtime's own host syncs in a step (begin_step, end_step: rows, reads, the step's
stamps), counted on CPU. The step's tensors live on the ``meta`` device, so a copy between
host and "device" is a real one that ``tllm_core.testing.counters`` sees, and a read of a
device value that the code did not mean to make fails (a meta tensor has no values). The one
intended read, the step's stamps (``runtime.stamp_copies``: one blocking read on a device
without CUDA's streams and events, as meta here), is counted by a stand-in for
``Tensor.cpu`` that answers with the step number. On CUDA that read does not block
(``test_core_ports.test_end_step_makes_the_host_wait_for_nothing_on_a_gpu``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_core_ports import H, _model, _runtime, _stamps_in_flight, _step

from tllm_core import Consumer, HiddenStates, Phase, SamplerGuide, hookimpl
from tllm_core.api.rows import RequestInfo, StepLayout, index_to, layout_rows
from tllm_core.api.step import StepCapture
from tllm_core.plugins.registry import Registry
from tllm_core.runtime.runtime import Runtime
from tllm_core.runtime.settings import RuntimeSettings
from tllm_core.testing.counters import SyncCounter
from tllm_core.testing.fake_cuda import FakeCuda

META = torch.device("meta")


@pytest.fixture
def device_reads(monkeypatch):
    """Calls of ``.cpu()`` on meta tensors; each answers with ``reads.step``."""

    class Reads:
        count, step = 0, 0

    real = torch.Tensor.cpu

    def cpu(t, *a, **kw):
        if t.device != META:
            return real(t, *a, **kw)
        Reads.count += 1
        return torch.full(t.shape, Reads.step, dtype=t.dtype)

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    return Reads


def _meta_step(rt, decode: int, device: torch.device = META) -> tuple:
    """A decode step of ``decode`` requests, its tensors on the meta device (or ``device``,
    with the stamps the taps would write)."""
    reqs = [RequestInfo(f"r{i}-abcdefgh", f"r{i}", i, 0, 2) for i in range(decode)]
    layout = StepLayout(
        engine_ids=[r.engine_id for r in reqs],
        num_scheduled=np.ones(decode, np.int64),
        num_computed=np.full(decode, 2),
        num_tokens=np.full(decode, 3),
        token_ids=torch.zeros(decode, dtype=torch.long, device=device),
    )
    rows, srow, kept = layout_rows(layout, reqs)
    n = rt.step_index + 1
    tensors, stamps = {"sampled": torch.zeros(decode, dtype=torch.long, device=device)}, {}
    for t in rt.taps:
        if t.layer is not None:
            tensors[t.key] = torch.zeros(decode, H, device=device)
            stamps[t.key] = torch.full((1,), n if device != META else 0, device=device)
    return rows, StepCapture(n, rows, srow, kept, tensors, stamps)


def test_runtime_step_reads_the_device_once(device_reads):
    rt = _runtime({"name": "reader"})
    counts = []
    for _ in range(3):
        rows, step = _meta_step(rt, decode=3)
        device_reads.step = step.step
        before = device_reads.count
        with SyncCounter() as sc:
            rt.begin_step(rows, {})
            rt.end_step(step)
        counts.append((dict(sc.kinds), device_reads.count - before))
    assert counts == [({}, 1)] * 3
    (b, *_) = rt.slots[0].consumer.bundles
    assert b.hidden["layer.0"].device == META and len(b.rows) == 3  # the step was delivered


class Looker(Consumer):
    """Guides: reads the first layer's state at its rows and, when ``write``, raises every
    candidate logit of its rows by one (a dense ``update``)."""

    name = "looker"
    write = False

    def reads(self):
        return [HiddenStates(0, Phase.DECODE)]

    def writes(self):
        return [SamplerGuide()]

    def guide(self, view):
        view.hidden("layer.0")
        if self.write:
            view.update(torch.arange(len(view.rows), device=view.logits.device), view.logits + 1)


class _LookerPlugin:
    @hookimpl
    def tllm_consumers(self):
        return [Looker]


@pytest.mark.parametrize("write", [False, True])
def test_runtime_guide_reads_the_device_no_more(device_reads, monkeypatch, write):
    """A step with a guiding consumer (its read of the step's states, the view, its writes)
    reads the device no more than one without: whether vLLM's own call goes on is decided on
    the host (``GuideView.wrote``) and the guided counts stay on the device until the
    counters are collected (one read then)."""
    monkeypatch.setattr(Looker, "write", write)
    reg = Registry()
    reg.register(_LookerPlugin(), name="looker-plugin")
    settings = RuntimeSettings.model_validate({"consumers": [{"name": "looker"}]})
    rt = Runtime(settings, _model(), reg)
    for _ in range(2):
        rows, step = _meta_step(rt, decode=3)
        device_reads.step, before = step.step, device_reads.count
        logits = torch.zeros(3, 10, device=META)
        with SyncCounter() as sc:
            rt.begin_step(rows, {})
            wrote = rt.guide(step, logits, torch.ones(3, device=META), np.ones(3, bool), False)
            # Nothing read before sampling: the stamps are checked on the device there.
            assert device_reads.count == before
            rt.end_step(step)
        assert dict(sc.kinds) == {} and device_reads.count - before == 1
        assert wrote is write  # the path decision: vLLM's own call goes on when nothing was written
    # The guide ran (it read its states without an error); the counts are read once, at
    # collect (on meta the stand-in answers with the step number for both).
    before = device_reads.count
    snap = rt.collect()["runtime"]
    assert device_reads.count - before == int(write)
    assert snap["rows_guide_visited"] == 6 and "consumer_errors" not in snap, snap
    assert snap["rows_guided"] == (step.step if write else 0)


@pytest.mark.parametrize("is_random", [[True, True, True], [True, False, True]])
def test_a_guided_step_sends_its_indices_in_one_copy_and_waits_for_nothing(monkeypatch, is_random):
    """A writing guide, then the count of rows left without a candidate (over the rows whose
    draw is kept: greedy ones left out): the step's indices go in its one planned copy."""
    _stamps_in_flight(monkeypatch)
    monkeypatch.setattr(Looker, "write", True)
    reg = Registry()
    reg.register(_LookerPlugin(), name="looker-plugin")
    settings = RuntimeSettings.model_validate({"consumers": [{"name": "looker"}]})
    rt = Runtime(settings, _model(), reg)
    copies = []
    with FakeCuda() as fc:
        for _ in range(3):
            rows, step = _meta_step(rt, decode=3, device=torch.device("cpu"))
            with fc.quiet():
                rows.token_ids = rows.token_ids.to(fc.device)
                step.tensors = {k: v.to(fc.device) for k, v in step.tensors.items()}
                step.stamps = {k: v.to(fc.device) for k, v in step.stamps.items()}
                logits, temps = (
                    torch.zeros(3, 10, device=fc.device),
                    torch.ones(3, device=fc.device),
                )
            before = rt._buffers.copies
            with fc.step():
                rt.begin_step(rows, {})
                assert rt.guide(step, logits, temps, np.array(is_random), False)
                rt.end_step(step)
            copies.append(rt._buffers.copies - before)
    assert copies == [1, 1, 1]
    assert not fc.findings(kind="host_wait") and not fc.findings(kind="pageable_copy")


def test_index_copies_do_not_wait_for_the_device():
    idx = np.array([2, 0])
    with SyncCounter() as sc:
        t = index_to(idx, META)
    assert t.device == META and t.dtype == torch.long and not sc.kinds
    with SyncCounter() as sc:
        torch.from_numpy(idx).to(META)  # the plain form: a blocking copy
    assert sc.kinds == {"host_device_copy": 1}


def test_a_last_window_consumer_sends_its_indices_in_the_steps_one_copy(monkeypatch):
    """Window ``last``: the rows a step holds and their holders' slots go to the device in
    the step's one planned index copy (``StepIndices.copies``), none sent alone."""
    _stamps_in_flight(monkeypatch)  # as on a GPU: the step's bundles cut before its stamps arrive
    rt = _runtime({"name": "lastreader"})
    copies = []
    with FakeCuda() as fc:
        for _ in range(3):
            rows, step = _step(rt, decode=3)  # the last row (2) is not the holder's slot (0)
            with fc.quiet():  # the forward's tensors, on the device (rows is step.rows)
                rows.token_ids = rows.token_ids.to(fc.device)
                step.tensors = {k: v.to(fc.device) for k, v in step.tensors.items()}
                step.stamps = {k: v.to(fc.device) for k, v in step.stamps.items()}
            before = rt._buffers.copies
            with fc.step():
                rt.begin_step(rows, {})
                rt.end_step(step)
            copies.append(rt._buffers.copies - before)
        rt.finish_requests(list(rows.requests))
    assert copies == [1, 1, 1]
    assert not fc.findings(kind="host_wait") and not fc.findings(kind="pageable_copy")
    (b,) = rt.slots[0].consumer.bundles
    assert len(b.rows) == 1 and b.rows.position.tolist() == [4]


class Writer(Consumer):
    """Raises the candidates of rows 0 and 2 by one and writes row 1's own values back."""

    name = "writer"

    def writes(self):
        return [SamplerGuide()]

    def guide(self, view):
        view.update(torch.tensor([0, 2]), view.logits[[0, 2]] + 1)
        view.update(torch.tensor([1]), view.logits[[1]].clone())


class _WriterPlugin:
    @hookimpl
    def tllm_consumers(self):
        return [Writer]


def test_guided_counts_summed_on_the_device_are_right_at_collect():
    """What the device-side counts add up to, on real values: rows and candidates whose
    logits changed (a row written with its own values counts nothing, though the step takes
    the guided path), over two steps."""
    reg = Registry()
    reg.register(_WriterPlugin(), name="writer-plugin")
    settings = RuntimeSettings.model_validate({"consumers": [{"name": "writer"}]})
    rt = Runtime(settings, _model(), reg)
    cpu = torch.device("cpu")
    for _ in range(2):
        rows, step = _meta_step(rt, decode=3, device=cpu)
        logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
        logits[:, 5:] = float("-inf")  # 5 candidates per row
        rt.begin_step(rows, {})
        assert rt.guide(step, logits, torch.ones(3), np.ones(3, bool), True) is True
        rt.end_step(step)
    snap = rt.collect()["runtime"]
    assert (snap["rows_guided"], snap["candidates_guided"]) == (2 * 2, 2 * 2 * 5), snap
    again = rt.collect()["runtime"]  # drained once: a second collect adds nothing
    assert (again["rows_guided"], again["candidates_guided"]) == (4, 20)


class Blanker(Consumer):
    """Writes -inf over every candidate of every row."""

    name = "blanker"

    def writes(self):
        return [SamplerGuide()]

    def guide(self, view):
        rows = torch.arange(len(view.rows))
        view.update(rows, torch.full_like(view.logits, float("-inf")))


def test_only_rows_whose_draw_is_kept_count_as_left_without_candidates():
    """All three rows emptied: the greedy one (vLLM took its argmax before) and the
    mid-prefill one (its token is discarded) do not count, the other does, per step."""
    plugin = type("P", (), {"tllm_consumers": hookimpl(lambda self: [Blanker])})()
    reg = Registry()
    reg.register(plugin, name="blanker-plugin")
    settings = RuntimeSettings.model_validate({"consumers": [{"name": "blanker"}]})
    rt = Runtime(settings, _model(), reg)
    for _ in range(2):
        rows, step = _meta_step(rt, decode=3, device=torch.device("cpu"))
        rows.mid_prefill = np.array([False, False, True])
        logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
        rt.begin_step(rows, {})
        assert rt.guide(step, logits, torch.ones(3), np.array([True, False, True]), False)
        rt.end_step(step)
    assert rt.collect()["runtime"]["rows_without_candidates"] == 2


def test_guided_counts_made_in_inference_mode_are_drained_outside_it():
    """The sampler runs under ``torch.inference_mode``; ``collect`` (an RPC) does not."""
    from tllm_core.runtime.buffer_pool import GuidedCounts

    counts = GuidedCounts()
    for _ in range(2):
        with torch.inference_mode():
            counts.add(torch.tensor([0, 3, 1]))
            counts.add_empty(torch.tensor([0.5, float("-inf"), float("nan"), float("inf")]))
        assert counts.drain() == (2, 4, 3)
    assert counts.drain() == (0, 0, 0)


@pytest.mark.parametrize("phase", [Phase.DECODE, Phase.GUIDE])
def test_a_stale_tap_reads_nan_at_guide_time_and_is_reported_after_sampling(monkeypatch, phase):
    """Without the stamp read before sampling, a tap the forward did not write reaches the
    guide as NaN rows (decided on the device), and the stale capture is counted and
    reported at end_step; a written tap reaches it as it is."""
    seen = []
    monkeypatch.setattr(Looker, "guide", lambda self, view: seen.append(view.hidden("layer.0")))
    monkeypatch.setattr(Looker, "reads", lambda self: [HiddenStates(0, phase)])
    reg = Registry()
    reg.register(_LookerPlugin(), name="looker-plugin")
    settings = RuntimeSettings.model_validate({"consumers": [{"name": "looker"}]})
    rt = Runtime(settings, _model(), reg)
    cpu = torch.device("cpu")
    for stale in (False, True):
        rows, step = _meta_step(rt, decode=3, device=cpu)
        key = next(iter(step.stamps))
        step.tensors[key].fill_(1.0)
        if stale:
            step.stamps[key].fill_(step.step - 1)
        rt.begin_step(rows, {})
        rt.guide(step, torch.zeros(3, 10), torch.ones(3), np.ones(3, bool), False)
        assert bool(seen[-1].isnan().all()) is stale and (stale or bool((seen[-1] == 1).all()))
        rt.end_step(step)
        assert rt.counters.snapshot().get("stale_captures", 0) == int(stale)

"""Per-request consumers' rows (``tllm_core/runtime/reads.py``): a consumer switched on
by some requests (``tllm_consumers``) sees only their rows, as views of the step's tensors
where they form one range and gathered into the runtime's reused buffers otherwise; its
guide writes only their logits (in place, or written back) and leaves them bit for bit when
it fails; on the fake CUDA device a steady step allocates nothing for it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tllm_core import Consumer, HiddenStates, Phase, ResidualEdit, SamplerGuide, hookimpl
from tllm_core.api.consumer import ModelInfo
from tllm_core.api.edits import EditBuffers
from tllm_core.api.rows import RequestInfo, StepLayout, layout_rows
from tllm_core.api.step import StepCapture
from tllm_core.plugins.registry import Registry
from tllm_core.runtime.reads import RowSelection, span
from tllm_core.runtime.runtime import Runtime
from tllm_core.runtime.settings import RuntimeSettings
from tllm_core.testing.fake_cuda import FakeCuda

H, V = 4, 10
CPU = torch.device("cpu")
# Request 1 finishes its 3-token prompt (3 rows), the others decode one row: 8 token rows,
# 6 sampling rows (row 3 is request 1's last).
SCHEDULED = np.array([1, 3, 1, 1, 1, 1])
# The requests that switch the consumers on (rows of several runs, one range, all, one).
SELECTIONS = {"interleaved": [0, 2, 4], "block": [1, 2, 3], "all": list(range(6)), "one": [5]}
NEG_INF = float("-inf")


class Nudger(Consumer):
    """Per-request guide: raises each candidate of its rows by the row's ``layer.0`` state
    (component 0); with ``fail``, also writes through every other kind of update, then
    raises."""

    name = "nudger"
    fail = False

    def __init__(self, config, context):
        super().__init__(config, context)
        self.seen: list[dict] = []

    def reads(self):
        return [HiddenStates(0, Phase.DECODE)]

    def writes(self):
        return [SamplerGuide()]

    def guide(self, view):
        h = view.hidden("layer.0")
        self.seen.append(
            {
                "ids": view.rows.request_ids,
                "row": view.rows.row.tolist(),
                "tokens": view.rows.token_ids.tolist(),
                "temperature": view.temperature.clone(),
                "is_random": view.is_random.tolist(),
                "hidden": h.clone(),
                "logits_at": view.logits.data_ptr(),
            }
        )
        cand = view.candidates()
        view.update_candidates(torch.arange(len(cand)), cand.logits + h[cand.rows, 0])
        if self.fail:
            top = view.top_candidates(2)
            rows = torch.ones(len(view.rows), dtype=torch.bool)
            view.update_top_candidates(top, torch.zeros(top.tokens.shape), drop_rest=rows)
            view.update(torch.tensor([0]), torch.full((1, V), 7.0))
            raise RuntimeError("nudger failed after writing")


class Noter(Consumer):
    """Per-request editor: notes its rows and adds its request's index to them (``plan``:
    whether it plans an edit at all)."""

    name = "noter"
    plan = True

    def __init__(self, config, context):
        super().__init__(config, context)
        self.seen: list[tuple[list[str], torch.Tensor]] = []

    def writes(self):
        return [ResidualEdit(1)]

    def edit(self, rows, plan):
        self.seen.append((rows.request_ids, rows.token_ids))
        if self.plan:
            values = torch.tensor([float(r.prompt_index) for r in rows.requests])
            plan.add(1, np.arange(len(rows)), values[:, None].expand(-1, H))


class _Plugin:
    @hookimpl
    def tllm_consumers(self):
        return [Nudger, Noter]


def _runtime(*names: str, device: torch.device = CPU) -> Runtime:
    reg = Registry()
    reg.register(_Plugin(), name="request-rows-plugin")
    specs = [{"name": n, "per_request": True} for n in names]
    settings = RuntimeSettings.model_validate({"consumers": specs})
    model = ModelInfo(H, 2, V, torch.float32, device, lambda h: h, None)
    return Runtime(settings, model, reg)


def _step(rt: Runtime, on: list[int], device: torch.device = CPU, seed: int = 0) -> StepCapture:
    """A step of 6 requests (see ``SCHEDULED``); those in ``on`` switch both consumers on."""
    reqs = [
        RequestInfo(
            f"r{i}-x", f"r{i}", i, 0, 3 if i == 1 else 2,
            extra_args={"tllm_consumers": "nudger,noter"} if i in on else {},
        )
        for i in range(6)
    ]  # fmt: skip
    computed = np.array([2, 0, 2, 2, 2, 2])
    g = torch.Generator().manual_seed(seed)
    total = int(SCHEDULED.sum())
    layout = StepLayout(
        engine_ids=[r.engine_id for r in reqs],
        num_scheduled=SCHEDULED,
        num_computed=computed,
        num_tokens=computed + SCHEDULED,
        token_ids=(torch.arange(total) * 3 + seed).to(device),
    )
    rows, srow, kept = layout_rows(layout, reqs)
    n = rt.step_index + 1
    tensors, stamps = {}, {}
    for t in rt.taps:
        if t.layer is not None:
            tensors[t.key] = torch.randn(total, H, generator=g).to(device)
            stamps[t.key] = torch.full((1,), n, device=device)
    return StepCapture(n, rows, srow, kept, tensors, stamps)


def _logits(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, V, generator=g)
    return x.masked_fill(torch.rand(6, V, generator=g) < 0.4, NEG_INF)  # filtered out


def test_span_is_a_slice_only_for_one_range():
    assert span(np.array([2, 3, 4])) == slice(2, 5) and span(np.array([0])) == slice(0, 1)
    assert span(np.array([0, 2])) is None and span(np.zeros(0, np.int64)) is None
    sel = RowSelection(np.array([False, True, True, False]))
    assert sel.span == slice(1, 3) and sel.indices() == [] and len(sel) == 2
    sel = RowSelection(np.array([True, False, True]))
    assert sel.span is None and [i.tolist() for i in sel.indices()] == [[0, 2]]


@pytest.mark.parametrize("which", SELECTIONS)
def test_a_per_request_guide_sees_its_rows_and_writes_only_their_logits(which):
    """Values as the earlier copy-and-write-back path gave them, computed here without the
    runtime: the consumer's rows, token ids, temperatures, randomness and states at its
    sampling rows; its candidates raised, every other logit bit for bit; over two steps
    (the second reuses the first's buffers). One range is handed out as views of the step's
    logits, other rows as a copy."""
    on = SELECTIONS[which]
    rt = _runtime("nudger")
    nudger = rt.slots[0].consumer
    for seed in (0, 1):
        step = _step(rt, on, seed=seed)
        logits, temperature = _logits(seed), torch.arange(1.0, 7.0)
        is_random = np.array([True, False, True, True, False, True])
        srow = step.sample_token_row
        h = step.tensors["residual.0"][srow][on]
        want = logits.clone()
        want[on] = torch.where(want[on] > NEG_INF, want[on] + h[:, :1], want[on])
        rt.begin_step(step.rows, {})
        assert rt.guide(step, logits, temperature, is_random, True) is True
        assert torch.equal(logits, want)
        seen = nudger.seen[-1]
        assert seen["ids"] == [f"r{i}" for i in on] and seen["row"] == srow[on].tolist()
        assert seen["tokens"] == step.rows.token_ids[srow[on]].tolist()
        assert torch.equal(seen["temperature"], temperature[on])
        assert seen["is_random"] == is_random[on].tolist()
        assert torch.equal(seen["hidden"], h)
        is_range = on == list(range(on[0], on[-1] + 1))
        assert (seen["logits_at"] == logits[on[0]].data_ptr()) is is_range
        rt.end_step(step)
    snap = rt.collect()["runtime"]
    assert snap["rows_guide_visited"] == 2 * len(on) and "consumer_errors" not in snap


def test_a_guide_no_request_switched_on_is_not_called():
    rt = _runtime("nudger")
    step = _step(rt, [])
    logits = _logits(0)
    before = logits.clone()
    rt.begin_step(step.rows, {})
    assert rt.guide(step, logits, torch.ones(6), np.ones(6, bool), True) is False
    assert torch.equal(logits, before) and rt.slots[0].consumer.seen == []


@pytest.mark.parametrize("which", ["block", "all", "interleaved"])
def test_a_failing_per_request_guide_leaves_the_logits_bit_for_bit(monkeypatch, which):
    """A guide that writes through every kind of update (candidates, top candidates with the
    rest dropped, a dense row) and then raises leaves the step's logits as they were: on
    views of them (one range) its writes are undone (seen failing with the undo skipped),
    on a copy they are not written back."""
    monkeypatch.setattr(Nudger, "fail", True)
    rt = _runtime("nudger")
    step = _step(rt, SELECTIONS[which])
    logits = _logits(0)
    before = logits.clone()
    rt.begin_step(step.rows, {})
    assert rt.guide(step, logits, torch.ones(6), np.ones(6, bool), True) is False
    assert torch.equal(logits, before)
    assert rt.counters.get("consumer_errors.nudger") == 1
    assert rt.bus.errors[0]["where"] == "guide"


@pytest.mark.parametrize("which", SELECTIONS)
def test_a_per_request_editor_sees_and_edits_its_token_rows(which):
    """An editor switched on by some requests is handed their token rows (token ids as the
    step's) and its plan lands on those rows of the step."""
    on = SELECTIONS[which]
    rt = _runtime("noter")
    step = _step(rt, on)
    (tap,) = rt.edit_taps
    buf = EditBuffers(8, H, torch.float32, CPU)
    rt.begin_step(step.rows, {tap.key: buf})
    rows = [i for i, r in enumerate(step.rows.requests) if r.prompt_index in on]
    ids, tokens = rt.slots[0].consumer.seen[-1]
    assert ids == [step.rows.requests[i].request_id for i in rows]
    assert torch.equal(tokens, step.rows.token_ids[rows])
    assert np.nonzero(buf.mask[:, 0].numpy())[0].tolist() == rows
    want = torch.tensor([float(step.rows.requests[i].prompt_index) for i in rows])
    assert torch.equal(buf.add[rows, 0], want)


@pytest.mark.parametrize("which", ["interleaved", "block"])
def test_per_request_rows_on_a_gpu_allocate_nothing_and_wait_for_nothing(monkeypatch, which):
    """On the fake CUDA device, stream order checked: a per-request editor's rows (its plan
    empty: the edit buffers' own writes are not what is counted) and a per-request guide's
    view take nothing from the allocator in a steady step, make the host wait for nothing
    and copy nothing from pageable memory (the editor's rows' token ids, the guide's index,
    logits, temperatures, states and change counts reuse their buffers)."""
    monkeypatch.setattr(Noter, "plan", False)
    with FakeCuda(order=True) as fc:
        rt = _runtime("noter", "nudger", device=fc.device)
        nudger = rt.slots[1].consumer
        monkeypatch.setattr(nudger, "guide", lambda view: nudger.seen.append(view))
        logits = torch.zeros(6, V, device=fc.device)
        temperature = torch.ones(6, device=fc.device)

        def one(step: StepCapture) -> None:
            rt.begin_step(step.rows, {})
            rt.guide(step, logits, temperature, np.ones(6, bool), True)
            nudger.seen.clear()  # what the consumers saw is let go
            rt.slots[0].consumer.seen.clear()

        one(_step(rt, SELECTIONS[which], device=fc.device))  # the pool's buffers are made
        steps = [_step(rt, SELECTIONS[which], device=fc.device) for _ in range(2)]
        with fc.steps():
            for step in steps:
                one(step)
        allocations = sorted({f"{f.where} {f.code}" for f in fc.findings(kind="allocation")})
        waits = fc.findings(kind="host_wait") + fc.findings(kind="pageable_copy")
        races = fc.findings(None, "race")
    assert allocations == [] and waits == [] and races == [], (allocations, waits, races)

"""The runtime's reused per-step buffers (``tllm_core/runtime/buffer_pool.py``): a buffer is reused only when nothing holds it, so a bundle a consumer
keeps keeps its values; gathers into the pool equal ``index_select``; the step's indices go
to the device in one copy from a pinned staging ring that is rewritten only after its copy
ran; a buffer moved to another stream is reused after the work of the one it left."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tllm_core import Consumer, HiddenStates, Phase, SampledTokens, hookimpl
from tllm_core.api.consumer import ModelInfo
from tllm_core.api.rows import RequestInfo, StepLayout, layout_rows
from tllm_core.api.step import StepCapture
from tllm_core.plugins.registry import Registry
from tllm_core.runtime.buffer_pool import BufferPool, GuidedCounts, StepIndices
from tllm_core.runtime.reads import build_bundle
from tllm_core.runtime.runtime import Runtime
from tllm_core.runtime.settings import RuntimeSettings
from tllm_core.testing.fake_cuda import FakeCuda

H = 4
CPU = torch.device("cpu")


# -- the pool's rule ------------------------------------------------------------------------
def test_a_buffer_is_reused_only_when_nothing_holds_it():
    pool = BufferPool()
    a = pool.take((3, H), torch.float32, CPU)
    b = pool.take((3, H), torch.float32, CPU)  # a is held: another buffer
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    ptr = a.untyped_storage().data_ptr()
    kept = a[1:, :2]  # a view of a view keeps the storage as the tensor did
    del a, b
    c = pool.take((2, H), torch.float32, CPU)
    assert c.untyped_storage().data_ptr() != ptr and pool.allocations == 2
    del kept, c
    d = pool.take((4, H), torch.float32, CPU)  # let go: reused (rows rounded up to 4)
    assert d.untyped_storage().data_ptr() == ptr
    assert pool.allocations == 2 and d.shape == (4, H) and d.is_contiguous()


def test_the_pool_grows_a_buffer_and_keeps_at_most_keep():
    pool = BufferPool(keep=2)
    x = pool.take((3,), torch.long, CPU)
    del x
    pool.take((4,), torch.long, CPU)  # 3 rounded up to 4: fits
    assert pool.allocations == 1
    pool.take((5,), torch.long, CPU)  # grown to 8, the small one let go
    assert pool.allocations == 2
    held = [pool.take((1,), torch.long, CPU) for _ in range(3)]  # two pooled, one not
    assert pool.unpooled == 1 and pool.allocations == 4
    del held
    again = [pool.take((1,), torch.long, CPU) for _ in range(2)]
    assert pool.allocations == 4 and len(again) == 2
    with pytest.raises(ValueError, match="keep must be at least 1, got 0"):
        BufferPool(keep=0)


def test_a_buffer_moved_to_another_stream_is_reused_after_the_work_of_its_last_one():
    """Written on one stream, let go, taken on another: the new stream waits for an event
    of the old one first (without it the two writes race)."""
    with FakeCuda(order=True) as fc:
        pool = BufferPool()
        side = torch.cuda.Stream()
        with fc.steps():
            with torch.cuda.stream(side):
                pool.take((8, H), torch.float32, fc.device).fill_(1.0)
            pool.take((8, H), torch.float32, fc.device).fill_(2.0)
    assert pool.allocations == 1
    assert fc.findings(None, "race") == []


# -- gathers and indices ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.long, torch.bool])
def test_gathers_into_the_pool_equal_index_select(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(9, 5, generator=g) * 5).to(dtype)
    buffers = StepIndices()
    for idx in (np.array([4, 0, 4, 8]), np.arange(9), np.zeros(0, np.int64), np.array([3])):
        want = t.index_select(0, torch.from_numpy(idx))
        got = buffers.gather(t, idx)
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
        assert torch.equal(got, want)
    tokens = torch.arange(9) * 3
    assert torch.equal(buffers.gather(tokens, np.array([2, 1])), torch.tensor([6, 3]))


def test_the_staging_ring_is_rewritten_only_after_its_copy_ran():
    """Every plan is one copy from a pinned staging buffer; with a ring of 2 over 6 plans,
    each buffer is refilled only after the event of its last copy (without that check the
    host's refill races the copy still reading it), and the indices equal the host's."""
    with FakeCuda(order=True) as fc:
        buffers = StepIndices(ring=2)
        with fc.steps():
            for step in range(6):
                arrays = [np.arange(step + 2), np.array([step, 0]), np.arange(step + 2)]
                buffers.plan(arrays, fc.device)
                a, b, c = (buffers.index(x, fc.device) for x in arrays)
                assert a.shape == (step + 2,) and b.shape == (2,) and a is c  # equal ones once
                torch.zeros(9, device=fc.device).index_select(0, a)
                del a, b, c  # the next plan reuses their device buffer
        assert buffers.copies == 6 and buffers.waits == 0
        buffers.index(np.array([7]), fc.device)  # not planned: sent alone
        assert buffers.copies == 7
    assert fc.findings(None, "race") == [] and fc.findings(kind="pageable_copy") == []


def test_guided_counts_with_the_pool_equal_those_without():
    rows = [torch.tensor([0, 3, 1]), torch.tensor([2, 0]), torch.zeros(0, dtype=torch.long)]
    plain, pooled = GuidedCounts(), GuidedCounts(BufferPool())
    for c in rows:
        plain.add(c)
        pooled.add(c)
    for counts in (plain, pooled):
        counts.add_empty(torch.tensor([float("-inf"), -1e30, float("nan")]))
    assert plain.drain() == pooled.drain() == (3, 6, 2)


# -- bundles through the runtime --------------------------------------------------------------
class Keeper(Consumer):
    """Keeps what each bundle hands it: the whole bundle, or (``part``) a slice of each
    tensor only, dropping the bundle."""

    name = "keeper"
    part = False

    def __init__(self, config, context):
        super().__init__(config, context)
        self.kept = []

    def reads(self):
        return [HiddenStates(0, Phase.ALL), HiddenStates(1, Phase.DECODE), SampledTokens()]

    def on_bundle(self, bundle):
        if self.part:
            self.kept.append(
                {
                    "layer.0": bundle.hidden["layer.0"][1:, :2],
                    "tokens": bundle.rows.token_ids[-1:],
                    "sampled": bundle.sampled_token_ids[:1],
                }
            )
        else:
            self.kept.append(bundle)


class Dropper(Keeper):
    """Keeps nothing."""

    name = "dropper"

    def on_bundle(self, bundle):
        pass


class _Plugin:
    @hookimpl
    def tllm_consumers(self):
        return [Keeper, Dropper]


def _runtime(name: str) -> Runtime:
    reg = Registry()
    reg.register(_Plugin(), name="keeper-plugin")
    settings = RuntimeSettings.model_validate({"consumers": [{"name": name}]})
    model = ModelInfo(H, 2, 10, torch.float32, CPU, lambda h: h, None)
    return Runtime(settings, model, reg)


def _step(rt: Runtime, value: float, stale: str | None = None) -> tuple:
    """A step of two requests (one finishing its 3-token prompt, one decoding), every tap
    and token id filled with ``value``; ``stale``: a tap the forward did not stamp."""
    reqs = [RequestInfo("a-x", "a", 0, 0, 3), RequestInfo("b-x", "b", 1, 0, 1)]
    layout = StepLayout(
        engine_ids=["a-x", "b-x"],
        num_scheduled=np.array([3, 1]),
        num_computed=np.array([0, 2]),
        num_tokens=np.array([3, 3]),
        token_ids=torch.full((4,), int(value)),
    )
    rows, srow, kept = layout_rows(layout, reqs)
    n = rt.step_index + 1
    tensors = {"sampled": torch.full((2,), int(value))}
    stamps = {}
    for t in rt.taps:
        if t.layer is not None:
            tensors[t.key] = torch.full((4, H), value) + torch.arange(4.0)[:, None]
            stamps[t.key] = torch.tensor([n - 1 if t.key == stale else n])
    return rows, StepCapture(n, rows, srow, kept, tensors, stamps)


def _run(rt: Runtime, value: float) -> StepCapture:
    rows, step = _step(rt, value)
    rt.begin_step(rows, {})
    rt.end_step(step)
    return step


def test_a_bundle_its_consumer_keeps_holds_its_values_after_later_steps():
    """Bundles a consumer keeps are not overwritten by later steps' gathers (the pool takes
    other buffers while they are held); seen failing with a pool that reuses regardless."""
    rt = _runtime("keeper")
    steps = [_run(rt, float(v)) for v in range(1, 5)]
    kept = rt.slots[0].consumer.kept
    assert len(kept) == 4
    for b, step in zip(kept, steps, strict=True):
        assert torch.equal(b.hidden["layer.0"], step.tensors["residual.0"])
        assert torch.equal(b.hidden["layer.1"], step.tensors["residual.1"])  # phases merged
        assert torch.equal(b.rows.token_ids, step.rows.token_ids)
        assert torch.equal(b.sampled_token_ids, step.tensors["sampled"])
        assert torch.equal(b.sampled_rows.token_ids, step.rows.token_ids[[2, 3]])


def test_a_slice_a_consumer_keeps_holds_its_values_after_later_steps(monkeypatch):
    monkeypatch.setattr(Keeper, "part", True)
    rt = _runtime("keeper")
    steps = [_run(rt, float(v)) for v in range(1, 5)]
    for part, step in zip(rt.slots[0].consumer.kept, steps, strict=True):
        assert torch.equal(part["layer.0"], step.tensors["residual.0"][1:, :2])
        assert torch.equal(part["tokens"], step.rows.token_ids[-1:])
        assert torch.equal(part["sampled"], step.tensors["sampled"][:1])


def test_a_consumer_that_keeps_nothing_lets_the_runtime_reuse_every_buffer():
    rt = _runtime("dropper")
    _run(rt, 1.0)
    made = rt._buffers.pool.allocations
    for v in range(2, 6):
        _run(rt, float(v))
    assert made > 0 and rt._buffers.pool.allocations == made


@pytest.mark.parametrize("in_flight", [False, True], ids=["stamps_read", "stamps_in_flight"])
def test_bundles_cut_into_the_runtime_buffers_equal_the_plain_ones(monkeypatch, in_flight):
    """build_bundle with the runtime's buffers (pooled gathers, NaN rows of a stale tap
    marked in a pooled flag) hands out the same values as without them."""
    rt = _runtime("keeper")
    plan = rt.slots[0].reads
    rows, step = _step(rt, 3.0, stale="residual.1")
    for t in step.tensors.values():
        if t.is_floating_point():
            t.normal_(generator=torch.Generator().manual_seed(1))

    def cut(buffers):
        again = StepCapture(step.step, rows, step.sample_token_row, step.sample_kept)
        again.tensors, again.stamps = dict(step.tensors), dict(step.stamps)
        stale, unchecked = [], [] if in_flight else None
        b = build_bundle(plan, again, None, lambda k, e: stale.append(k), unchecked, buffers)
        return b, stale, unchecked

    (plain, stale0, un0), (pooled, stale1, un1) = cut(None), cut(StepIndices())
    assert (stale0, un0) == (stale1, un1) and (stale0 or un0)
    assert plain.hidden.keys() == pooled.hidden.keys() and plain.per_sample.keys() == {"sampled"}
    assert torch.equal(plain.hidden["layer.0"], pooled.hidden["layer.0"])
    if in_flight:  # the stale tap's rows: NaN in both
        assert plain.hidden["layer.1"].isnan().all() and pooled.hidden["layer.1"].isnan().all()
        assert not pooled.hidden["layer.0"].isnan().any()
    assert torch.equal(plain.per_sample["sampled"], pooled.per_sample["sampled"])
    for a, b in ((plain.rows, pooled.rows), (plain.sampled_rows, pooled.sampled_rows)):
        assert torch.equal(a.token_ids, b.token_ids) and a.requests == b.requests
        for f in ("row", "position", "is_decode", "recomputed", "mid_prefill"):
            assert np.array_equal(getattr(a, f), getattr(b, f)), f

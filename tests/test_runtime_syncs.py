"""The runtime's own host syncs in a step (begin_step, end_step: rows, reads, the step's
stamps), counted on CPU. The step's tensors live on the ``meta`` device, so a copy between
host and "device" is a real one that ``benchmarks/sync_count.py`` sees, and a read of a
device value that the code did not mean to make fails (a meta tensor has no values). The one
intended read, the step's stamps (``StepCapture.confirm``), is counted by a stand-in for
``Tensor.cpu`` that answers with the step number."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_core_ports import H, _model, _runtime

from tllm_core import Consumer, HiddenStates, Phase, SamplerGuide, hookimpl
from tllm_core.api.rows import RequestInfo, StepLayout, index_to, layout_rows
from tllm_core.api.step import StepCapture
from tllm_core.plugins.registry import Registry
from tllm_core.runtime.runtime import Runtime
from tllm_core.runtime.settings import RuntimeSettings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from sync_count import SyncCounter  # noqa: E402

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


def _meta_step(rt, decode: int) -> tuple:
    """A decode step of ``decode`` requests, its tensors on the meta device."""
    reqs = [RequestInfo(f"r{i}-abcdefgh", f"r{i}", i, 0, 2) for i in range(decode)]
    layout = StepLayout(
        engine_ids=[r.engine_id for r in reqs],
        num_scheduled=np.ones(decode, np.int64),
        num_computed=np.full(decode, 2),
        num_tokens=np.full(decode, 3),
        token_ids=torch.zeros(decode, dtype=torch.long, device=META),
    )
    rows, srow, kept = layout_rows(layout, reqs)
    n = rt.step_index + 1
    tensors, stamps = {"sampled": torch.zeros(decode, dtype=torch.long, device=META)}, {}
    for t in rt.taps:
        if t.layer is not None:
            tensors[t.key] = torch.zeros(decode, H, device=META)
            stamps[t.key] = torch.zeros(1, dtype=torch.long, device=META)
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
    """Guides without changing anything, reading the first layer's state at its rows."""

    name = "looker"

    def reads(self):
        return [HiddenStates(0, Phase.DECODE)]

    def writes(self):
        return [SamplerGuide()]

    def guide(self, view):
        view.hidden("layer.0")


class _LookerPlugin:
    @hookimpl
    def tllm_consumers(self):
        return [Looker]


def test_runtime_guide_reads_the_device_once_more(device_reads):
    """A step with a guiding consumer (its read of the step's states, the view, the guided
    counts): one read more, the counts that decide whether vLLM's own call goes on."""
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
            rt.guide(step, logits, torch.ones(3, device=META), np.ones(3, bool), False)
            rt.end_step(step)
        assert dict(sc.kinds) == {} and device_reads.count - before == 2
    # The guide ran (it read its states without an error; the counts it returned are the
    # stand-in's, not the view's).
    snap = rt.counters.snapshot()
    assert snap["rows_guide_visited"] == 6 and "consumer_errors" not in snap, snap


def test_index_copies_do_not_wait_for_the_device():
    idx = np.array([2, 0])
    with SyncCounter() as sc:
        t = index_to(idx, META)
    assert t.device == META and t.dtype == torch.long and not sc.kinds
    with SyncCounter() as sc:
        torch.from_numpy(idx).to(META)  # what the runtime did before: a blocking copy
    assert sc.kinds == {"host_device_copy": 1}

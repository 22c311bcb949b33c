"""The CUDA distiller's host logic on CPU tensors (``tests/cuda_stubs.py``: streams and
events stand in, a graph replay re-runs its captured body on the same static buffers):
row plans, layouts for long groups, batches, the result ring read back in the background and
the in-graph 'zero_output' convention, all against the CPU distiller's math."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cuda_stubs import install

from algorithms.esamp.cpu import GroupedDistiller
from algorithms.esamp.cuda import CudaGroupedDistiller

H, INTER = 32, 16


@pytest.mark.parametrize(
    "graph, max_rows, zero_output",
    [(True, 12, False), (True, 40, True), (False, 12, True), (False, 40, False)],
    ids=["graphs", "graphs-longer_groups-zero_output", "eager-zero_output", "eager-longer_groups"],
)
def test_cuda_distiller_matches_the_cpu_math(monkeypatch, graph, max_rows, zero_output):
    install(monkeypatch)
    kw = dict(intermediate_size=INTER, lr=1e-2, capacity=8, init="zero" if zero_output else "paper")
    cpu = GroupedDistiller(H, **kw)
    gpu = CudaGroupedDistiller(
        H, device="cpu", use_cuda_graph=graph, graph_max_rows=8, zero_output=zero_output, **kw
    )
    assert (gpu.graph is not None) == graph
    rng = np.random.default_rng(0)
    live: list[int] = []
    for step in range(16):
        if len(live) < 5 and step % 3 == 0:
            s = cpu.alloc()
            assert gpu.alloc() == s
            live.append(s)
        if step == 12:  # free one: its slot is reset and reused by the next alloc
            s = live.pop(0)
            cpu.free(s)
            gpu.free(s)
        r = int(rng.integers(1, max_rows))
        slots = torch.tensor(rng.choice(live, size=r))
        x, t = torch.randn(r, H), torch.randn(r, H) * 3
        if step == 7:
            x[0, 0] = float("nan")  # that group's step is skipped on both
        # The CPU reference of 'zero_output' (what Shared does on CPU): target + x, f - x.
        a = cpu.train_step(slots, x, t + x if zero_output else t)
        b = gpu.train_step(slots, x, t)
        xq = torch.randn(r, H)
        pa = cpu.predict(slots, xq) - (xq if zero_output else 0)
        pb = gpu.predict(slots, xq).clone()
        assert not b.ready() or step % 32 == 31  # results come back in batches
        gpu.synchronize()
        assert b.ready() and a.slots.tolist() == b.slots.tolist()
        assert a.updated.tolist() == b.updated.tolist(), step
        fin = a.updated
        torch.testing.assert_close(b.losses[fin], a.losses[fin], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pb, pa, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gpu.theta, cpu.theta[:8], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gpu.step, cpu.step[:8])
    assert gpu.staleness_max() == 0 and gpu.results.host_waits == 0
    # One update batch a step, two where a step's groups fit no single layout.
    assert gpu.results._next >= 16
    assert gpu.eager_updates == (0 if graph else gpu.results._next)


def test_results_arrive_without_waiting_every_32_updates(monkeypatch):
    install(monkeypatch)
    d = CudaGroupedDistiller(H, device="cpu", intermediate_size=INTER, capacity=2)
    s = d.alloc()
    res = [d.train_step(torch.tensor([s, s]), torch.randn(2, H), torch.randn(2, H))]
    for _ in range(31):
        d.poll()
        assert not res[0].ready()  # nothing copied back yet: nothing waited for
        res.append(d.train_step(torch.tensor([s]), torch.randn(1, H), torch.randn(1, H)))
    d.poll()  # the 32nd update started a background copy; its event has "completed"
    assert all(r.ready() for r in res) and all(bool(r.updated.all()) for r in res)
    assert d.results.host_waits == 0


def test_a_step_larger_than_the_packed_rows_is_refused_by_name(monkeypatch):
    install(monkeypatch)
    d = CudaGroupedDistiller(H, device="cpu", intermediate_size=INTER, capacity=2, graph_max_rows=2)
    s = d.alloc()
    with pytest.raises(ValueError, match="5 rows exceeds .* 4 packed rows"):
        d.predict(torch.full((5,), s), torch.randn(5, H))


def test_bf16_moments_are_stored_in_bf16_and_train_as_fp32_does(monkeypatch):
    """cuda_adam_moments bfloat16: m and v are bf16 (half the memory, counted per group),
    the update is computed in fp32 and its losses stay within 2% of fp32 moments'."""
    install(monkeypatch)
    kw = dict(intermediate_size=INTER, lr=1e-2, capacity=2, device="cpu")
    f32 = CudaGroupedDistiller(H, **kw)
    b16 = CudaGroupedDistiller(H, moments_dtype=torch.bfloat16, **kw)
    assert b16.m.dtype == b16.v.dtype == torch.bfloat16 and b16.theta.dtype == torch.float32
    p = f32.shape.num_params
    assert f32.memory_bytes_per_group() - b16.memory_bytes_per_group() == 4 * p
    s = [d.alloc() for d in (f32, b16)][0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, H, generator=g)
    t = x @ torch.randn(H, H, generator=g) * 0.3
    curves = {}
    for name, d in (("f32", f32), ("b16", b16)):
        res = [d.train_step(torch.full((8,), s), x, t) for _ in range(30)]
        d.synchronize()
        curves[name] = torch.stack([r.losses[0] for r in res])
    assert curves["f32"][-1] < 0.5 * curves["f32"][0]  # it learns
    torch.testing.assert_close(curves["b16"], curves["f32"], rtol=0.02, atol=0)
    assert not torch.equal(curves["b16"], curves["f32"])  # and the moments really are bf16

"""The CUDA distiller (side stream, CUDA-graph update) against the CPU math.

Skipped without CUDA; on a GPU, benchmarks/gpu_smoke.py runs these first (docs/gpu.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from algorithms.esamp.cpu import GroupedDistiller
from algorithms.esamp.cuda import CudaGroupedDistiller

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

H, INTER = 64, 32


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # compare fp32 math with fp32 math
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _pair(use_cuda_graph=True, **kw):
    kw = {"intermediate_size": INTER, "lr": 1e-2, "capacity": 8, **kw}
    gpu = CudaGroupedDistiller(
        H, device="cuda", use_cuda_graph=use_cuda_graph, graph_max_rows=16, **kw
    )
    return GroupedDistiller(H, **kw), gpu


@pytest.mark.parametrize("use_graph", [True, False])
def test_cuda_matches_cpu(use_graph):
    cpu, gpu = _pair(use_cuda_graph=use_graph)
    assert isinstance(gpu, CudaGroupedDistiller)
    # The one update graph (dense over the 8 slots, 16 rows each) was captured at
    # construction.
    if use_graph:
        assert gpu.graph is not None and gpu.graph_failures == 0
    mem = torch.cuda.memory_allocated()
    rng = np.random.default_rng(0)
    live: list[int] = []
    for step in range(30):
        if len(live) < 5 and step % 3 == 0:
            s = cpu.alloc()
            assert gpu.alloc() == s
            live.append(s)
        if step == 20:  # free one, its slot is reused by the next alloc
            s = live.pop(0)
            cpu.free(s)
            gpu.free(s)
        r = int(rng.integers(1, 12))
        slots = torch.tensor(rng.choice(live, size=r))
        x, t = torch.randn(r, H), torch.randn(r, H) * 3
        if step == 7:
            x[0, 0] = float("nan")  # that group's step is skipped on both
        a = cpu.train_step(slots, x, t)
        b = gpu.train_step(slots, x.cuda(), t.cuda())
        xq = torch.randn(r, H)
        pa, pb = cpu.predict(slots, xq), gpu.predict(slots, xq.cuda())
        gpu.synchronize()
        assert a.slots.tolist() == b.slots.tolist()
        assert a.updated.tolist() == b.updated.cpu().tolist()
        fin = a.updated
        torch.testing.assert_close(b.losses.cpu()[fin], a.losses[fin], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pb.cpu(), pa, rtol=1e-4, atol=1e-4)
    cap = cpu.capacity
    torch.testing.assert_close(gpu.theta[:cap].cpu(), cpu.theta, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gpu.step[:cap].cpu(), cpu.step)
    assert gpu.capacity == 8 and gpu.eager_updates == (0 if use_graph else 30)
    assert gpu.staleness_max() == 0
    # Nothing was allocated for the update during the run (the graphs' pool is warm).
    assert torch.cuda.memory_allocated() - mem < 2**20


def test_cuda_capacity_is_fixed_and_capture_failures_are_loud(monkeypatch, caplog):
    _, gpu = _pair(capacity=2)
    gpu.alloc(), gpu.alloc()
    with pytest.raises(RuntimeError, match="capacity is fixed"):
        gpu.alloc()

    def broken(*a, **k):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(torch.cuda, "graph", broken)
    with caplog.at_level("WARNING", logger="tllm"):
        _, bad = _pair(capacity=2)
    assert bad.graph_failures == 1 and bad.graph is None
    assert "capture failed" in caplog.text
    s = bad.alloc()
    res = bad.train_step(torch.tensor([s, s]), torch.randn(2, H).cuda(), torch.randn(2, H).cuda())
    bad.synchronize()
    assert bool(res.updated.all()) and bad.eager_updates == 1


def test_cuda_free_cycles_bounded():
    _, gpu = _pair(capacity=4)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(200):
        s = gpu.alloc()
        gpu.train_step(
            torch.tensor([s, s, s]),
            torch.randn(3, H, device="cuda"),
            torch.randn(3, H, device="cuda"),
        )
        gpu.free(s)
    gpu.synchronize()
    assert gpu.num_live == 0 and gpu.capacity == 4
    assert not gpu.m[:4].any() and not gpu.step[:4].any()
    # Only the (one) captured graph's buffers may have been added.
    assert torch.cuda.memory_allocated() - before < 16 * 2**20


def test_cuda_consumer_runs():
    pytest.importorskip("pydantic", reason="the consumer needs pydantic (the GPU image lacks it)")
    from algorithms.esamp.config import ESampConfig
    from algorithms.esamp.consumer import ESampConsumer
    from tllm_core.api.bundles import Bundle, GuideView
    from tllm_core.api.consumer import ConsumerContext, ModelInfo
    from tllm_core.api.ports import resolve_layer
    from tllm_core.api.rows import RequestInfo, RowInfo

    dev = torch.device("cuda")
    w = torch.randn(100, H, device=dev, dtype=torch.bfloat16)
    model = ModelInfo(H, 4, 100, torch.bfloat16, dev, lambda z: z @ w.t(), w)
    c = ESampConsumer(
        ESampConfig(intermediate_size=INTER),
        ConsumerContext(model, lambda i: resolve_layer(i, 4)),
    )
    reqs = [RequestInfo(f"{p}-{s}", f"r{p}", p, s, 3) for p in range(2) for s in range(4)]
    n = len(reqs)
    rows = RowInfo(
        np.arange(n),
        reqs,
        np.full(n, 5),
        np.ones(n, bool),
        np.zeros(n, bool),
        torch.zeros(n, dtype=torch.long, device=dev),
    )
    for t in range(5):
        hidden = {
            "layer.0": torch.randn(n, H, device=dev, dtype=torch.bfloat16),
            "final": torch.randn(n, H, device=dev, dtype=torch.bfloat16),
        }
        logits = torch.randn(n, 100, device=dev)
        logits = logits.masked_fill(logits < logits.topk(10, -1).values[:, -1:], float("-inf"))
        view = GuideView(
            t, rows, logits.clone(), torch.ones(n, device=dev), np.ones(n, bool), True, hidden
        )
        c.guide(view)
        assert not torch.equal(view.logits, logits)
        if t < 4:
            c.on_bundle(Bundle(t, rows, hidden))
            continue
        # Steady state (graph already captured for this shape): training enqueues work only,
        # without any host synchronisation.
        torch.cuda.set_sync_debug_mode("error")
        try:
            c.on_bundle(Bundle(t, rows, hidden))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    res = c.result()
    assert res["counters"]["optimizer_steps"] == 10 and res["loss_mean"] > 0
    assert res["counters"]["graph_failures"] == 0 and res["counters"]["staleness_max"] == 0
    for r in reqs:
        c.on_request_finished(r)
    assert c.counters.get("groups_alive") == 0


def test_cuda_long_groups_replay_their_layout_and_match_cpu():
    """n = 40 > cuda_graph_max_rows 16: the 2 x 64 layout's graphs on the same buffers,
    equal to the CPU math, nothing allocated per step."""
    cpu, gpu = _pair()
    s = cpu.alloc()
    assert gpu.alloc() == s
    torch.cuda.synchronize()
    mem = torch.cuda.memory_allocated()
    for _ in range(3):
        x, t = torch.randn(40, H), torch.randn(40, H)
        a = cpu.train_step(torch.full((40,), s), x, t)
        b = gpu.train_step(torch.full((40,), s), x.cuda(), t.cuda())
        gpu.synchronize()
        torch.testing.assert_close(b.losses, a.losses, rtol=1e-4, atol=1e-5)
    assert gpu.eager_updates == 0 and gpu.graph_failures == 0
    assert torch.cuda.memory_allocated() - mem < 2**20


def test_cuda_distiller_memory_within_its_plan():
    """What the distiller holds after construction (state, buffers, graph pool, the side
    stream's cuBLAS workspace) stays within the plan's terms for it."""
    from algorithms.esamp import memory_plan as mp

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    d = CudaGroupedDistiller(H, device="cuda", intermediate_size=INTER, capacity=8)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    plan = mp.plan_memory(
        H, 100, slots=8, graph_rows=16, rows_per_step=128, intermediate_size=INTER
    )
    bound = plan.total_bytes - plan.guidance_workspace_bytes
    assert held <= bound, (held, plan.describe())
    d.close()

"""The CUDA distiller's host logic on CPU tensors (``FakeCuda(device="cpu")``: streams and
events stand in, a graph replay runs its captured operations again on the same tensors):
row plans, layouts for long groups, batches, the result ring read back in the background and
the in-graph 'zero_output' convention, all against the CPU distiller's math."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from esamp_kernel_helpers import interpreted_kernels

from algorithms.esamp.cpu import GroupedDistiller
from algorithms.esamp.cuda import CudaGroupedDistiller
from algorithms.esamp.slots import make_packing

H, INTER = 32, 16


@pytest.mark.parametrize(
    "graph, max_rows, zero_output",
    [(True, 12, False), (True, 40, True), (False, 12, True), (False, 40, False)],
    ids=["graphs", "graphs-longer_groups-zero_output", "eager-zero_output", "eager-longer_groups"],
)
@pytest.mark.usefixtures("cuda_on_cpu")
def test_cuda_distiller_matches_the_cpu_math(monkeypatch, graph, max_rows, zero_output):
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
        # The CPU reference of 'zero_output', written out: target + x, f - x.
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


@pytest.mark.usefixtures("cuda_on_cpu")
def test_results_arrive_without_waiting_every_32_updates(monkeypatch):
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


@pytest.mark.usefixtures("cuda_on_cpu")
def test_a_step_larger_than_the_packed_rows_is_refused_by_name(monkeypatch):
    d = CudaGroupedDistiller(H, device="cpu", intermediate_size=INTER, capacity=2, graph_max_rows=2)
    s = d.alloc()
    with pytest.raises(ValueError, match="5 rows exceeds .* 4 packed rows"):
        d.predict(torch.full((5,), s), torch.randn(5, H))


@pytest.mark.usefixtures("cuda_on_cpu")
def test_bf16_moments_are_stored_in_bf16_and_train_as_fp32_does(monkeypatch):
    """cuda_adam_moments bfloat16: m and v are bf16 (half the memory, counted per group),
    the update is computed in fp32 and its losses stay within 2% of fp32 moments'."""
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


def _twins(graph: bool = True, **kw) -> tuple[CudaGroupedDistiller, ...]:
    """Two CUDA distillers from the same init, each with slots 0, 1, 2 live."""
    kw = dict(intermediate_size=INTER, lr=1e-2, capacity=4, graph_max_rows=8, **kw)
    pair = tuple(CudaGroupedDistiller(H, device="cpu", use_cuda_graph=graph, **kw) for _ in "ab")
    for d in pair:
        assert [d.alloc() for _ in range(3)] == [0, 1, 2]
    return pair


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN where NaN."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _same_state(a: CudaGroupedDistiller, b: CudaGroupedDistiller) -> bool:
    return all(_equal(getattr(a, k), getattr(b, k)) for k in ("theta", "m", "v", "step", "applied"))


@pytest.mark.parametrize("graph", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("zero_output", [False, True], ids=["plain", "zero_output"])
@pytest.mark.usefixtures("cuda_on_cpu")
def test_an_update_of_the_predicted_rows_reuses_their_forward_bit_for_bit(
    monkeypatch, graph, zero_output
):
    """predict(rows_id) then train_step(same rows_id) skips the update's forward (the
    'train_reuse' graph reads the prediction's kept activations): losses, parameters and
    Adam state equal, bit for bit, those of a twin that runs the forward again, over steps
    with short groups, a long group (another layout) and a non-finite row."""
    reuse, fresh = _twins(graph, zero_output=zero_output)
    rng = np.random.default_rng(1)
    slot_sets = [[0, 1, 2], [2, 0], [1] * 12, [0, 1, 2, 1, 0], [2], [0, 1]]
    for step, slots in enumerate(slot_sets):
        r = len(slots)
        slots = torch.tensor(rng.permutation(slots))
        x, t = torch.randn(r, H), torch.randn(r, H) * 3
        if step == 3:
            x[1, 0] = float("nan")  # that group is skipped by both
        pr = reuse.predict(slots, x, rows_id=("step", step)).clone()
        pf = fresh.predict(slots, x).clone()
        a = reuse.train_step(slots, x, t, rows_id=("step", step))
        b = fresh.train_step(slots, x, t)
        reuse.synchronize(), fresh.synchronize()
        assert _equal(pr, pf) and a.updated.tolist() == b.updated.tolist()
        assert _equal(a.losses, b.losses), step
        assert _same_state(reuse, fresh), step
        assert reuse.updates_reusing_prediction == step + 1  # it did reuse
    assert fresh.updates_reusing_prediction == 0
    assert reuse.eager_updates == fresh.eager_updates == (0 if graph else len(slot_sets))


@pytest.mark.usefixtures("cuda_on_cpu")
def test_an_update_of_other_rows_or_after_a_change_runs_its_own_forward(monkeypatch):
    """No reuse unless the prediction's forward is provably the update's: other rows (the
    caller's rows_id differs, or it gives none), another packing, or a parameter change in
    between (another update, a slot reset) each run the forward again, with the result of a
    twin that never reuses."""
    reuse, fresh = _twins()
    gen = torch.Generator().manual_seed(2)
    slots = torch.tensor([0, 1, 0, 2])
    rnd = lambda: torch.randn(4, H, generator=gen)  # noqa: E731

    def both_train(s, x, t, rows_id) -> None:
        a = reuse.train_step(s, x, t, rows_id=rows_id)
        b = fresh.train_step(s, x, t)
        reuse.synchronize(), fresh.synchronize()
        assert _equal(a.losses, b.losses) and _same_state(reuse, fresh)

    cases = {
        "other rows": lambda x: (slots, x + 1, "A", "B"),  # greedy rows, prefill, ...
        "no rows_id at train": lambda x: (slots, x, "A", None),
        "other packing": lambda x: (torch.tensor([0, 1, 2, 2]), x, "A", "A"),
        "an update in between": lambda x: (slots, x, "A", "A"),
        "a slot reset in between": lambda x: (slots, x, "A", "A"),
        "another prediction in between": lambda x: (slots, x, "A", "A"),
    }
    for name, case in cases.items():
        x = rnd()
        s_train, x_train, id_pred, id_train = case(x)
        reuse.predict(slots, x, rows_id=id_pred)
        fresh.predict(slots, x)
        if name == "an update in between":  # e.g. a warm start's step
            both_train(torch.tensor([1]), rnd()[:1], rnd()[:1], None)
        if name == "a slot reset in between":
            for d in (reuse, fresh):
                d.free(2)
                assert d.alloc() == 2
        if name == "another prediction in between":
            reuse.predict(slots, rnd())
            fresh.predict(slots, rnd())
        both_train(s_train, x_train, rnd(), id_train)
        assert reuse.updates_reusing_prediction == 0, name
    # And the same steps with matching ids do reuse (the cases above were the only cause).
    x = rnd()
    reuse.predict(slots, x, rows_id="A"), fresh.predict(slots, x)
    both_train(slots, x, rnd(), "A")
    assert reuse.updates_reusing_prediction == 1


def _esamp_on_cpu_cuda(monkeypatch, r: int):
    """The ESamp consumer taking the CUDA path on CPU tensors (stubbed streams and graphs),
    and a step's guide view and bundle (same step, same rows)."""
    import algorithms.esamp.factory as factory
    from algorithms.esamp.config import ESampConfig
    from algorithms.esamp.consumer import ESampConsumer
    from tllm_core.api.bundles import Bundle, GuideView
    from tllm_core.api.consumer import ConsumerContext, ModelInfo
    from tllm_core.api.ports import resolve_layer
    from tllm_core.api.rows import RequestInfo, RowInfo

    monkeypatch.setattr(factory, "uses_gpu_path", lambda device: True)
    v = 64
    w = torch.randn(v, H)
    model = ModelInfo(H, 4, v, torch.float32, torch.device("cpu"), lambda z: z @ w.t(), w)
    cfg = ESampConfig(intermediate_size=INTER, cuda_rows_per_step=r, cuda_graph_max_rows=8)
    c = ESampConsumer(cfg, ConsumerContext(model, lambda i: resolve_layer(i, 4)))
    assert isinstance(c.distiller, CudaGroupedDistiller)
    reqs = [RequestInfo(f"{p}-{s}", f"r{p}", p, s, 3) for p in range(2) for s in range(r // 2)]
    rows = RowInfo(
        np.arange(r), reqs, np.full(r, 5), np.ones(r, bool), np.zeros(r, bool), torch.zeros(r)
    )

    def step(t: int, is_random: np.ndarray, gen: torch.Generator) -> tuple[GuideView, Bundle]:
        hidden = {k: torch.randn(r, H, generator=gen) for k in ("layer.0", "final")}
        logits = torch.randn(r, v, generator=gen)
        view = GuideView(t, rows, logits, torch.ones(r), is_random, False, hidden)
        return view, Bundle(t, rows, hidden)

    return c, step


@pytest.mark.usefixtures("cuda_on_cpu")
def test_the_consumer_reuses_the_guidance_forward_for_the_same_rows_only(monkeypatch):
    """ESamp on the CUDA path: a step whose trained rows are the guided rows counts
    updates_reusing_prediction; a step with a greedy row (trained, not guided) does not. The
    parameters equal, bit for bit, those of a consumer that never reuses."""
    r = 8
    consumers = [_esamp_on_cpu_cuda(monkeypatch, r) for _ in range(2)]
    consumers[1][0].distiller._key = lambda *a: None  # never names rows: never reuses
    greedy = np.ones(r, bool)
    greedy[3] = False
    plan = [np.ones(r, bool), np.ones(r, bool), greedy, np.ones(r, bool)]
    for c, step in consumers:
        gen = torch.Generator().manual_seed(5)
        for t, is_random in enumerate(plan):
            view, bundle = step(t, is_random, gen)
            c.guide(view)
            view.commit()
            c.on_bundle(bundle)
        c.trainer.flush()
    (reuse, _), (fresh, _) = consumers
    assert reuse.counters.get("updates_reusing_prediction") == 3  # not the greedy step
    assert fresh.counters.get("updates_reusing_prediction") == 0
    assert reuse.counters.get("optimizer_steps") == fresh.counters.get("optimizer_steps") > 0
    assert _same_state(reuse.distiller, fresh.distiller)


def test_the_kept_forward_through_the_triton_products_equals_the_plain_forward():
    """On CUDA the prediction writes its forward through the Triton product into views at an
    offset of one static buffer (``CudaGroupedDistiller.acts``): run under Triton's
    interpreter, it equals the forward into fresh tensors bit for bit, and the saved
    forward reads back the same activations."""
    kernels = interpreted_kernels()
    from algorithms.esamp.graph_update import slot_matmul
    from algorithms.esamp.kernels import op_slot_matmul
    from algorithms.esamp.mlp import forward_slots, saved_forward
    from algorithms.esamp.params import DistillerShape, init_params

    shape = DistillerShape(H, INTER, 2)
    theta = torch.stack([init_params(shape, "paper", seed=s) for s in range(3)])
    gs = torch.tensor([2, -1, 0])  # a padding group in the middle
    xp = torch.randn(3, 5, H)
    xp[1] = 0

    def mm(x, w, transpose_w, out=None, add=None):
        out = slot_matmul(x, w, gs, transpose_w) if out is None else out  # (its shape)
        op_slot_matmul.run_triton(
            x, w, gs, out, transpose_w, "ieee", 1, add, kernels=kernels, block_n=16, block_k=16
        )
        return out

    h, acts = forward_slots(theta, shape, xp, mm)
    flat = torch.full((2 * 3 * 5 * (H + 4 * INTER) + 7,), float("nan"))
    bufs, at = [], 7  # an odd offset, as a layout's views may have
    for _ in range(2):
        block = []
        for width in (H, INTER, INTER, INTER, INTER):
            block.append(flat[at : at + 15 * width].view(3, 5, width))
            at += 15 * width
        bufs.append(tuple(block))
    h_kept, acts_kept = forward_slots(theta, shape, xp, mm, out=bufs)
    h_read, acts_read = saved_forward(xp, bufs)
    assert torch.equal(h_kept, h) and torch.equal(h_read, h)
    for got in (acts_kept, acts_read):
        for blk, ref in zip(got, acts, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(blk, ref, strict=True))


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 1e30])
def test_the_graph_update_skips_exactly_the_groups_with_a_non_finite_loss_or_norm(bad):
    """The graph update's finiteness check (``x * 0 == 0``, fewer launches than isfinite):
    a group whose target holds inf, NaN or 1e30 (finite, but its square overflows: loss
    inf) keeps its state bit for bit; the others step."""
    from esamp_kernel_helpers import train_dense

    d = GroupedDistiller(H, intermediate_size=INTER, capacity=3)
    theta, m, v, step = (t.clone() for t in (d.theta, d.m, d.v, d.step))
    before = theta.clone()
    xp, tp = torch.randn(3, 4, H), torch.randn(3, 4, H)
    tp[1, 2, 5] = bad
    mask = torch.ones(3, 4, dtype=torch.bool)
    losses, ok = train_dense(theta, m, v, step, torch.ones(3, dtype=torch.bool), xp, tp, mask,
                             d.shape, d.hp)  # fmt: skip
    assert ok.tolist() == [True, False, True], (losses, ok)
    assert torch.equal(theta[1], before[1]) and not torch.equal(theta[0], before[0])
    assert step.tolist()[:3] == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("zero_output", [False, True])
@pytest.mark.usefixtures("cuda_on_cpu")
def test_cuda_row_errors_equal_the_cpu_distillers(zero_output):
    """``train_step(row_errors=True)``: the CUDA distiller's per-row errors (from the step's
    prediction when the update reuses it, else from one it runs first) equal the CPU
    distiller's (from the update's own forward), and each group's loss is the mean of its
    rows' errors."""
    kw = dict(intermediate_size=INTER, lr=1e-2, capacity=4, init="zero" if zero_output else "paper")
    cpu = GroupedDistiller(H, **kw)
    gpu = CudaGroupedDistiller(H, device="cpu", graph_max_rows=8, zero_output=zero_output, **kw)
    live = [cpu.alloc() for _ in range(3)]
    assert [gpu.alloc() for _ in range(3)] == live
    rng = np.random.default_rng(1)
    for step in range(6):
        r = int(rng.integers(2, 12))
        slots = torch.tensor(rng.choice(live, size=r))
        x, t = torch.randn(r, H), torch.randn(r, H) * 3
        reuse = step % 2 == 0  # the sampler predicted these rows (else: greedy rows)
        if reuse:
            gpu.predict(slots, x, rows_id=("step", step))
        a = cpu.train_step(slots, x, t + x if zero_output else t, row_errors=True)
        b = gpu.train_step(slots, x, t, rows_id=("step", step), row_errors=True)
        gpu.synchronize()
        assert b.ready() and a.row_errors.shape == b.row_errors.shape == (r,)
        torch.testing.assert_close(b.row_errors, a.row_errors, rtol=1e-4, atol=1e-5)
        groups = make_packing(slots).row_group
        means = [a.row_errors[torch.from_numpy(groups == g)].mean() for g in range(len(a.slots))]
        torch.testing.assert_close(torch.stack(means), a.losses, rtol=1e-5, atol=1e-6)
    assert gpu.updates_reusing_prediction == 3 and gpu.staleness_max() == 0

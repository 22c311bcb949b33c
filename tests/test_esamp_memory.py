"""ESamp's memory plan: the 7B defaults fit, the plan's exact terms equal the bytes of the
tensors the code allocates, its estimates bound what the CPU allocator measures, and a plan
over the device share is refused with its numbers. All on CPU (no GPU where this was
written)."""

from __future__ import annotations

import pytest
import torch

from algorithms.esamp import memory_plan as mp
from algorithms.esamp.config import ESampConfig
from algorithms.esamp.cpu import GroupedDistiller
from algorithms.esamp.cuda import CudaGroupedDistiller
from algorithms.esamp.graph_update import train_groups
from algorithms.esamp.mlp import batched_mm, forward_acts
from algorithms.esamp.params import block_weights
from tllm_core.testing.counters import cpu_peak_bytes

QWEN25_7B = dict(hidden_size=3584, vocab_size=152064)  # 28 layers: no term depends on them


def _config_plan(**cfg) -> mp.MemoryPlan:
    """The plan the consumer makes for a config (same defaults path)."""
    c = ESampConfig(**cfg)
    slots = c.max_groups or c.cuda_capacity
    slots = slots or mp.default_slots(c.cuda_rows_per_step, c.cuda_graph_max_rows)
    return mp.plan_memory(
        **QWEN25_7B,
        slots=slots,
        graph_rows=c.cuda_graph_max_rows,
        rows_per_step=c.cuda_rows_per_step,
        intermediate_size=c.intermediate_size,
        num_blocks=c.num_blocks,
    )


def test_7b_plan_at_batch_8x16_fits_in_1_5_gib():
    plan = _config_plan()  # defaults: 128 rows per step, groups of 16
    assert plan.slots == 8 and plan.graph_rows == 16 and plan.rows_per_step == 128
    assert plan.total_bytes <= 1.5 * mp.GIB, plan.describe()
    # The former defaults (64 slots, 64 rows per slot) would not.
    assert _config_plan(cuda_capacity=64, cuda_graph_max_rows=64).total_bytes > 6 * mp.GIB


def _tensor_bytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _all_tensors(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor an object holds, through its attributes, lists and nested objects."""
    seen = set() if seen is None else seen
    out = []
    items = vars(obj).values() if hasattr(obj, "__dict__") else obj
    for v in items:
        if isinstance(v, torch.Tensor):
            if v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                out.append(v)
        elif isinstance(v, (list, tuple)) or type(v).__module__.startswith("algorithms."):
            out += _all_tensors(v, seen)
    return out


@pytest.mark.parametrize("slots,rows,stats", [(3, 4, False), (5, 3, True)])
@pytest.mark.usefixtures("cuda_on_cpu")
def test_plan_exact_terms_equal_the_allocated_tensors(slots, rows, stats):
    h, inter = 48, 24
    d = CudaGroupedDistiller(
        h, device="cpu", intermediate_size=inter, capacity=slots, graph_max_rows=rows,
        optimizer_stats=stats,
    )  # fmt: skip
    plan = mp.plan_memory(
        h, 100, slots=slots, graph_rows=rows, rows_per_step=16, intermediate_size=inter,
        optimizer_stats=stats,
    )  # fmt: skip
    # Counted on the real objects, not from the formula: every device tensor the CUDA
    # distiller holds (the host-side plan and result copies are in tllm_core's transfer
    # rings, which _all_tensors does not enter).
    state = (d.theta, d.m, d.v, d.step, d.applied, d.template)
    assert plan.state_bytes == _tensor_bytes(*state)
    keys = {t.untyped_storage().data_ptr() for t in state}
    rest = [t for t in _all_tensors(d) if t.untyped_storage().data_ptr() not in keys]
    assert plan.inputs_bytes == _tensor_bytes(*rest)
    assert len(state) + len(rest) <= mp.ALLOCATIONS
    assert plan.params == d.shape.num_params


def test_plan_estimates_bound_the_measured_workspace():
    """The update's and the prediction's temporaries, measured by the CPU allocator, stay
    under the plan's estimates and are not far below them (an estimate that is ten times too
    large would hide a real regression)."""
    h, inter, slots, rows = 256, 64, 4, 8
    d = GroupedDistiller(h, intermediate_size=inter, capacity=slots)
    plan = mp.plan_memory(
        h, 100, slots=slots, graph_rows=rows, rows_per_step=32, intermediate_size=inter
    )
    xp, tp = torch.randn(2, slots, rows, h)
    mask = torch.ones(slots, rows, dtype=torch.bool)

    # The slot operations' own memory is the kernels' (Triton on CUDA: none; the PyTorch
    # forms gather weights): measured here is what the graph pool holds, the activations.
    def dense_mm(x, w, gs, t, out=None, add=None):
        if w.dim() == 4:  # gate and up of a block at once (graph_update's pairs)
            ys = [batched_mm(x if x.dim() == 3 else x[:, e], w[:, e], t) for e in range(2)]
            y = torch.stack(ys, 1) if x.dim() == 3 else ys[0] + ys[1]
        else:
            y = batched_mm(x, w, t)
        y = y if add is None else y + add
        return y if out is None else out.copy_(y)

    ops = (dense_mm, lambda *a, **kw: None)

    def update():
        with torch.inference_mode(False):
            gs = torch.arange(slots)
            train_groups(d.theta, d.m, d.v, d.step, gs, xp, tp, mask, d.shape, d.hp, ops=ops)

    update()  # first call: lazy one-time allocations out of the way
    used = cpu_peak_bytes(update)
    assert 0.5 * plan.update_workspace_bytes <= used <= plan.update_workspace_bytes, (
        used,
        plan.update_workspace_bytes,
    )

    def predict():
        with torch.no_grad():
            xp = torch.zeros(slots, rows, h)
            forward_acts(block_weights(d.theta, d.shape), xp)

    used = cpu_peak_bytes(predict)
    assert 0.3 * plan.predict_workspace_bytes <= used <= plan.predict_workspace_bytes, (
        used,
        plan.predict_workspace_bytes,
    )


def test_plan_over_the_device_share_is_refused_with_its_numbers():
    plan = _config_plan()
    mp.check_plan(plan, 80 * mp.GIB, 0.1)  # an 80 GiB card: fits
    with pytest.raises(ValueError) as err:
        mp.check_plan(plan, 8 * mp.GIB, 0.1)
    msg = str(err.value)
    assert f"{plan.total_bytes / mp.GIB:.3f} GiB" in msg and "1.039 GiB" in msg
    assert "8.00 GiB" in msg and "0.800 GiB" in msg and "cuBLAS workspaces 0.062 GiB" in msg
    assert "max_memory_fraction 0.1" in msg and "8 slots" in msg


def test_consumer_reports_its_plan_and_refuses_at_start(monkeypatch):
    from test_esamp_math import Fake

    fake = Fake()
    c = fake.consumer()
    res = c.result()
    plan = res["memory_plan"]
    assert plan["total_bytes"] == c.counters.get("memory_plan_bytes") > 0
    assert plan["device_bytes"] is None  # CPU: reported, not checked
    assert plan["slots"] == 8 and plan["max_memory_fraction"] == 0.1
    # A device whose share is too small: the consumer refuses before allocating.
    # (The cuBLAS workspaces and allocator rounding are fixed costs of 0.11 GiB.)
    monkeypatch.setattr("algorithms.esamp.consumer.device_total_bytes", lambda dev: 200 * 2**20)
    with pytest.raises(ValueError, match="max_memory_fraction"):
        fake.consumer()
    assert fake.consumer(max_memory_fraction=1.0)  # the tiny test model fits in 200 MiB


@pytest.mark.parametrize("diagnostics", [False, True], ids=["nodiag", "diag"])
@pytest.mark.parametrize("ablation", ["none", "noise", "f_noise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["post_filter", "full_vocab", "auto"])
def test_plan_guidance_term_equals_the_workspace_allocated(mode, dtype, ablation, diagnostics):
    """The CUDA guidance's workspace (built with the consumer) is the plan's guidance term
    to the byte: two allocations, every temporary of a guided step a view of them (that a
    step allocates nothing else is checked on the fake device, test_esamp_fake_cuda.py)."""
    from algorithms.esamp.consumer import ESampConsumer
    from tllm_core.api.consumer import ConsumerContext, ModelInfo
    from tllm_core.api.ports import resolve_layer

    h, v, r = 64, 1000, 24
    w = torch.randn(v, h).to(dtype)
    model = ModelInfo(h, 4, v, dtype, torch.device("cpu"), lambda z: z @ w.t(), w)
    cfg = ESampConfig(
        intermediate_size=32, mode=mode, cpu_update="inline", cuda_rows_per_step=r,
        cuda_max_candidates=9, ablation=ablation, diagnostics=diagnostics,
    )  # fmt: skip
    c = ESampConsumer(cfg, ConsumerContext(model, lambda i: resolve_layer(i, 4)), cuda_path=True)
    ws = c.guide_step.ws
    flats = (ws.flat, ws.view_buffers.flat)
    held = {t.untyped_storage().data_ptr() for t in flats}
    parts = [*ws.parts.values(), *ws.view_buffers.parts.values()]
    assert {t.untyped_storage().data_ptr() for t in parts} == held
    # Besides, only the host staging buffers (pinned on CUDA; in tllm_core's StagingRing,
    # which _all_tensors does not enter).
    assert [t for t in _all_tensors(ws) if t.untyped_storage().data_ptr() not in held] == []
    staging = ws._staging.buffers
    assert all(t is not None and t.numel() == ws.parts["stage"].numel() for t in staging)
    assert all(not t.is_cuda and not t.is_pinned() for t in staging) and len(staging) == 4
    # On CUDA the distiller has the plan's slots; the CPU one here grows, so its capacity.
    plan = mp.plan_memory(
        h, v, slots=c.distiller.capacity, graph_rows=16, rows_per_step=r, intermediate_size=32,
        max_candidates=9, mode=mode, dtype=dtype, noise=ablation != "none", diagnostics=diagnostics,
    )  # fmt: skip
    assert plan.guidance_workspace_bytes == _tensor_bytes(*flats)
    # The consumer's own plan (its default slots) has the same guidance term for its slots.
    own = mp.plan_memory(
        h, v, slots=c.memory_plan.slots, graph_rows=16, rows_per_step=r, intermediate_size=32,
        max_candidates=9, mode=mode, dtype=dtype, noise=ablation != "none", diagnostics=diagnostics,
    )  # fmt: skip
    assert c.memory_plan.guidance_workspace_bytes == own.guidance_workspace_bytes
    c.close()

"""``tllm_core.testing.fake_cuda``: CUDA-path code on a fake (meta) device, flagging host
waits, pageable copies, per-step allocations and a stream's first cuBLAS use, each at the
line that causes it; then the same check on ESamp's distillers as they are today."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tllm_core.testing.fake_cuda import FakeCuda

HERE = Path(__file__).name


def _line(fn) -> int:
    """The line of a one-statement function's body."""
    return fn.__code__.co_firstlineno + 1


def _run(fn, *setup_args):
    """``fn(fc, *tensors)`` as one step on a fresh fake device, each tensor made in
    construction by one of ``setup_args`` (called with ``fc``)."""
    with FakeCuda() as fc:
        made = [s(fc) for s in setup_args]
        with fc.step():
            fn(fc, *made)
    return fc


def _dev(*shape, dtype=torch.float32):
    return lambda fc: torch.zeros(*shape, dtype=dtype, device=fc.device)


def _only(fc, kind):
    found = fc.findings(kind=kind)
    assert len(found) == 1, [(f.kind, f.what, f.where) for f in fc.findings(phase=None)]
    return found[0]


# -- host waits ----------------------------------------------------------------------------
def item(fc, t):
    t.sum().item()


def as_int(fc, t):
    int(t[0])


def as_bool(fc, t):
    bool(t[0])


def cpu(fc, t):
    t.cpu()


def tolist(fc, t):
    t.tolist()


def to_numpy(fc, t):
    t.numpy()


def nonzero(fc, t):
    t.nonzero()


def unique(fc, t):
    t.unique()


def equal(fc, t):
    torch.equal(t, t)


def bincount(fc, t):
    torch.bincount(t.long())


def bool_mask(fc, t):
    t[t > 0]


def bool_mask_put(fc, t):
    t[t > 0] = torch.zeros((), device=fc.device)


def masked_select(fc, t):
    t.masked_select(t > 0)


def repeats(fc, t):
    t.repeat_interleave(t.long())


def stream_sync(fc, t):
    torch.cuda.Stream().synchronize()


def event_sync(fc, t):
    torch.cuda.Event().synchronize()


def device_sync(fc, t):
    torch.cuda.synchronize()


def pinned_blocking_copy(fc, t):
    torch.ones(4).pin_memory().to(fc.device)


HOST_WAITS = [item, as_int, as_bool, cpu, tolist, to_numpy, nonzero, unique, equal, bool_mask]
HOST_WAITS += [bool_mask_put, masked_select, repeats, stream_sync, event_sync, device_sync]
HOST_WAITS += [pinned_blocking_copy, bincount]


@pytest.mark.parametrize("fn", HOST_WAITS, ids=lambda f: f.__name__)
def test_host_waits_are_flagged_at_their_line(fn):
    fc = _run(fn, _dev(4))
    f = _only(fc, "host_wait")
    assert (f.file.endswith(HERE), f.line, f.function) == (True, _line(fn), fn.__name__)
    assert f.phase == "steps" and f.code
    assert not fc.findings(kind="pageable_copy")


def test_event_query_and_ordering_calls_wait_for_nothing():
    def ordering(fc, t):
        s, e = torch.cuda.Stream(), torch.cuda.Event()
        s.wait_stream(torch.cuda.current_stream())
        e.record(s)
        torch.cuda.current_stream().wait_event(e)
        assert e.query() and s.query()

    fc = _run(ordering, _dev(4))
    assert not fc.findings(phase=None, kind="host_wait")


def test_a_copy_into_pinned_memory_without_blocking_waits_for_nothing():
    def pinned(fc, t):
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)

    def pageable(fc, t):
        torch.empty(t.shape, dtype=t.dtype).copy_(t, non_blocking=True)

    def blocking(fc, t):
        torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)

    assert not _run(pinned, _dev(4)).findings(phase=None, kind="host_wait")
    assert _run(pageable, _dev(4)).findings(phase=None, kind="host_wait")
    assert _run(blocking, _dev(4)).findings(phase=None, kind="host_wait")


def test_shapes_known_on_the_host_need_no_read():
    def known(fc, t):
        t.repeat_interleave(2)
        t.repeat_interleave(t.long(), output_size=8)
        torch.nonzero_static(t, size=4)

    assert not _run(known, _dev(4)).findings(kind="host_wait")


def test_host_reads_go_on_with_ones():
    def reads(fc, t):
        assert t.sum().item() == 1.0 and t[:2].tolist() == [1.0, 1.0]
        assert t[t > 0].shape == (4,)  # masks read as all True: the largest shape

    fc = _run(reads, _dev(4))
    assert fc.report()["steps"]["host_wait"] == 3


# -- copies from pageable memory -------------------------------------------------------------
def to_device(fc, t, _):
    torch.ones(4).to(fc.device, non_blocking=True)


def copy_into(fc, t, _):
    t.copy_(torch.ones(4))


def tensor_factory(fc, t, _):
    torch.tensor([1, 2], device=fc.device)


def as_tensor_numpy(fc, t, _):
    torch.as_tensor(np.arange(3), device=fc.device)


def host_index(fc, t, _):
    t[torch.tensor([0, 2])]


def host_index_select(fc, t, _):
    t.index_select(0, torch.tensor([0, 2]))


def scalar_through_index(fc, t, idx):
    t[idx] = True


def host_value_copy(fc, t, _):
    t[0].copy_(torch.tensor(1.0))


COPIES = [to_device, copy_into, tensor_factory, as_tensor_numpy, host_index, host_index_select]
COPIES += [scalar_through_index, host_value_copy]


@pytest.mark.parametrize("fn", COPIES, ids=lambda f: f.__name__)
def test_pageable_copies_are_flagged_at_their_line(fn):
    fc = _run(fn, _dev(4), _dev(2, dtype=torch.long))
    f = _only(fc, "pageable_copy")
    assert (f.file.endswith(HERE), f.line, f.function) == (True, _line(fn), fn.__name__)
    assert not fc.findings(kind="host_wait")


def _clean(fc, t, m, idx):
    t.copy_(torch.ones(4).pin_memory(), non_blocking=True)  # async from pinned memory
    torch.ones(4).pin_memory()[1:].to(fc.device, non_blocking=True)  # a pinned view too
    m.index_put_((idx,), torch.ones((), dtype=torch.bool, device=fc.device))  # device value
    t.index_select(0, idx)  # device indices
    t.add_(1).mul_(torch.tensor(2.0))  # Python number, 0-dim host scalar: kernel arguments
    torch.where(m, t, 0.0)
    t[:2] = 3.0  # basic index: fill_ with a scalar argument
    t.masked_fill_(m, torch.tensor(0.0))


def test_what_needs_no_host_copy_on_cuda_is_not_flagged():
    fc = _run(_clean, _dev(4), _dev(4, dtype=torch.bool), _dev(2, dtype=torch.long))
    bad = fc.findings(kind="pageable_copy") + fc.findings(kind="host_wait")
    assert not bad, [(f.what, f.where) for f in bad]


def _in_inference_mode(fn):
    def step(fc, *tensors):
        with torch.inference_mode():  # as vLLM runs a step
            fn(fc, *tensors)

    return step


def test_host_reads_are_flagged_in_inference_mode_too():
    """In inference mode ``.item()``, ``bool()``, ``.tolist()`` and ``.cpu()`` reach the
    checker whole (composite operations: ``item``, ``is_nonzero``, ``to``), not as the
    reads they are made of: they are taken apart and flagged as outside it."""

    def reads(fc, t):
        assert t.sum().item() == 1.0 and bool(t.any()) and t[:2].tolist() == [1.0, 1.0]
        t.cpu()

    fc = _run(_in_inference_mode(reads), _dev(4))
    assert fc.report()["steps"]["host_wait"] == 4


@pytest.mark.parametrize("fn", COPIES, ids=lambda f: f.__name__)
def test_pageable_copies_are_flagged_in_inference_mode_too(fn):
    fc = _run(_in_inference_mode(fn), _dev(4), _dev(2, dtype=torch.long))
    f = _only(fc, "pageable_copy")
    assert (f.file.endswith(HERE), f.line, f.function) == (True, _line(fn), fn.__name__)
    assert not fc.findings(kind="host_wait")


def test_in_inference_mode_the_clean_patterns_are_not_flagged():
    step = _in_inference_mode(_clean)
    fc = _run(step, _dev(4), _dev(4, dtype=torch.bool), _dev(2, dtype=torch.long))
    bad = fc.findings(kind="pageable_copy") + fc.findings(kind="host_wait")
    assert not bad, [(f.what, f.where) for f in bad]


# -- allocations, graphs, launches and bytes ---------------------------------------------------
def test_step_allocations_are_flagged_in_place_updates_and_views_are_not():
    def step(fc, x, y):
        x.add_(y)
        x.view(2, 2).t()
        torch.add(x, y, out=y)
        z = x + y  # the one new device storage
        torch.empty(0, device=fc.device)  # nothing to allocate
        return z

    fc = _run(step, _dev(4), _dev(4))
    f = _only(fc, "allocation")
    assert f.line == _line(step) + 3 and f.what == "aten.add"
    assert fc.report()["steps"]["allocated_bytes"] == 16
    assert fc.report()["construction"]["allocation"] == 2  # construction: counted, not failures
    assert fc.failures() == [f]


def test_a_captured_graph_allocates_at_capture_and_replays_its_launches():
    with FakeCuda() as fc:
        x = torch.zeros(100, device=fc.device)
        g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.graph(g, stream=s):
            y = x * 2  # allocates from the graph's pool
            y.add_(x)
        with fc.step():
            g.replay()
            g.replay()
    steps = fc.report()["steps"]
    assert steps["allocation"] == 0 and steps["graph_replays"] == 2
    assert steps["launches"] == 4  # two captured operations per replay
    assert steps["bytes"] == 2 * (800 + 1200)
    assert steps["by_op"] == {
        "aten.add_": {"launches": 2, "bytes": 2400},
        "aten.mul": {"launches": 2, "bytes": 1600},
    }
    assert fc.report()["construction"]["allocated_bytes"] == 400 + 400  # x, and y in the pool
    fc.assert_clean()


def test_a_graph_captured_in_the_steps_waits_for_the_device():
    def capture(fc, x):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            x.add(1)  # allocates from the graph's pool: not a step allocation

    fc = _run(capture, _dev(4))
    assert _only(fc, "host_wait").line == _line(capture)
    assert not fc.findings(kind="allocation")
    assert fc.report()["construction"]["allocated_bytes"] == 16 + 16


def test_a_host_wait_inside_a_capture_fails_even_in_construction():
    with FakeCuda() as fc:
        x = torch.zeros(4, device=fc.device)
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            x.sum().item()
    (f,) = fc.failures()
    assert f.in_capture and f.phase == "construction" and f.kind == "host_wait"
    with pytest.raises(AssertionError, match="in a graph capture"):
        fc.assert_clean()


def test_launches_and_bytes_per_step_follow_the_bytes_count_rules():
    with FakeCuda() as fc:
        x, y = torch.zeros(100, device=fc.device), torch.zeros(100, device=fc.device)
        for n in (1, 2):
            with fc.step():
                for _ in range(n):
                    x.add_(y)  # reads x and y, writes x: 1200 bytes
                    x.view(10, 10).t()  # views launch nothing
    per_step = fc.report()["steps"]["per_step"]
    assert [(s["launches"], s["bytes"]) for s in per_step] == [(1, 1200), (2, 2400)]


def test_a_gather_into_out_moves_the_bytes_of_one_that_allocates():
    """``index_select(..., out=)`` reads its rows once and writes them once, as the
    allocating call does (not as a scatter into its source, the rows twice); an
    in-place ``index_copy_`` reads and writes its target's rows."""
    with FakeCuda() as fc:
        t = torch.zeros(100, 10, device=fc.device)
        idx = torch.zeros(2, dtype=torch.long, device=fc.device)
        out = torch.empty(2, 10, device=fc.device)
        for f in (
            lambda: t.index_select(0, idx),
            lambda: torch.index_select(t, 0, idx, out=out),
            lambda: t.index_copy_(0, idx, out),
        ):
            with fc.step():
                f()
    per_step = fc.report()["steps"]["per_step"]
    rows = 2 * 10 * 4  # the two rows gathered or written
    assert [s["bytes"] for s in per_step] == [16 + 2 * rows, 16 + 2 * rows, 16 + 3 * rows]


@torch.library.custom_op("tllm_fakecuda_test::scaled", mutates_args=())
def _scaled(x: torch.Tensor, s: float) -> torch.Tensor:
    return x * s


@_scaled.register_fake
def _(x: torch.Tensor, s: float) -> torch.Tensor:
    return torch.empty_like(x)


def test_a_custom_operator_is_one_launch_moving_its_arguments():
    def step(fc, x):
        _scaled(x, 2.0)

    per_step = _run(step, _dev(100)).report()["steps"]["per_step"]
    assert (per_step[0]["launches"], per_step[0]["bytes"]) == (1, 800)


# -- cuBLAS workspaces -----------------------------------------------------------------------
def test_the_first_matrix_product_on_a_new_stream_in_the_steps_is_flagged():
    with FakeCuda() as fc:
        a = torch.zeros(4, 4, device=fc.device)
        warm, cold = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(warm):
            a @ a  # construction: the workspace is allocated before the KV cache is sized
        with fc.step():
            a @ a  # the default stream counts as used
            with torch.cuda.stream(warm):
                torch.bmm(a[None], a[None])
            with torch.cuda.stream(cold):
                torch.addmm(a, a, a)
                a @ a  # only the first use of a stream
    (f,) = fc.findings(kind="first_cublas")
    assert f.code == "torch.addmm(a, a, a)" and f.count == 1


# -- the same snippets on a real GPU (skipped without one) ---------------------------------------
# What the fake calls a host wait or a blocking copy must stop a GPU under the sync debug mode,
# and the clean patterns must not; ``.numpy()`` is an error there, ``synchronize()`` explicit.
GPU_SYNCS = [item, as_int, as_bool, cpu, tolist, nonzero, unique, bool_mask, bool_mask_put]
GPU_SYNCS += [masked_select, pinned_blocking_copy, copy_into, host_value_copy]
GPU_SYNCS += [scalar_through_index]


def _on_gpu(fn) -> None:
    dev = torch.device("cuda")
    t, m = torch.zeros(4, device=dev), torch.zeros(4, dtype=torch.bool, device=dev)
    idx = torch.zeros(2, dtype=torch.long, device=dev)
    args = (t, m, idx) if fn is _clean else (t, idx)[: fn.__code__.co_argcount - 1]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(SimpleNamespace(device=dev), *args)
    finally:
        torch.cuda.set_sync_debug_mode(0)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
@pytest.mark.parametrize("fn", GPU_SYNCS, ids=lambda f: f.__name__)
def test_on_a_gpu_what_is_flagged_synchronizes(fn):
    with pytest.raises(RuntimeError, match="synchroniz"):
        _on_gpu(fn)


@gpu
def test_on_a_gpu_the_clean_patterns_do_not_synchronize():
    _on_gpu(_clean)


# -- the tool itself -----------------------------------------------------------------------------
def _patched_state():
    names = ["Stream", "Event", "CUDAGraph", "graph", "stream", "current_stream", "is_available"]
    names += ["synchronize", "mem_get_info", "get_device_name", "set_sync_debug_mode"]
    tensor = ["pin_memory", "is_pinned", "record_stream", "numpy", "__setitem__"]
    return (
        {n: getattr(torch.cuda, n) for n in names},
        {n: vars(torch.Tensor).get(n) for n in tensor},
        (torch.tensor, torch.as_tensor, torch.asarray),
    )


def test_everything_patched_is_restored_even_after_an_error():
    before, real = _patched_state(), torch.cuda.is_available()  # True on a GPU machine
    with pytest.raises(ValueError), FakeCuda() as fc:
        assert torch.cuda.is_available() and _patched_state() != before
        torch.cuda.Stream(device=fc.device).synchronize()
        raise ValueError
    assert _patched_state() == before and torch.cuda.is_available() == real
    x = torch.zeros(2)
    x[torch.tensor([0])] = 1.0  # setitem works as before


def test_only_one_fake_device_at_a_time():
    with FakeCuda(), pytest.raises(RuntimeError, match="already active"), FakeCuda():
        pass
    with FakeCuda():  # usable again once the first has left
        pass


def test_construction_findings_are_reported_not_failures_and_the_report_is_json():
    with FakeCuda() as fc:
        x = torch.zeros(4, device=fc.device)
        x.sum().item()
        with fc.steps():
            pass
        x.sum().item()  # teardown
    report = json.loads(json.dumps(fc.report()))
    assert [report[p]["host_wait"] for p in ("construction", "steps", "teardown")] == [1, 0, 1]
    first = report["construction"]["findings"][0]
    assert (
        first["function"]
        == "test_construction_findings_are_reported_not_failures_and_the_report_is_json"
    )
    fc.assert_clean()


def test_assert_clean_lists_each_finding_with_its_source_line():
    fc = _run(item, _dev(4))
    with pytest.raises(AssertionError) as err:
        fc.assert_clean()
    assert f"{HERE}:{_line(item)}:item" in str(err.value)
    assert "t.sum().item()" in str(err.value)


# -- ESamp's distillers as they are today ------------------------------------------------------
HIDDEN = 8


def esamp_findings(cls_name: str) -> FakeCuda:
    """One train step and one predict (CUDA class) or one predict (CPU class) on the fake
    device, as the runtime calls them (slots on the host, rows on the device)."""
    from algorithms.esamp.cpu import GroupedDistiller
    from algorithms.esamp.cuda import CudaGroupedDistiller

    with FakeCuda() as fc:
        kw = {"device": fc.device, "capacity": 2, "intermediate_size": 16}
        if cls_name == "cuda":
            d = CudaGroupedDistiller(HIDDEN, **kw)
        else:
            d = GroupedDistiller(HIDDEN, **kw)
        a, b = d.alloc(), d.alloc()
        slots = torch.tensor([a, a, b])
        x = torch.zeros(3, HIDDEN, device=fc.device)
        with fc.step():
            if cls_name == "cuda":
                d.train_step(slots, x, x)
            d.predict(slots, x)
    return fc


def _stalls(fc: FakeCuda) -> list:
    return [f for f in fc.failures() if f.kind in ("host_wait", "pageable_copy")]


def _source_line(path: str, text: str) -> int:
    lines = (Path(__file__).resolve().parent.parent / path).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_cuda_distiller_steps_make_no_host_wait_or_pageable_copy():
    """An indexed write in ``_fill`` (``e.mask[rs, rp] = True``) is a pageable copy every
    train step: the distiller's steps must have none."""
    fc = esamp_findings("cuda")
    assert not _stalls(fc), _stalls(fc)
    assert not fc.findings(kind="first_cublas")  # the side stream was warmed at construction
    assert not fc.findings(kind="allocation")  # predict and update replay their graphs


def test_cpu_distiller_refuses_a_device():
    """The CPU class refuses a GPU at construction, naming the CUDA class (its ``.numpy()``
    of a device tensor would make the host wait every step)."""
    from algorithms.esamp.cpu import GroupedDistiller

    with pytest.raises(ValueError, match="CudaGroupedDistiller"):
        GroupedDistiller(HIDDEN, device="cuda")


def test_on_a_computing_cpu_device_a_graph_replay_runs_its_operations_again():
    """``FakeCuda(device="cpu")``: values are computed; a replay runs the captured operations
    again on the same tensors (a new value of an input reaches the output, through an
    intermediate the capture made)."""
    with FakeCuda(device="cpu"):
        x, y = torch.ones(3), torch.zeros(3)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y.copy_(x * 2 + 1)
        x.fill_(5)
        g.replay()
    assert y.tolist() == [11.0] * 3

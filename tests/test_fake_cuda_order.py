"""FakeCuda(order=True): the stream-ordering checks (finding kind ``race``).

Minimal programs, each in a correct version (no race) and one missing its wait (exactly the
expected race, at its line, naming the earlier access); then the runtime's stamp reads and
DeviceSums, whose pinned buffers come back through events. ESamp's decode step:
tests/test_esamp_fake_cuda.py."""

from __future__ import annotations

import json

import pytest
import torch

from tllm_core.api.transfers import DeviceSums
from tllm_core.runtime.stamp_copies import RING, StampReader
from tllm_core.testing.fake_cuda import FakeCuda


def _races(fc: FakeCuda) -> list[tuple[str, str]]:
    """(function:code of the later access, what) of every race, any phase."""
    return [
        (f"{f.function}:{f.code.split('  #')[0]}", f.what)
        for f in fc.findings(phase=None, kind="race")
    ]


def _setup(fc: FakeCuda, *shapes: int) -> list[torch.Tensor]:
    """Device buffers made in construction, then the device synchronized (so their zeroing
    is ordered before everything after)."""
    out = [torch.zeros(n, device=fc.device) for n in shapes]
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("wait", ["wait_stream", "wait_event", None])
def test_a_tensor_written_on_one_stream_and_read_on_another_needs_a_wait(wait):
    with FakeCuda(order=True) as fc:
        x, y = _setup(fc, 8, 8)
        side, main = torch.cuda.Stream(), torch.cuda.current_stream()
        with fc.step():
            x.fill_(1)  # produced on the main stream
            if wait == "wait_stream":
                side.wait_stream(main)
            elif wait == "wait_event":
                side.wait_event(main.record_event())
            with torch.cuda.stream(side):
                y.copy_(x)  # consumed on the side stream
    if wait:
        assert _races(fc) == []
        return
    ((line, what),) = _races(fc)
    assert line == "test_a_tensor_written_on_one_stream_and_read_on_another_needs_a_wait:y.copy_(x)"
    assert what.startswith(f"read on stream {side.stream_id} unordered with the earlier write")
    assert "on the default stream at" in what and what.endswith("needs_a_wait")


@pytest.mark.parametrize("recorded", ["after", "before"])
def test_an_event_orders_only_the_work_queued_before_its_record(recorded):
    with FakeCuda(order=True) as fc:
        x, y = _setup(fc, 8, 8)
        side, ev = torch.cuda.Stream(), torch.cuda.Event()
        with fc.step():
            if recorded == "before":
                ev.record()
            x.fill_(1)
            if recorded == "after":
                ev.record()
            ev.wait(side)
            with torch.cuda.stream(side):
                y.copy_(x)
    assert len(_races(fc)) == (recorded == "before")


@pytest.mark.parametrize("wait", [True, False])
def test_the_main_stream_reading_a_side_stream_result_needs_a_wait(wait):
    with FakeCuda(order=True) as fc:
        x, y = _setup(fc, 8, 8)
        side, main = torch.cuda.Stream(), torch.cuda.current_stream()
        with fc.step():
            side.wait_stream(main)
            with torch.cuda.stream(side):
                y.mul_(2)
            if wait:
                main.wait_stream(side)
            x.add_(y)
    if wait:
        assert _races(fc) == []
        return
    ((line, what),) = _races(fc)
    assert line.endswith("x.add_(y)") and "earlier write on stream" in what


def test_one_stream_and_the_host_are_ordered_by_enqueue():
    """Work the host queues comes after what the host did; one stream runs in order."""
    with FakeCuda(order=True) as fc:
        (x,) = _setup(fc, 8)
        host = torch.zeros(8).pin_memory()
        with fc.step():
            for _ in range(3):
                host.numpy()[:] = 1  # the host fills the buffer, then queues its copy...
                x.copy_(host, non_blocking=True)
                x.mul_(2)
                host.copy_(x, non_blocking=True)
                torch.cuda.current_stream().synchronize()  # ...and waits before the next fill
    assert _races(fc) == []


def test_new_storage_has_no_history_and_an_empty_one_no_write():
    """``torch.empty`` on the main stream then filled on the side stream: nothing to order
    (the allocation writes nothing); ``torch.zeros`` writes, so its first use elsewhere waits."""
    with FakeCuda(order=True) as fc:
        side = torch.cuda.Stream()
        with fc.step():
            e = torch.empty(8, device=fc.device)
            z = torch.zeros(8, device=fc.device)
            with torch.cuda.stream(side):
                e.fill_(1)
                z.fill_(1)
    ((line, what),) = _races(fc)
    assert line.endswith("z.fill_(1)") and "earlier write on the default stream" in what


@pytest.mark.parametrize("settle", ["query", "synchronize", None])
def test_a_pinned_buffer_rewritten_while_its_copy_may_be_in_flight(settle):
    """The host refills a pinned buffer while the copy from it may not have run: only an
    event seen completed (``query()`` True, ``synchronize()``) orders the refill."""
    with FakeCuda(order=True) as fc:
        (dev,) = _setup(fc, 16)
        host = torch.zeros(16, dtype=torch.float32).pin_memory()
        with fc.step():
            host.numpy()[:] = 1
            dev.copy_(host, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            if settle:
                getattr(ev, settle)()
            host.numpy()[:] = 2  # the next step's values
    if settle:
        assert _races(fc) == []
        return
    ((line, what),) = _races(fc)
    assert line.endswith("host.numpy()[:] = 2")
    assert what.startswith("write on the host unordered with the earlier read on the default")


@pytest.mark.parametrize("query", [True, False])
def test_a_pinned_buffer_read_by_the_host_before_its_copy_has_arrived(query):
    with FakeCuda(order=True) as fc:
        (dev,) = _setup(fc, 4)
        host = torch.zeros(4).pin_memory()
        with fc.step():
            host.copy_(dev, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            if query:
                assert ev.query()
            values = host.tolist()
    assert values == [1.0] * 4  # what the fake's copies bring back
    if query:
        assert _races(fc) == []
        return
    ((line, what),) = _races(fc)
    assert line.endswith("values = host.tolist()")
    assert what.startswith("read on the host unordered with the earlier write on the default")


def _graph(fc: FakeCuda, side, inp, out) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(g, stream=side):
        tmp = inp * 2  # the graph's pool: not followed
        out.copy_(tmp)  # captured: inp and out existed before the capture
    return g


@pytest.mark.parametrize("wait", [True, False])
def test_a_graph_replay_reads_what_it_captured_on_the_replaying_stream(wait):
    with FakeCuda(order=True) as fc:
        inp, out = _setup(fc, 8, 8)
        side, main = torch.cuda.Stream(), torch.cuda.current_stream()
        g = _graph(fc, side, inp, out)
        torch.cuda.synchronize()
        with fc.step():
            inp.fill_(3)  # the main stream writes the graph's input
            if wait:
                side.wait_stream(main)
            with torch.cuda.stream(side):
                g.replay()
            main.wait_stream(side)
            out.sum(dim=0, keepdim=True)  # read after the replay: ordered
    if wait:
        assert _races(fc) == []
        return
    ((line, what),) = _races(fc)
    assert line.endswith("g.replay()")
    assert "read on stream" in what and "(graph replay of" in what and "tmp = inp * 2" not in what
    assert "earlier write on the default stream" in what


def test_a_replay_on_the_main_stream_is_ordered_with_it():
    with FakeCuda(order=True) as fc:
        inp, out = _setup(fc, 8, 8)
        g = _graph(fc, torch.cuda.Stream(), inp, out)
        with fc.step():
            for _ in range(3):
                inp.fill_(1)
                g.replay()
                inp.add_(out)
    assert _races(fc) == []


def test_off_by_default_and_a_race_fails_assert_clean_in_any_phase():
    with FakeCuda() as fc:
        x, y = _setup(fc, 4, 4)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            y.copy_(x.fill_(1))
    assert fc.order is None and fc.findings(phase=None, kind="race") == []
    with FakeCuda(order=True) as fc:
        x, y = _setup(fc, 4, 4)
        x.fill_(1)
        with torch.cuda.stream(torch.cuda.Stream()):
            y.copy_(x)  # construction: still a failure (a wrong value, not a stall)
    report = json.loads(json.dumps(fc.report()))
    assert report["construction"]["race"] == 1
    with pytest.raises(
        AssertionError, match=r"(?s)race: read on stream \d+ unordered.*y\.copy_\(x\)"
    ):
        fc.assert_clean()


# -- the runtime's stamp reads and DeviceSums ---------------------------------------------
def _stamps(fc: FakeCuda) -> tuple[dict, dict]:
    stamps = {f"residual.{i}": torch.zeros(1, dtype=torch.int64, device=fc.device) for i in (0, 1)}
    edited = {"edit": torch.zeros(1, dtype=torch.int64, device=fc.device)}
    torch.cuda.synchronize()
    return stamps, edited


@pytest.mark.parametrize("late", [False, True], ids=["read_when_ready", "read_late"])
def test_stamp_reads_wait_for_their_copy_and_their_buffer_is_not_refilled_under_them(late):
    """Each step the forward writes the stamps (main stream) and the reader copies them into
    its ring of pinned buffers. Read at once, or read only after the ring has come round
    (the reader settles a read before reusing its buffer): no race either way."""
    with FakeCuda(order=True) as fc:
        stamps, edited = _stamps(fc)
        reader, reads = StampReader(), []
        with fc.step():
            for step in range(2 * RING + 1):
                for t in (*stamps.values(), *edited.values()):
                    t.fill_(step)  # the forward
                read = reader.start(stamps, edited)
                if late:
                    reads.append(read)
                else:
                    assert read.ready() and read.values() == [1, 1, 1]
            for read in reads:
                assert read.values() == [1, 1, 1]
    assert _races(fc) == []
    assert not fc.findings(kind="host_wait")
    assert fc.order is not None and fc.order.accesses > 10 * RING


def test_the_runtimes_end_step_reads_its_stamps_in_order():
    """The runtime's end_step (stamps and edit counts gathered on the device, copied into
    the reader's pinned ring, read when their event has completed), past the ring."""
    from test_core_ports import _runtime, fake_device_steps  # the runtime's test double

    rt = _runtime({"name": "reader"})
    with FakeCuda(order=True) as fc:
        fake_device_steps(rt, fc, 2 * RING + 1)
    assert _races(fc) == []
    assert len(rt.slots[0].consumer.bundles) == 2 * RING + 1
    assert fc.order is not None and fc.order.accesses > 10 * RING


def test_device_sums_hand_out_only_copies_whose_event_completed():
    with FakeCuda(order=True) as fc:
        sums = DeviceSums(torch.zeros(3, device=fc.device))
        one = torch.ones(3, device=fc.device)
        torch.cuda.synchronize()
        with fc.step():
            for step in range(6):
                sums.add(one)
                sums.send()
                if step % 2:  # some copies are taken a step later
                    assert all(part == [1.0] * 3 for part in sums.arrived())
        sums.send()
        sums.arrived(wait=True)
    assert _races(fc) == []
    assert not fc.findings(kind="host_wait")

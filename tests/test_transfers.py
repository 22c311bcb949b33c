"""tllm_core.api.transfers: the staging ring (host to device) and the copy ring (device to
host), their event rules and wait counters, on CPU and on the test kit's fake CUDA (whose
events report completed unless a test says the device is still busy)."""

from __future__ import annotations

import pytest
import torch

from tllm_core.api.transfers import HostCopies, HostCopyRing, StagingRing
from tllm_core.testing.fake_cuda import FakeCuda, FakeEvent


@pytest.fixture
def busy(monkeypatch):
    """Call to make every event report 'not completed' from then on (a busy device)."""
    return lambda: monkeypatch.setattr(FakeEvent, "query", lambda self: False)


def _races(fc: FakeCuda) -> list:
    return fc.findings(None, "race")


def test_staging_copies_what_was_written_and_rewrites_a_buffer_after_its_copy(busy):
    with FakeCuda(order=True) as fc:
        ring = StagingRing(fc.device, 2)
        dst = torch.zeros(5, dtype=torch.int64, device=fc.device)
        with fc.step():
            for step in range(5):
                i, host = ring.take(step + 1)
                host.fill_(step)
                ring.send(i, dst[: step + 1])
        assert ring.copies == 5 and ring.waits == 0
        assert _races(fc) == [] and fc.findings(kind="pageable_copy") == []
        assert not fc.findings(kind="host_wait")
        busy()
        ring.take(1)  # its buffer's last copy has not run: the host waits, counted
        assert ring.waits == 1 and fc.findings(kind="host_wait")


def test_staging_on_cpu_copies_at_once():
    ring = StagingRing(torch.device("cpu"), 3, torch.float32, numel=4)
    dst = torch.zeros(2, 2)
    i, host = ring.take(4)
    host.copy_(torch.arange(4.0))
    ring.send(i, dst)
    assert dst.tolist() == [[0.0, 1.0], [2.0, 3.0]] and not ring.pinned
    assert ring.copies == 1 and ring.waits == 0
    assert all(b is not None and b.numel() == 4 for b in ring.buffers)


def test_copies_back_arrive_in_order_and_a_full_ring_waits_for_its_oldest(busy):
    with FakeCuda(order=True) as fc:
        src = torch.zeros(3, device=fc.device)
        ring = HostCopyRing(src, 2)
        with fc.step():
            ring.send(src, tag="a")
            ring.send(src, tag="b")
            assert ring.full and ring.in_flight == 2
            assert [tag for tag, _ in ring.arrived()] == ["a", "b"]
            assert not ring.full
        assert ring.waits == 0 and not fc.findings(kind="host_wait")
        assert _races(fc) == [] and fc.findings(kind="pageable_copy") == []
        busy()
        ring.send(src, tag="c")
        ring.send(src, tag="d")
        assert ring.arrived() == []  # nothing has arrived: nothing handed out
        ring.send(src, tag="e")  # full: the oldest is waited for and read
        assert ring.waits == 1 and fc.findings(kind="host_wait")
        assert [tag for tag, _ in ring.arrived()] == ["c"]
        assert [tag for tag, _ in ring.arrived(wait=True, until="d")] == ["d"]
        assert [tag for tag, _ in ring.arrived(wait=True)] == ["e"] and ring.waits == 3


def test_copies_back_on_cpu_read_what_was_sent_with_their_tag():
    a, b = torch.tensor([1, 2]), torch.tensor([[0.5]])
    ring = HostCopyRing([a, b], 1, read=lambda tag, host: (tag, [t.clone() for t in host]))
    ring.send([a, b], tag=7)
    a.fill_(0)  # the copy was made at send
    ((tag, (seven, (ha, hb))),) = ring.arrived()
    assert tag == seven == 7 and ha.tolist() == [1, 2] and hb.tolist() == [[0.5]]


def test_host_copies_is_the_deprecated_name_of_the_copy_ring():
    with pytest.warns(DeprecationWarning, match="HostCopyRing"):
        copies = HostCopies(torch.zeros(2))
    assert isinstance(copies, HostCopyRing)
    copies.send(torch.tensor([0.5, 2.0]), tag="step 7")
    assert copies.arrived(wait=True) == [("step 7", [0.5, 2.0])]

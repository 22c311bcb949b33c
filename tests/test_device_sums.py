"""DeviceSums: sums kept on the device, counted on the host without a host wait."""

from __future__ import annotations

import torch

from tllm_core.api.transfers import DeviceSums
from tllm_core.testing.fake_cuda import FakeCuda


def test_on_cpu_each_send_arrives_at_once_and_the_sums_start_again():
    sums = DeviceSums(torch.zeros(2))
    sums.add(torch.tensor([1.0, 2.0]))
    assert sums.send()
    sums.add(torch.tensor([3.0, 0.5]))
    assert sums.send()
    assert sums.arrived() == [[1.0, 2.0], [3.0, 0.5]]
    assert sums.values.tolist() == [0.0, 0.0]
    assert sums.arrived() == []


def test_while_every_buffer_is_in_flight_the_sums_keep_accumulating():
    sums = DeviceSums(torch.zeros(()), ring=1)
    sums.add(torch.tensor(1.0))
    assert sums.send()
    sums.add(torch.tensor(2.0))
    assert not sums.send()  # the one buffer is not read yet: nothing queued, nothing lost
    assert sums.arrived() == [[1.0]]
    assert sums.send() and sums.arrived() == [[2.0]]


def test_on_a_gpu_sending_and_taking_what_arrived_wait_for_nothing():
    with FakeCuda() as fc:
        sums = DeviceSums(torch.zeros(3, device=fc.device))
        one = torch.ones(3, device=fc.device)
        with fc.step():
            for _ in range(5):
                sums.add(one)
                sums.send()
                sums.arrived()
    assert not fc.findings(kind="host_wait"), fc.findings(kind="host_wait")
    assert not fc.findings(kind="pageable_copy")


def test_nothing_added_since_the_last_copy_sends_nothing():
    sums = DeviceSums(torch.zeros(1))
    assert not sums.send()  # nothing added yet
    sums.add(torch.ones(1))
    assert sums.send() and not sums.send()
    assert sums.arrived() == [[1.0]]

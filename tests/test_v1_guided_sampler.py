"""The V1 adapter's guided ``topk_topp_sampler.forward`` with a fake runner and fake step
events: when the guide writes no logit, vLLM's own forward receives exactly the call it
would have received without tllm (its logits tensor, values untouched, and its k and p: on
CUDA those route filtered rows to FlashInfer); when it does, the guided candidates with
``k = p = None``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tllm_core.vllm_bridge.runners import V1RunnerAdapter

ROWS, V = 3, 10


class Events:
    """Step events whose guide optionally edits one candidate logit."""

    def __init__(self, edit: bool):
        self.edit, self.calls = edit, []

    def guide(self, logits, temperature, is_random, filtered) -> bool:
        self.calls.append((logits.clone(), filtered))
        self.is_random = is_random
        if self.edit:
            logits[0, int(logits[0].argmax())] += 1.0
        return self.edit


def _forward(events: Events, live: bool = True):
    seen = []

    def orig(logits, generators, k, p):
        seen.append((logits, logits.clone(), k, p))
        return "sampled"

    md = SimpleNamespace(temperature=torch.ones(ROWS), all_random=True)
    batch = SimpleNamespace(sampling_metadata=md, temperature_cpu=np.ones(ROWS, np.float32))
    runner = SimpleNamespace(input_batch=batch, requests={}, max_num_tokens=ROWS, vllm_config=None)
    adapter = V1RunnerAdapter(runner)
    adapter.live, adapter._ids = live, ["a", "b", "c"]
    return adapter._guided_forward(events, orig), seen, runner


def _kp(filters: bool):
    if not filters:
        return None, None
    return torch.full((ROWS,), 3, dtype=torch.long), torch.full((ROWS,), 0.9)


@pytest.mark.parametrize("filters", [True, False])
def test_unguided_step_calls_vllms_forward_unchanged(filters):
    events = Events(edit=False)
    forward, seen, _ = _forward(events)
    logits = torch.randn(ROWS, V, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    k, p = _kp(filters)
    assert forward(logits, {}, k, p) == "sampled"
    (got, values, got_k, got_p), (cand, filtered) = seen[0], events.calls[0]
    assert got is logits and torch.equal(values, before)
    assert got_k is k and got_p is p
    assert filtered == filters
    # The guide saw the filtered candidates: k = 3 leaves three finite logits per row.
    assert (cand.isfinite().sum(1) == (3 if filters else V)).all()


@pytest.mark.parametrize("filters", [True, False])
def test_guided_step_samples_the_guided_candidates_without_k_and_p(filters):
    forward, seen, _ = _forward(Events(edit=True))
    logits = torch.randn(ROWS, V, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    k, p = _kp(filters)
    forward(logits, {}, k, p)
    got, values, got_k, got_p = seen[0]
    assert got_k is None and got_p is None
    top = int(before[0].argmax())
    assert values[0, top] == before[0, top] + 1.0
    if filters:
        assert not values.isfinite().all()  # filtered: the rest is -inf


def test_no_live_step_passes_through():
    events = Events(edit=True)
    forward, seen, _ = _forward(events, live=False)
    logits = torch.randn(ROWS, V)
    k, p = _kp(True)
    forward(logits, {}, k, p)
    assert seen[0][0] is logits and seen[0][2] is k and not events.calls
    assert np.array_equal(seen[0][1].numpy(), logits.numpy())


def test_greedy_rows_come_from_the_host_temperatures():
    """Which rows sample randomly is read from the input batch's host copy: the device
    temperatures (here on the meta device, which has no values) are never read back."""
    events = Events(edit=False)
    forward, _, runner = _forward(events)
    md = runner.input_batch.sampling_metadata
    md.all_random, md.temperature = False, torch.ones(ROWS, device="meta")
    runner.input_batch.temperature_cpu = np.array([0.0, 1.0, 0.7], np.float32)
    forward(torch.randn(ROWS, V), {}, None, None)
    assert events.is_random.tolist() == [False, True, True]

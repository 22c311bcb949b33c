"""Host syncs in an ESamp decode step, counted on CPU: the operations that would make the
host wait for a CUDA device (``tllm_core.testing.counters``: ``.item()``/``int()`` of a
tensor, ``nonzero``, ``unique``, boolean-mask indexing, host<->device copies) during the
consumer's per-step work, guidance plus the update's submission.

The consumer runs its CUDA branches (``Shared.on_cuda``: counters and losses read back only at a
blocking flush) with the CPU distiller training on its side thread (dispatch modes are
thread-local: the CPU-only trainer is not counted; the CUDA trainer is one graph replay).
Not seen here: ``.cpu()``/``.tolist()`` of device tensors (nothing dispatches on CPU) and
the runtime's own reads around the consumer. The bounds are the counts measured now: one
more synchronising operation in the step fails the test.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_esamp_math import Fake, V, _filtered_logits

from tllm_core.api.bundles import Bundle
from tllm_core.testing.counters import SyncCounter

# Per decode step. Was 8 and 7 before the mixes used masks and the guided counts stayed on
# the device, then 1 in post-filter mode (the ``nonzero`` of the exact candidate search, which
# the CUDA branch replaced with GuideView.top_candidates).
# "+fit": beta_schedule 'fit' (its errors stay on the device: reading them back would add 2).
MAX_SYNCS = {"post_filter": 0, "full_vocab": 0, "post_filter+fit": 0, "full_vocab+fit": 0}
# The CPU distiller compares its saved input with ``torch.equal`` once per update: host
# tensors only (on a CUDA device the factory builds the CUDA distiller), so no device sync.
HOST_ONLY = Counter({"equal": 1})


def syncs_per_step(mode: str, steps: int = 4) -> list[dict[str, int]]:
    """Sync counts of each decode step of 2 prompts x 4 samples (the first step creates
    the groups' distillers)."""
    fake = Fake()
    mode, _, fit = mode.partition("+")
    extra = {"beta_schedule": "fit", "init": "zero", "lr": 1e-2} if fit else {}
    # the consumer's CUDA branches (see the module docstring)
    c = fake.consumer(cpu_update="thread", mode=mode, cuda_path=True, **extra)
    reqs = fake.requests(2, 4)
    out = []
    for t in range(steps):
        rows, hidden = fake.step(reqs)
        if fit:  # a target the zero-initialised distiller predicts in part: error < 1
            hidden["final"] = hidden["layer.0"] + 0.3 * hidden["final"]
        filtered = mode == "post_filter"
        logits = (
            _filtered_logits(len(reqs), V, keep=6, seed=t)
            if filtered
            else torch.randn(len(reqs), V, generator=torch.Generator().manual_seed(t))
        )
        view = fake.view(rows, hidden, logits, filtered=filtered)
        with SyncCounter() as sc:
            c.guide(view)
            c.on_bundle(Bundle(t, rows, hidden))
        out.append(dict(sc.kinds - HOST_ONLY))
    res = c.result()
    c.close()
    # The step did its work: rows were guided (from the second step on with the fit: an
    # untrained distiller's error is 1, which scales beta to 0) and trained.
    k = res["counters"]
    assert k["rows_guided"] == 8 * (steps - 1 if fit else steps), k
    assert k["rows_trained"] == 8 * steps
    if fit:
        assert k["fit_rows"] == 8 * steps and 0 < k["fit_scale_mean"] < 1
    return out


@pytest.mark.parametrize("mode", sorted(MAX_SYNCS))
def test_decode_step_syncs_at_most_the_measured_count(mode):
    counts = syncs_per_step(mode)
    totals = [sum(k.values()) for k in counts]
    print(f"{mode}: syncs per decode step {totals}, last step by kind {counts[-1]}")
    assert max(totals[1:]) <= MAX_SYNCS[mode], counts


def test_the_counter_sees_each_kind_of_sync():
    x = torch.arange(6.0)
    with SyncCounter() as sc:
        int(x.sum())
        x.nonzero()
        torch.unique(x)
        x[x > 2]
        x[torch.tensor([0, 1])]  # integer indexing: no sync
        x.add(1)
        torch.equal(x, x)
        torch.bincount(x.long())
        x.repeat_interleave(torch.tensor([1, 0, 2, 1, 1, 1]))
        x.repeat_interleave(2)  # a Python count: the output size is known
    assert dict(sc.kinds) == {
        "_local_scalar_dense": 1,
        "nonzero": 1,
        "unique": 1,
        "bool_index": 1,
        "equal": 1,
        "bincount": 1,
        "repeat_interleave": 1,
    }

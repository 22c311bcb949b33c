"""ESamp's whole decode step on CUDA, checked without a GPU (``tllm_core.testing.fake_cuda``,
driven by ``benchmarks/esamp_fake_step.py``): the consumer's guidance (prediction, candidate
mix) and its training submission at Qwen2.5-7B's shapes, 8 prompts x 16 samples, in both
mixing modes, with ``beta_schedule`` constant and 'fit'. The step must not make the host
wait for the device, copy from pageable memory, use a stream's cuBLAS for the first time or
allocate on the device (its temporaries are the guidance workspace's, made with the
consumer and counted in the memory plan); the distiller's work is its two graph replays.
Launches and bytes per step: docs/results.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from esamp_fake_step import run  # noqa: E402


@pytest.mark.parametrize("fit", [False, True], ids=["constant", "fit"])
@pytest.mark.parametrize("mode", ["post_filter", "full_vocab"])
def test_esamp_decode_step_at_7b_shapes_makes_no_host_wait(mode, fit):
    res = run(8, 16, mode, fit, steps=2)
    print(json.dumps(res))
    assert res["failures"] == [] and res["host_waits"] == res["pageable_copies"] == 0, res
    assert res["first_cublas"] == 0
    assert res["graph_replays"] == 2  # one predict, one update: the distiller's work
    assert res["allocations"] == res["allocated_bytes"] == 0, res["allocation_sites"]
    # Every update (the setup step's and the two counted) runs on the guide's forward of the
    # same rows: each step's guide predicted exactly the rows it trains.
    assert res["updates_reusing_prediction"] == 3, res


@pytest.mark.parametrize("fit", [False, True], ids=["constant", "fit"])
@pytest.mark.parametrize("mode", ["post_filter", "full_vocab"])
def test_a_long_group_replays_its_layout_and_stays_clean(mode, fit):
    """1 prompt x 128 samples (n > cuda_graph_max_rows): the one-group layout's graphs."""
    res = run(1, 128, mode, fit, steps=1)
    assert res["failures"] == [] and res["graph_replays"] == 2, res
    assert res["allocations"] == res["allocated_bytes"] == 0, res["allocation_sites"]

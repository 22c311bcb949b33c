"""ESamp's whole decode step on CUDA, checked without a GPU (``tllm_core.testing.fake_cuda``,
driven by ``tests/esamp_steps.py``): the consumer's guidance (prediction, candidate
mix) and its training submission at Qwen2.5-7B's shapes, 8 prompts x 16 samples, in both
mixing modes, with ``beta_schedule`` constant and 'fit'. The step must not make the host
wait for the device, copy from pageable memory, use a stream's cuBLAS for the first time or
allocate on the device (its temporaries are the guidance workspace's, made with the
consumer and counted in the memory plan); the distiller's work is its two graph replays.
The same holds for the noise ablations, diagnostics and the settings that change the guided
step; a head given without its weight allocates its output, and must say so at start.
Launches and bytes per step: docs/results.md."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from esamp_steps import run


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


@pytest.mark.parametrize("fit", [False, True], ids=["constant", "fit"])
def test_a_long_run_reads_its_results_and_counters_back_without_a_wait(fit, monkeypatch):
    """Guided decode steps past the queued updates' read-back (every 16 here, 256 shipped;
    it once forced a blocking read-back) and the counters' (every 2nd read-back here): the
    update results come back by the background copies, the guided counts and the fit's sums
    by copies into pinned memory, all without a host wait, and the counters move during the
    run (not only at a blocking flush at the end)."""
    from algorithms.esamp import training

    monkeypatch.setattr(training, "_FLUSH_EVERY", 16)
    monkeypatch.setattr(training, "_READ_EVERY", 2)
    res = run(8, 16, "post_filter", fit, steps=60)
    assert res["failures"] == [] and res["host_waits"] == 0, res
    assert res["rows_guided_counted_in_the_run"] > 0, res


@pytest.mark.parametrize("mode", ["post_filter", "full_vocab"])
def test_the_gather_dot_kernel_is_compiled_with_the_consumer(mode, monkeypatch):
    """The consumer runs the candidate gather-dot once, on every pair its workspace holds, when
    it is built (post-filter only: full vocabulary has none), so its Triton compile (about a
    second of host time) is not in the first guided step."""
    import esamp_steps

    from algorithms.esamp import factory, guide_step
    from tllm_core.testing.fake_cuda import FakeCuda

    calls = []
    monkeypatch.setattr(guide_step, "candidate_dot", lambda *a: calls.append(a[2].numel()))
    monkeypatch.setattr(factory, "uses_gpu_path", lambda device: True)
    with FakeCuda() as fc:
        c = esamp_steps.consumer(fc.device, 8, 16, True, mode=mode)
    k = c.shared.cfg.cuda_max_candidates
    assert calls == ([c.shared.cfg.cuda_rows_per_step * k] if mode == "post_filter" else [])


@pytest.mark.parametrize("fit", [False, True], ids=["constant", "fit"])
@pytest.mark.parametrize("mode", ["post_filter", "full_vocab"])
def test_the_whole_runtime_step_with_esamp_waits_for_nothing_and_allocates_nothing(mode, fit):
    """ESamp driven through tllm's runtime as the vLLM bridge drives it (begin_step, guide,
    end_step with the step's stamps; ``tests/esamp_steps.py``), 8 x 16 at 7B
    shapes: no host wait, no pageable copy, no race and no device allocation anywhere in the
    counted steps (the runtime's gathers, index copies and the guide's view reuse their
    buffers); the step's row indices go to the device in one copy."""
    from esamp_steps import run_runtime

    res = run_runtime(8, 16, mode, fit=fit, steps=2, order=True)
    assert res["host_waits"] == res["pageable_copies"] == res["races"] == [], res
    assert res["rows_captured"] == 3 * 128, res  # every step delivered and counted
    assert res["allocations"] == 0 and res["allocation_sites"] == [], res["allocation_sites"]
    assert res["index_copies_per_step"] == 1, res


@pytest.mark.parametrize("per_request", ["interleaved", "block"])
@pytest.mark.parametrize("mode", ["post_filter", "full_vocab"])
def test_a_per_request_esamp_runtime_step_waits_for_nothing_and_allocates_nothing(
    mode, per_request
):
    """The same step with ESamp per request (``{"per_request": true}``, switched on by half the
    prompts' requests through ``tllm_consumers``: every other prompt, or the first half):
    no host wait, pageable copy, race or device allocation (the places a per-request step
    could allocate: the guide's index, its rows' token ids, the copies of the logits,
    temperatures and states, the view's change counts), one index copy per step; ESamp
    guided its rows only."""
    from esamp_steps import run_runtime

    res = run_runtime(8, 16, mode, fit=False, steps=2, order=True, per_request=per_request)
    assert res["host_waits"] == res["pageable_copies"] == res["races"] == [], res
    assert res["allocations"] == 0 and res["allocation_sites"] == [], res["allocation_sites"]
    assert res["index_copies_per_step"] == 1, res
    assert res["acted_on"] == 64 and res["rows_guide_visited"] == 3 * 64, res


def test_diagnostics_in_a_long_run_wait_for_nothing(monkeypatch):
    """Guided steps with diagnostics past the ring (32 steps here, 256 shipped): each full
    half of the ring goes to the host in a copy nothing waits for (not a blocking read of the
    whole ring when it fills)."""
    from algorithms.esamp import guide_workspace

    monkeypatch.setattr(guide_workspace, "DIAG_STEPS", 32)
    res = run(8, 16, "post_filter", False, steps=80, diagnostics=True)
    assert res["failures"] == [] and res["host_waits"] == 0, res


def test_diagnostics_ring_halves_are_copied_and_reused_in_order(monkeypatch):
    """A ring of 8 steps (halves of 4) over 40 guided steps, stream order checked: no half is
    rewritten on the device, nor its host buffer refilled or read, while its copy may still
    be in flight."""
    from algorithms.esamp import guide_workspace

    monkeypatch.setattr(guide_workspace, "DIAG_STEPS", 8)
    res = run(8, 16, "post_filter", False, steps=40, order=True, diagnostics=True)
    assert res["races"] == [] and res["host_waits"] == [], res


def _clean(res: dict) -> None:
    assert res["failures"] == [] and res["host_waits"] == res["pageable_copies"] == 0, res
    assert res["first_cublas"] == 0


@pytest.mark.parametrize("fit", [False, True], ids=["constant", "fit"])
@pytest.mark.parametrize("mode", ["post_filter", "full_vocab"])
@pytest.mark.parametrize("ablation", ["noise", "f_noise"])
def test_the_noise_ablations_take_the_allocation_free_step(ablation, mode, fit):
    """The stand-in prediction is made in the guidance workspace (its noise part is in the
    memory plan only for these ablations)."""
    res = run(8, 16, mode, fit, steps=1, ablation=ablation)
    _clean(res)
    assert res["graph_replays"] == 2
    assert res["allocations"] == res["allocated_bytes"] == 0, res["allocation_sites"]


@pytest.mark.parametrize(
    "layout,mode,options",
    [
        pytest.param((1, 128), "full_vocab", {"ablation": "noise", "beta_schedule": "fit"}, id="noise-fit-1x128"),
        pytest.param((8, 16), "post_filter", {"ablation": "frozen"}, id="frozen"),
        pytest.param((8, 16), "full_vocab", {"mix": "latent"}, id="latent"),
        # the latent mix falls back to logits for a non-final target
        pytest.param((8, 16), "full_vocab", {"target_layer": 20, "mix": "latent"}, id="layer20-latent"),
        pytest.param((8, 16), "post_filter", {"target_layer": 20, "beta_schedule": "fit"}, id="layer20-fit"),
        pytest.param((8, 16), "full_vocab", {"init": "zero_output"}, id="zero_output"),
        pytest.param((8, 16), "post_filter", {"scope": "batch"}, id="scope-batch"),
        # a filtered view: post-filter on the 'auto' workspace
        pytest.param((8, 16), "auto", {}, id="auto"),
        pytest.param((8, 16), "post_filter", {"cuda_max_candidates": 1000}, id="k1000"),
        # one guided row of 128: the [R, k] search's pairs outnumber a quarter of its logits
        # (the whole-vocabulary product once took over here: 4 allocations)
        pytest.param((8, 16), "post_filter", {"cuda_max_candidates": 300, "greedy_rows": 127}, id="k300-one-row"),
    ],
)  # fmt: skip
def test_settings_that_change_the_guided_step_stay_allocation_free(layout, mode, options):
    opts = dict(options)
    fit = opts.pop("beta_schedule", None) == "fit"
    res = run(*layout, mode, fit, steps=1, **opts)
    _clean(res)
    assert res["graph_replays"] == (1 if opts.get("ablation") == "frozen" else 2), res
    assert res["allocations"] == res["allocated_bytes"] == 0, res["allocation_sites"]


@pytest.mark.parametrize("mode", ["post_filter", "full_vocab"])
def test_a_head_without_its_weight_allocates_only_its_output_and_says_so(mode, caplog):
    """A head given only as a callable (quantized, soft-capped: vLLM gives no
    lm_head_weight) is called on the workspace's rows; its [R, V] output (bf16 here) is the
    step's allocation, plus post-filter's gather of the [R, k] candidates from it."""
    with caplog.at_level(logging.WARNING, logger="tllm"):
        res = run(8, 16, mode, False, steps=1, plain_head=False)
    _clean(res)
    head = 128 * 152064 * 2
    extra = 128 * 64 * 2 if mode == "post_filter" else 0  # the candidates' gather
    assert res["allocated_bytes"] == head + extra, res["allocation_sites"]
    assert res["allocations"] == (2 if extra else 1), res["allocation_sites"]
    said = [r.getMessage() for r in caplog.records if "lm_head_weight" in r.getMessage()]
    assert len(said) == 1 and "allocates its [rows, vocab] output per step" in said[0]


@pytest.mark.parametrize("fit", [False, True], ids=["constant", "fit"])
@pytest.mark.parametrize("mode", ["post_filter", "full_vocab"])
def test_diagnostics_record_on_the_device_without_a_wait(mode, fit, caplog):
    """diagnostics=true: each step's records go into a ring in the workspace, read at the
    next blocking read-back (or when full, once per 256 guided steps), not in the step."""
    with caplog.at_level(logging.WARNING, logger="tllm"):
        res = run(8, 16, mode, fit, steps=1, diagnostics=True)
    _clean(res)
    assert res["allocations"] == res["allocated_bytes"] == 0, res["allocation_sites"]
    assert caplog.records == []  # nothing to say at start


@pytest.mark.parametrize(
    "prompts, n, mode, fit, steps, greedy_rows",
    [
        (8, 16, "post_filter", False, 4, 0),
        (8, 16, "post_filter", True, 4, 0),
        (8, 16, "full_vocab", False, 4, 0),
        (3, 48, "post_filter", False, 4, 0),  # two update batches: the buffers are not reused
        (8, 16, "post_filter", False, 4, 128),  # nothing guided: updates without a prediction
        (8, 16, "post_filter", False, 40, 0),  # a slot freed and re-claimed, results copied back
    ],
    ids=["8x16-constant", "8x16-fit", "8x16-full_vocab", "3x48", "8x16-greedy", "8x16-40-steps"],
)
def test_esamp_decode_steps_order_their_streams(prompts, n, mode, fit, steps, greedy_rows):
    """FakeCuda(order=True) on the engine's pattern (one set of step tensors, written by each
    step's forward and read by its sampler on the main stream): the side stream stages x and
    the targets only after the main stream wrote them, the main stream reads the prediction
    only after the side stream wrote it and rewrites the tap buffers only after their copy,
    and no pinned plan or result buffer is refilled or read while its copy may be in flight."""
    res = run(prompts, n, mode, fit, steps=steps, order=True, greedy_rows=greedy_rows)
    assert res["races"] == [], "\n".join(res["races"])
    assert res["host_waits"] == [], res["host_waits"]
    assert res["accesses_checked"] > 250 * steps, res  # the steps' work was seen (~450 a step)
    reused = res["updates_reusing_prediction"]
    assert reused == (0 if prompts == 3 or greedy_rows else steps + 1), res
    if steps == 40:
        counted = res["counted_in_the_run"]
        assert counted["groups_freed"] == 1 and counted["groups_created"] == prompts + 1, res
        assert counted["optimizer_steps"] > 0, res  # results copied back during the run


@pytest.mark.parametrize("greedy", [False, True], ids=["guided", "greedy"])
def test_rows_that_ask_for_their_errors_wait_for_nothing_in_the_step(greedy):
    """tllm_results=esamp on the CUDA path (every other prompt asks), stream order checked:
    the steps make no host wait, pageable copy or race (the row errors come from the
    prediction on the side stream and go to pinned memory without a wait; greedy rows, never
    predicted by the guide, get a prediction there first); each asking request's result,
    taken after it finished, has one error per step."""
    from esamp_steps import H, V, _fake_gpu, consumer

    from tllm_core.api.bundles import Bundle, GuideView
    from tllm_core.api.rows import RequestInfo, RowInfo

    prompts, n, steps = 4, 4, 3
    with _fake_gpu(order=True) as fc:
        c = consumer(fc.device, prompts, n, cuda_capacity=prompts)
        ask = {"tllm_results": "esamp"}
        reqs = [
            RequestInfo(f"{p}-{s}", f"r{p}", p, s, 3, dict(ask) if p % 2 == 0 else {})
            for p in range(prompts)
            for s in range(n)
        ]
        r = len(reqs)
        keys = {c.shared.src_key, c.shared.tgt_key, "final"}
        hidden = {k: torch.zeros(r, H, dtype=torch.bfloat16, device=fc.device) for k in keys}
        logits = torch.zeros(r, V, device=fc.device)
        temp = torch.ones(r, device=fc.device)
        is_random = np.full(r, not greedy)
        tokens = torch.zeros(r, dtype=torch.long, device=fc.device)

        @torch.inference_mode()  # as vLLM runs a step
        def step(t: int) -> None:
            rows = RowInfo(
                np.arange(r), reqs, np.full(r, 5 + t), np.ones(r, bool), np.zeros(r, bool), tokens
            )
            for x in (*hidden.values(), logits):  # the forward writes the step's tensors
                x.fill_(1.0)
            view = GuideView(t, rows, logits, temp, is_random, True, hidden)
            c.guide(view)
            view.commit()
            c.on_bundle(Bundle(t, rows, hidden))

        step(0)  # the groups' slots are allocated (host bookkeeping)
        with fc.steps():
            for t in range(1, steps + 1):
                step(t)
        races = [f"x{f.count} {f.where}: {f.what}" for f in fc.findings(None, "race")]
        waits = [f"{f.where} {f.what}" for f in fc.findings(kind="host_wait")]
        copies = [f"{f.where} {f.what}" for f in fc.findings(kind="pageable_copy")]
        results = {}
        for q in reqs:  # after the steps: the closing read's wait is expected
            c.on_request_finished(q)
            if q.wants_result("esamp"):
                results[q.engine_id] = c.request_result(q)
    assert races == waits == copies == [], (races, waits, copies)
    assert len(results) == 2 * n
    for got in results.values():
        assert got["positions"].tolist() == [5 + t for t in range(steps + 1)]
        assert got["prediction_error"].shape == (steps + 1,)
    assert c.counters.get("rows_returned") == 2 * n * (steps + 1)

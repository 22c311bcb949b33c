"""ESamp's two guidance strategies (``algorithms/esamp/guide_step.py``: ``HostGuide``,
allocating, exact candidate search; ``CudaGuide``, every
temporary in the preallocated workspace, fixed-size candidate search), picked at construction
(``ESampConsumer(..., cuda_path=)``), run on CPU: both against the spec's mix written out here,
and against each other bit for bit over both mixing modes, latent and logits mixes,
beta_schedule 'fit', a model in fp32 and in bf16 (the head's output then lives in the view
buffers' masks), steps with prefill, greedy, beta-0 and non-finite rows. The candidate cap
(``cuda_max_candidates``) is tested in ``test_esamp_math.py``, the device allocations on the
fake device in ``tests/test_esamp_fake_cuda.py``."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from test_esamp_math import INTER, H, V, _filtered_logits

from algorithms.esamp import guide_workspace
from algorithms.esamp.config import ESampConfig
from algorithms.esamp.consumer import ESampConsumer
from algorithms.esamp.guidance import candidate_shift
from algorithms.esamp.guide_step import CudaGuide, HostGuide
from tllm_core.api.bundles import Bundle, GuideView
from tllm_core.api.consumer import ConsumerContext, ModelInfo
from tllm_core.api.ports import resolve_layer
from tllm_core.api.rows import RequestInfo, RowInfo


def _consumer(w: torch.Tensor, cuda: bool, plain_head: bool = True, **cfg) -> ESampConsumer:
    # plain_head=False: no lm_head_weight (a quantized or soft-capped head): the model's head
    # is called (it returns the model dtype, like vLLM's compute_logits)
    weight = w if plain_head else None
    model = ModelInfo(H, 4, V, w.dtype, torch.device("cpu"), lambda z: z @ w.t(), weight)
    c = ESampConsumer(
        ESampConfig(intermediate_size=INTER, cpu_update="inline", **cfg),
        ConsumerContext(model, lambda i: resolve_layer(i, 4)),
        cuda_path=cuda,
    )
    assert type(c.guide_step) is (CudaGuide if cuda else HostGuide)
    return c


@pytest.mark.parametrize("cuda", [False, True], ids=["host", "cuda"])
@pytest.mark.parametrize(
    "mode,mix", [("post_filter", "logits"), ("full_vocab", "logits"), ("full_vocab", "latent")]
)
def test_guided_logits_equal_the_spec_mix(cuda, mode, mix):
    """One step of 2 prompts x 3 samples (one row greedy, one at beta 0, one at its own beta,
    a temperature per row) against the spec's mix ("mix before temperature", written out in
    fp64): a guided row's candidate ``c`` becomes ``(1+b) l_c - b (W_c . f) / T`` (``l``: the
    sampler's logits, already divided by ``T``; post-filter: its finite entries only), or with
    the latent mix ``W_c . ((1+b) h_L - b f) / T``; the other rows are left as they are."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(V, H, generator=g)
    c = _consumer(w, cuda, mode=mode, mix=mix, beta=0.7, cuda_max_candidates=8)
    reqs = [RequestInfo(f"{p}-{s}", f"r{p}", p, s, 3) for p in range(2) for s in range(3)]
    reqs[2].extra_args = {"tllm_esamp_beta": 1.5}
    reqs[4].extra_args = {"tllm_esamp_beta": 0.0}
    r = len(reqs)
    rows = RowInfo(np.arange(r), reqs, np.full(r, 5), np.ones(r, bool), np.zeros(r, bool), None)
    hidden = {"layer.0": torch.randn(r, H, generator=g), "final": torch.randn(r, H, generator=g)}
    post = mode == "post_filter"
    logits = _filtered_logits(r, V, keep=7, seed=1) if post else torch.randn(r, V, generator=g)
    temp = torch.linspace(0.6, 1.2, r)
    is_random = np.array([True] * (r - 1) + [False])
    view = GuideView(0, rows, logits.clone(), temp, is_random, post, hidden)
    c.guide(view)
    view.commit()
    guided = torch.arange(r - 1)  # the greedy row is not predicted
    slots = torch.tensor([c.groups.by_key[q.request_id].slot for q in reqs[: r - 1]])
    f = c.distiller.predict(slots, hidden["layer.0"][guided]).double()
    b = torch.tensor([0.7, 0.7, 1.5, 0.7, 0.0], dtype=torch.float64)[:, None]
    t = temp[guided].double()[:, None]
    wd, ref = w.double(), logits[guided].double()
    if mix == "latent":
        expect = ((1 + b) * hidden["final"][guided].double() - b * f) @ wd.t() / t
    else:
        expect = (1 + b) * ref - b * (f @ wd.t()) / t
    expect = torch.where(torch.isfinite(ref), expect, ref)
    expect[4] = ref[4]  # beta 0: untouched
    torch.testing.assert_close(view.logits[guided].double(), expect, rtol=1e-5, atol=1e-5)
    assert torch.equal(view.logits[r - 1], logits[r - 1])  # the greedy row
    c.close()


def _run(
    cuda: bool, dtype: torch.dtype, mode: str, fit: bool, mix: str, **more
) -> tuple[list, dict]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(V, H, generator=g).to(dtype)
    extra = {"beta_schedule": "fit", "init": "zero", "lr": 1e-2} if fit else {}
    # 8 >= the 6 candidates per row: the CUDA strategy's cap drops none
    cfg = {"mode": mode, "mix": mix, "beta": 0.7, "cuda_max_candidates": 8, **extra, **more}
    c = _consumer(w, cuda, **cfg)
    reqs = [RequestInfo(f"{p}-{s}", f"r{p}", p, s, 3) for p in range(2) for s in range(3)]
    reqs[4].extra_args = {"tllm_esamp_beta": 0.0}
    out = []
    for t in range(5):
        r = len(reqs)
        decode = np.array([t != 2 or i != 0 for i in range(r)])  # step 2: row 0 prefill
        rows = RowInfo(np.arange(r), reqs, np.full(r, 5), decode, np.zeros(r, bool), None)
        h1 = torch.randn(r, H, generator=g)
        hl = h1 + 0.3 * torch.randn(r, H, generator=g)  # learnable: the fit's error < 1
        if t == 3:
            h1[1, 0] = float("nan")  # row 1: a non-finite prediction
        hidden = {"layer.0": h1.to(dtype), "final": hl.to(dtype)}
        filtered = mode == "post_filter"
        # 6 candidates per row: the host's candidate pairs stay under a quarter of the guided
        # rows' vocabulary (at 7 its dense switch takes one head product for them: equal to
        # rounding, not bit for bit, to the CUDA strategy's gather-dot)
        logits = (
            _filtered_logits(r, V, keep=6, seed=t) if filtered else torch.randn(r, V, generator=g)
        )
        is_random = np.array([True] * (r - 1) + [t == 0])  # the last row greedy from step 1
        temp = torch.linspace(0.6, 1.2, r)
        view = GuideView(t, rows, logits, temp, is_random, filtered, hidden)
        c.guide(view)
        view.commit()
        out.append(view.logits.clone())
        c.on_bundle(Bundle(t, rows, {k: v.clone() for k, v in hidden.items()}))
    res = c.result()
    records = getattr(c.guide_step, "records", None)
    c.close()
    sent = None if records is None else (records.halves_sent, records.waits)
    return out, {**res["counters"], "diagnostics": res.get("diagnostics"), "halves_sent": sent}


@pytest.mark.parametrize("fit", [False, True], ids=["constant", "fit"])
@pytest.mark.parametrize(
    "mode,mix", [("post_filter", "logits"), ("full_vocab", "logits"), ("full_vocab", "latent")]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_cuda_strategy_equals_the_host_one(dtype, mode, mix, fit):
    _check_equal(dtype, mode, mix, fit)


@pytest.mark.parametrize("fit", [False, True], ids=["constant", "fit"])
@pytest.mark.parametrize(
    "mode,mix", [("post_filter", "logits"), ("full_vocab", "logits"), ("full_vocab", "latent")]
)
@pytest.mark.parametrize(
    "more",
    [
        {"ablation": "noise"},
        {"ablation": "f_noise"},
        {"plain_head": False},
        {"cuda_max_candidates": 30},
        {"diagnostics": True},
    ],
    ids=["noise", "f_noise", "head_without_weight", "k30", "diagnostics"],
)
def test_ablations_and_a_head_without_weight_equal_across_strategies(more, mode, mix, fit):
    """The noise ablations (the stand-in prediction made in the workspace from the same
    generator), a head given only as a callable (latent mixing then falls back to logits)
    and 30 candidates of 40 tokens per row (more pairs than a quarter of the guided rows'
    logits: the gather-dot still), in bf16; diagnostics: the records made on the device (read
    at the end) equal the host strategy's (the candidate shift's tv to rounding)."""
    _check_equal(torch.bfloat16, mode, mix, fit, **more)


def _check_equal(dtype: torch.dtype, mode: str, mix: str, fit: bool, **more) -> None:
    host, k_host = _run(False, dtype, mode, fit, mix, **more)
    fast, k_fast = _run(True, dtype, mode, fit, mix, **more)
    for t, (a, b) in enumerate(zip(host, fast, strict=True)):
        assert torch.equal(a, b), (t, (a != b).sum())
    names = (
        "rows_guided",
        "candidates_guided",
        "candidates_over_cap",
        "rows_visited",
        "fit_rows",
        "latent_fallback_rows",
    )
    assert {n: k_fast[n] for n in names} == {n: k_host[n] for n in names}
    # the host sums each step's scales on the host, the CUDA strategy on the device (fp32)
    assert k_fast["fit_scale_mean"] == pytest.approx(k_host["fit_scale_mean"], rel=1e-6)
    assert k_fast["rows_guided"] > 0  # the steps did guide
    assert k_fast["candidates_over_cap"] == 0
    if fit:
        assert 0 < k_fast["fit_scale_mean"] < 1
    if more.get("diagnostics"):
        _check_diagnostics(k_host, k_fast, mode)


def _check_diagnostics(k_host: dict, k_fast: dict, mode: str) -> None:
    d_host, d_fast = k_host["diagnostics"], k_fast["diagnostics"]
    assert d_fast["rel_err_curve"] == d_host["rel_err_curve"]
    assert len(d_fast["rel_err_curve"]) >= 4  # the groups' steps 0.. were recorded
    for n in ("diag_rows", "diag_top_changed"):
        assert k_fast[n] == k_host[n], n
    if mode == "full_vocab":  # the candidate shift is post-filter's
        assert d_fast["age"] == [] and k_fast["diag_rows"] == 0
        return
    assert k_fast["diag_rows"] > 0
    for n in ("age", "rel_err", "candidates", "top_ref", "top_new", "beta"):
        assert d_fast[n] == d_host[n], n
    assert d_fast["tv"] == pytest.approx(d_host["tv"], rel=1e-5, abs=1e-7)
    assert max(d_fast["tv"]) > 0


def test_diagnostics_records_survive_a_full_ring(monkeypatch):
    """A ring of 2 steps (halves of one) over 5 guided steps: each full half is sent to the
    host (no wait: on CPU it has arrived at once) and reused; the records equal the general
    path's all the same."""
    monkeypatch.setattr(guide_workspace, "DIAG_STEPS", 2)
    host, k_host = _run(False, torch.bfloat16, "post_filter", True, "logits", diagnostics=True)
    fast, k_fast = _run(True, torch.bfloat16, "post_filter", True, "logits", diagnostics=True)
    assert k_fast["halves_sent"] == (4, 0)  # steps 2 to 5 found their half full; no wait
    _check_diagnostics(k_host, k_fast, "post_filter")


def test_a_step_with_more_rows_than_planned_is_refused_by_name():
    w = torch.randn(V, H)
    c = _consumer(w, True, cuda_rows_per_step=4)
    reqs = [RequestInfo(f"0-{s}", "r0", 0, s, 3) for s in range(6)]
    rows = RowInfo(np.arange(6), reqs, np.full(6, 5), np.ones(6, bool), np.zeros(6, bool), None)
    hidden = {"layer.0": torch.randn(6, H), "final": torch.randn(6, H)}
    view = GuideView(0, rows, torch.randn(6, V), torch.ones(6), np.ones(6, bool), True, hidden)
    with pytest.raises(ValueError, match="6 rows exceeds cuda_rows_per_step=4"):
        c.guide(view)
    c.close()


def test_the_candidate_shift_fills_its_workspace_parts():
    """The diagnostics' shift parts are sized to what candidate_shift writes (no unused
    columns in the plan)."""
    shape = guide_workspace.GuideShape(4, H, V, 8, "post_filter", 2, torch.float32)
    ws = guide_workspace.GuideWorkspace(replace(shape, diagnostics=True), torch.device("cpu"))
    logits = _filtered_logits(4, 8, keep=3)
    shift = candidate_shift(logits, logits, torch.isfinite(logits), None, ws)
    assert shift.shape == ws.parts["dg_rows"].shape == ws.parts["dg_sel"].shape == (4, 4)

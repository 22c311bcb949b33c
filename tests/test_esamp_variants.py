"""ESamp's learning variants (CPU, no vLLM): zero-output init, prefill warm start, beta scaled by
the distiller's fit, and the diagnostics; each checked against a reference computation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from test_esamp_math import INTER, Fake, V, _filtered_logits

from algorithms.esamp import guide_step
from algorithms.esamp.config import ESampConfig
from algorithms.esamp.cpu import GroupedDistiller
from algorithms.esamp.guidance import candidate_shift, fit_scale, mix_candidates, relative_error
from tllm_core.api.bundles import Bundle
from tllm_core.api.ports import Phase


def _ref_distiller(h: int, init: str) -> GroupedDistiller:
    return GroupedDistiller(h, intermediate_size=INTER, init=init, seed=0)


def _mixed_as(logits: torch.Tensor, f: torch.Tensor, w: torch.Tensor, beta, temp: float):
    """Reference post-filter mix of ``logits`` with prediction ``f`` (per-row beta)."""
    beta = torch.as_tensor(beta, dtype=torch.float32).reshape(-1, 1).expand_as(logits)
    dist = f @ w.t()
    out = logits.clone()
    m = torch.isfinite(logits)
    out[m] = mix_candidates(logits[m], dist[m], beta[m], torch.tensor(temp))
    return out


def test_config_validation_of_new_fields():
    for bad in ({"warm_start_steps": -1}, {"fit_decay": 1.0}, {"fit_decay": -0.1}):
        with pytest.raises(ValidationError):
            ESampConfig(**bad)
    with pytest.raises(ValidationError):
        ESampConfig(init="zeros")
    with pytest.raises(ValidationError):
        ESampConfig(beta_schedule="grow")
    cfg = ESampConfig(init="zero_output", warm_start_steps=3, beta_schedule="fit")
    assert cfg.warm_start_steps == 3 and ESampConfig().beta_schedule == "constant"


# -- zero-output init -----------------------------------------------------------------------
def test_zero_output_untrained_is_pure_sharpening_and_learns_like_reference():
    fake = Fake()
    c = fake.consumer(init="zero_output", lr=1e-2)
    reqs = fake.requests(1, 2)
    rows, hidden = fake.step(reqs)
    logits = _filtered_logits(2, V, keep=6) / 0.8
    v = fake.view(rows, hidden, logits)
    c.guide(v)
    m = torch.isfinite(logits)
    # f = 0: the mix is (1 + beta) * ref on the candidates.
    torch.testing.assert_close(v.logits[m], 1.25 * logits[m])
    assert torch.equal(torch.isfinite(v.logits), m)
    # Training: the blocks learn target + x, the prediction is blocks(x) - x.
    ref = _ref_distiller(hidden["layer.0"].shape[1], "zero")
    ref.hp = c.distiller.hp
    slot = ref.alloc()
    slots = torch.tensor([slot, slot])
    x, t = hidden["layer.0"], hidden["final"]
    for step in range(3):
        c.on_bundle(Bundle(step, rows, hidden))
        ref.train_step(slots, x, t + x)
    got = c.distiller.predict(torch.tensor([c.groups.by_key["r0"].slot] * 2), x)
    torch.testing.assert_close(got, ref.predict(slots, x) - x)
    assert not torch.equal(got, torch.zeros_like(got))  # it learned something
    # ... and the paper init would not start at zero.
    p = fake.consumer()
    p.guide(fake.view(rows, hidden, logits))
    assert not torch.allclose(p.distiller.predict(torch.tensor([0, 0]), x), torch.zeros_like(x))


# -- warm start on prefill rows --------------------------------------------------------------
def _prefill_bundle(fake: Fake, reqs, n_tok: int, step: int = 0):
    """``n_tok`` prefill rows of every request (requests in order), as the runtime packs them."""
    rr = [r for r in reqs for _ in range(n_tok)]
    rows, hidden = fake.step(rr, decode=[False] * len(rr))
    return Bundle(step, rows, hidden), rows, hidden


def test_warm_start_takes_what_one_step_holds_each_groups_last_prompt_rows():
    """A distiller whose step holds fewer rows than the new groups' prompts (CUDA: capacity x
    cuda_graph_max_rows) warms each group on an equal share, its last prompt rows, instead
    of raising for the whole bundle (every request of it marked failed)."""
    fake = Fake()
    c = fake.consumer(warm_start_steps=1, lr=1e-2)
    c.distiller.max_step_rows = 6
    reqs = fake.requests(prompts=2, n=2)
    bundle, rows, hidden = _prefill_bundle(fake, reqs, n_tok=4)
    c.on_bundle(bundle)
    c.result()
    k = c.counters.snapshot()
    assert k["warm_start_rows"] == 6 and k["warm_start_rows_skipped"] == 2, k
    assert k["warm_start_steps"] == 2
    ref = _ref_distiller(hidden["layer.0"].shape[1], "paper")
    ref.hp = c.distiller.hp
    s = ref.alloc()
    x, t = hidden["layer.0"][1:4], hidden["final"][1:4]  # group r0's first request: last 3
    ref.train_step(torch.tensor([s] * 3), x, t)
    c.distiller.synchronize()
    torch.testing.assert_close(c.distiller.theta[c.groups.by_key["r0"].slot], ref.theta[s])


@pytest.mark.parametrize("ablation", ["none", "frozen"])
def test_warm_start_trains_each_group_on_its_first_request_prefill(ablation):
    fake = Fake()
    steps = 3
    c = fake.consumer(warm_start_steps=steps, lr=1e-2, ablation=ablation)
    assert {p.phase for p in c.reads()} == {Phase.ALL}
    assert {p.phase for p in fake.consumer().reads()} == {Phase.DECODE}
    reqs = fake.requests(prompts=2, n=2)  # groups r0, r1 of two requests each
    bundle, rows, hidden = _prefill_bundle(fake, reqs, n_tok=4)
    c.on_bundle(bundle)
    c.result()  # reads the steps' results back (the CPU distiller trains on a side thread)
    k = c.counters.snapshot()
    assert k["groups_created"] == 2
    h = hidden["layer.0"].shape[1]
    if ablation == "frozen":
        assert k["warm_start_steps"] == 0 and k["train_rows_skipped_frozen"] == 8
        assert torch.equal(c.distiller.theta[0], c.distiller.template)
        return
    assert k["warm_start_groups"] == 2 and k["warm_start_rows"] == 8
    assert k["warm_start_steps"] == 2 * steps
    # Reference: each group's distiller trained `steps` times on its first request's rows.
    for g_idx, first_rows in ((0, slice(0, 4)), (1, slice(8, 12))):
        ref = _ref_distiller(h, "paper")
        ref.hp = c.distiller.hp
        s = ref.alloc()
        x, t = hidden["layer.0"][first_rows], hidden["final"][first_rows]
        for _ in range(steps):
            ref.train_step(torch.tensor([s] * 4), x, t)
        slot = c.groups.by_key[f"r{g_idx}"].slot
        c.distiller.synchronize()
        torch.testing.assert_close(c.distiller.theta[slot], ref.theta[s])
    # A group warms once: a later prefill chunk of the same prompt does not train again.
    bundle2, _, _ = _prefill_bundle(fake, reqs[:1], n_tok=2, step=1)
    c.on_bundle(bundle2)
    c.result()
    assert c.counters.get("warm_start_steps") == 2 * steps
    # Decode rows train as without a warm start (warm steps are not counted as decode steps).
    rows_d, hidden_d = fake.step(reqs)
    c.on_bundle(Bundle(2, rows_d, hidden_d))
    c.result()
    assert c.counters.get("optimizer_steps") == 2 and c.counters.get("rows_trained") == 4


def test_warm_start_steps_count_only_updates_that_ran():
    """warm_start_steps is read back from the distiller's results: steps whose loss is
    non-finite update nothing and are counted as skipped, not as done."""
    fake = Fake()
    steps = 3
    c = fake.consumer(warm_start_steps=steps, lr=1e-2)
    reqs = fake.requests(prompts=2, n=1)
    bundle, _, hidden = _prefill_bundle(fake, reqs, n_tok=4)
    hidden["final"][:4] = float("nan")  # the first group's targets: its loss is NaN
    c.on_bundle(bundle)
    c.result()
    k = c.counters.snapshot()
    # Both groups were selected; only the finite one was updated, and only it is counted.
    assert k["warm_start_groups"] == 1 and k["warm_start_rows"] == 4
    assert k["warm_start_steps"] == steps
    assert k["nonfinite_losses_skipped"] == steps


# -- beta scaled by the distiller's fit -------------------------------------------------------
def test_fit_scale_and_relative_error_reference():
    h = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 0.0]])
    f = torch.tensor([[3.0, 4.0], [0.0, 0.0], [1.0, 1.0]])
    torch.testing.assert_close(relative_error(h, f), torch.tensor([0.0, 1.0, 1.0]))
    torch.testing.assert_close(
        fit_scale(torch.tensor([0.0, 0.25, 1.0, 1.5])), torch.tensor([1.0, 0.75, 0.0, 0.0])
    )


@pytest.mark.parametrize("cuda", [False, True], ids=["host", "cuda"])
def test_fit_schedule_beta_follows_the_groups_error_average(cuda):
    """Both guidance strategies (``cuda``: the workspace's errors per slot)."""
    fake = Fake()
    decay, beta, temp = 0.5, 0.5, 0.8
    c = fake.consumer(
        beta_schedule="fit", fit_decay=decay, beta=beta, lr=1e-2, init="zero", cuda_path=cuda
    )
    reqs = fake.requests(prompts=2, n=1)
    rows, hidden = fake.step(reqs)
    x, t = hidden["layer.0"], hidden["final"]
    # A target close to the input: the identity-initialised distiller fits it partly.
    hidden["final"] = t = x + 0.3 * t
    logits = _filtered_logits(2, V, keep=6) / temp
    err = torch.ones(2)  # every group starts at error 1: no guidance
    for step in range(4):
        v = fake.view(rows, hidden, logits, temp=temp)
        slots = torch.tensor([c.groups.by_key[f"r{i}"].slot for i in range(2)] if step else [0, 1])
        c.guide(v)
        f = c.distiller.predict(slots, x)
        expect = _mixed_as(logits, f, fake.w, beta * (1 - err).clamp(0, 1), temp)
        torch.testing.assert_close(v.logits, expect)
        if step == 0:
            assert torch.equal(v.logits, logits)  # scale 0: untouched
        err = decay * err + (1 - decay) * relative_error(t, f)
        c.on_bundle(Bundle(step, rows, hidden))
    k = c.result()["counters"]  # the CUDA strategy's sums are read at a flush
    assert 0 < k["fit_scale_mean"] < 1 and k["fit_rows"] == 8
    assert not torch.equal(v.logits, logits)


@pytest.mark.parametrize("fit", [False, True], ids=["constant", "fit"])
def test_a_step_builds_the_slots_and_groups_only_for_fit(fit, monkeypatch):
    """The slots, their fresh list and the groups are the fit's (and the diagnostics'):
    a step without them looks up no group and stages only the betas."""
    fake = Fake()
    c = fake.consumer(beta_schedule="fit" if fit else "constant")

    class Lookups(dict):
        n = 0

        def __getitem__(self, slot):
            Lookups.n += 1
            return super().__getitem__(slot)

    c.groups.by_slot = Lookups(c.groups.by_slot)
    staged = []
    real = guide_step.host_to_device
    record = lambda t, dev: staged.append(t) or real(t, dev)  # noqa: E731
    monkeypatch.setattr(guide_step, "host_to_device", record)
    rows, hidden = fake.step(fake.requests(2, 2))
    c.guide(fake.view(rows, hidden, _filtered_logits(4, V, keep=6)))
    assert Lookups.n == (4 if fit else 0)
    assert len(staged) == (3 if fit else 1)  # betas (+ slots, fresh)


def test_fit_schedule_paper_init_stays_unguided_while_error_exceeds_one():
    fake = Fake()
    c = fake.consumer(beta_schedule="fit", ablation="frozen")
    reqs = fake.requests(1, 2)
    rows, hidden = fake.step(reqs)
    logits = _filtered_logits(2, V, keep=6)
    for step in range(3):
        v = fake.view(rows, hidden, logits)
        c.guide(v)
        assert torch.equal(v.logits, logits)
        c.on_bundle(Bundle(step, rows, hidden))
    assert c.counters.get("fit_scale_mean") == 0


# -- diagnostics -------------------------------------------------------------------------------
def test_candidate_shift_matches_dense_reference():
    g = torch.Generator().manual_seed(3)
    ref_dense = _filtered_logits(4, 12, keep=5, seed=1)
    ref_dense[2] = float("-inf")  # a row without candidates
    new_dense = ref_dense + torch.randn(4, 12, generator=g)
    shift = candidate_shift(ref_dense, new_dense, torch.isfinite(ref_dense))
    count, top_r, top_n, tv = shift.T
    for r in range(4):
        m = torch.isfinite(ref_dense[r])
        if not m.any():  # defined values (the ring holds them), never recorded
            assert count[r] == 0 and top_r[r] == top_n[r] == -1 and tv[r] == 0
            continue
        p = torch.softmax(ref_dense[r][m], -1)
        q = torch.softmax(new_dense[r][m], -1)
        torch.testing.assert_close(tv[r], 0.5 * (p - q).abs().sum())
        assert top_r[r] == int(ref_dense[r].argmax()) and top_n[r] == int(new_dense[r].argmax())
        assert count[r] == int(m.sum())


def test_host_diagnostics_measure_the_candidates_only(monkeypatch):
    """The host's candidate shift equals the dense one (each mixed row's finite logits before
    and after) but is measured on ``[rows, candidates]``, never ``[rows, vocab]``."""
    fake = Fake()
    c = fake.consumer(diagnostics=True, beta=2.0)
    reqs = fake.requests(1, 4)
    reqs[3].extra_args = {"tllm_esamp_beta": 0.0}  # guided, not mixed: not recorded
    rows, hidden = fake.step(reqs)
    logits = _filtered_logits(4, V, keep=6)
    logits[1] = torch.where(logits[1] >= logits[1].topk(3).values[-1], logits[1], float("-inf"))
    widths = []
    real = guide_step.candidate_shift
    monkeypatch.setattr(
        guide_step, "candidate_shift", lambda b, *a: widths.append(b.shape[1]) or real(b, *a)
    )
    v = fake.view(rows, hidden, logits)
    c.guide(v)
    assert widths == [6]  # the widest row's candidates
    d = c.result()["diagnostics"]
    live = torch.isfinite(logits)
    live[3] = False
    count, top_r, top_n, tv = real(logits, v.logits, live)[:3].T
    assert d["candidates"] == [6, 3, 6] == count.long().tolist()
    assert d["top_ref"] == top_r.long().tolist() and d["top_new"] == top_n.long().tolist()
    np.testing.assert_allclose(d["tv"], tv.tolist(), rtol=1e-6)
    assert min(d["tv"]) > 0


def test_diagnostics_record_each_guided_row():
    fake = Fake()
    c = fake.consumer(diagnostics=True, beta=2.0)
    reqs = fake.requests(1, 3)
    rows, hidden = fake.step(reqs)
    logits = _filtered_logits(3, V, keep=6)
    for step in range(2):
        c.guide(fake.view(rows, hidden, logits))
        # The prediction the guidance just used (before this step's training).
        f = c.distiller.predict(torch.tensor([0, 0, 0]), hidden["layer.0"])
        c.on_bundle(Bundle(step, rows, hidden))
    d = c.result()["diagnostics"]
    json.dumps(d)
    assert d["age"] == [0, 0, 0, 1, 1, 1] and d["candidates"] == [6] * 6
    ref_rel = relative_error(hidden["final"], f)
    np.testing.assert_allclose(d["rel_err"][3:], ref_rel.tolist(), rtol=1e-5)
    assert all(0 <= t <= 1 for t in d["tv"]) and max(d["tv"]) > 0
    assert [a for a, _, _ in d["rel_err_curve"]] == [0, 1]
    changed = sum(a != b for a, b in zip(d["top_ref"], d["top_new"], strict=True))
    assert c.counters.get("diag_top_changed") == changed and c.counters.get("diag_rows") == 6
    assert "diagnostics" not in fake.consumer().result()

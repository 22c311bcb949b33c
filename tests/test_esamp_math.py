"""Fast ESamp tests (CPU, no vLLM): mixing math, grouped distiller, consumer bookkeeping."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from algorithms.esamp.config import ESampConfig
from algorithms.esamp.consumer import ESampConsumer
from algorithms.esamp.cpu import GroupedDistiller
from algorithms.esamp.guidance import (
    candidate_dist,
    mix_full_vocab_logits,
    mix_latent,
    noise_prediction,
)
from algorithms.esamp.params import split_params
from algorithms.esamp.slots import make_packing
from tllm_core.api.bundles import Bundle, GuideView
from tllm_core.api.consumer import ConsumerContext, ModelInfo
from tllm_core.api.ports import SamplerGuide, resolve_layer
from tllm_core.api.rows import RequestInfo, RowInfo

H, V, INTER = 16, 40, 8


def _filtered_logits(r: int, v: int, keep: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(r, v, generator=g)
    kth = logits.topk(keep, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _state(d: GroupedDistiller, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for t in (d.theta, d.m, d.v, d.step)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- guidance -------------------------------------------------------------------------
def _dense_inputs(d: GroupedDistiller, rows: torch.Tensor, x, t, m: int = 4):
    pk = make_packing(rows)
    s_total = d.theta.shape[0]
    rg, rp = torch.from_numpy(pk.slots[pk.row_group]), torch.from_numpy(pk.row_pos)
    xp, tp = torch.zeros(s_total, m, H), torch.zeros(s_total, m, H)
    mask = torch.zeros(s_total, m, dtype=torch.bool)
    xp[rg, rp], tp[rg, rp], mask[rg, rp] = x, t, True
    valid = torch.zeros(s_total, dtype=torch.bool)
    valid[torch.from_numpy(pk.slots)] = True
    return pk, valid, xp, tp, mask


@pytest.mark.parametrize("dense_fraction", [0.0, 1.0])
def test_candidate_dist_paths_agree(dense_fraction):
    w, f = torch.randn(V, H), torch.randn(4, H)
    rows = torch.tensor([0, 0, 1, 3, 3])
    toks = torch.tensor([1, 7, 2, 39, 0])
    got = candidate_dist(f, rows, toks, w, lambda z: z @ w.t(), dense_fraction=dense_fraction)
    torch.testing.assert_close(got, (f @ w.t())[rows, toks])


def test_latent_mix_equals_two_projection_mix():
    torch.manual_seed(1)
    w, h_l, f = torch.randn(V, H), torch.randn(5, H) * 3, torch.randn(5, H) * 3
    temp = torch.full((5,), 0.8)
    beta = 0.25
    two = mix_full_vocab_logits((h_l @ w.t()) / temp[:, None], f @ w.t(), beta, temp)
    one = (mix_latent(h_l, f, beta) @ w.t()) / temp[:, None]
    torch.testing.assert_close(one, two, rtol=1e-5, atol=1e-4)
    expect = (1 + beta) * (h_l @ w.t()) - beta * (f @ w.t())
    torch.testing.assert_close(one * temp[:, None], expect, rtol=1e-5, atol=1e-4)


def test_beta_zero_is_bit_identical():
    full = torch.randn(3, V)
    assert torch.equal(mix_full_vocab_logits(full, torch.randn(3, V), 0.0, torch.ones(3)), full)


def test_noise_prediction_matches_error_norm():
    h_l, f = torch.randn(6, H), torch.randn(6, H)
    g = torch.Generator().manual_seed(0)
    fake = noise_prediction(h_l, f, g)
    torch.testing.assert_close((h_l - fake).norm(dim=-1), (h_l - f).norm(dim=-1))
    assert not torch.allclose(fake, f)


# -- distiller ------------------------------------------------------------------------
def _distiller(**kw) -> GroupedDistiller:
    kw.setdefault("intermediate_size", INTER)
    return GroupedDistiller(H, **kw)


def test_packing_plan():
    pk = make_packing(torch.tensor([3, 1, 3, 3, 1, 0]))
    assert pk.slots.tolist() == [0, 1, 3] and pk.max_rows == 3
    assert pk.row_group.tolist() == [2, 1, 2, 2, 1, 0]
    assert pk.row_pos.tolist() == [0, 0, 1, 2, 1, 0]


def test_predict_matches_per_group_forward():
    d = _distiller(init="paper")
    a, b = d.alloc(), d.alloc()
    d.train_step(torch.tensor([a] * 3), torch.randn(3, H), torch.randn(3, H))  # make a != b
    x = torch.randn(5, H)
    slots = torch.tensor([a, b, a, b, b])
    y = d.predict(slots, x)
    for i in range(5):
        torch.testing.assert_close(y[i : i + 1], d.predict(slots[i : i + 1], x[i : i + 1]))


def test_zero_init_is_identity():
    d = _distiller(init="zero")
    s = d.alloc()
    x = torch.randn(4, H)
    assert torch.equal(d.predict(torch.tensor([s] * 4), x), x)


def test_loss_falls_on_repeated_context():
    torch.manual_seed(0)
    d = _distiller(lr=1e-2)
    s = d.alloc()
    x, t = torch.randn(8, H), torch.randn(8, H)
    losses = [float(d.train_step(torch.tensor([s] * 8), x, t).losses[0]) for _ in range(60)]
    assert losses[-1] < 0.3 * losses[0], losses[::10]


def test_groups_never_influence_each_other():
    torch.manual_seed(0)
    d = _distiller()
    a, b, c = d.alloc(), d.alloc(), d.alloc()
    xa, ta = torch.randn(5, H), torch.randn(5, H) * 10  # big: clipping active for a
    xb, tb = torch.randn(2, H), torch.randn(2, H)
    before_c = _state(d, c)
    # b trained alone ...
    solo = _distiller()
    sb = solo.alloc()
    solo.train_step(torch.tensor([sb, sb]), xb, tb)
    # ... equals b trained alongside a (rows interleaved), and c is untouched bit for bit.
    slots = torch.tensor([a, b, a, a, b, a, a])
    x = torch.cat([xa[:1], xb[:1], xa[1:3], xb[1:], xa[3:]])
    t = torch.cat([ta[:1], tb[:1], ta[1:3], tb[1:], ta[3:]])
    res = d.train_step(slots, x, t)
    assert res.slots.tolist() == [a, b, c][:2] and res.updated.all()
    assert _same(_state(d, c), before_c)
    torch.testing.assert_close(d.theta[b], solo.theta[sb], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(d.v[b], solo.v[sb], rtol=1e-6, atol=1e-12)
    # Training only a leaves b and c bitwise unchanged.
    before_b, before_c = _state(d, b), _state(d, c)
    d.train_step(torch.tensor([a] * 5), xa, ta)
    assert _same(_state(d, b), before_b) and _same(_state(d, c), before_c)


def test_nonfinite_loss_is_skipped_per_group():
    d = _distiller()
    a, b = d.alloc(), d.alloc()
    x, t = torch.randn(4, H), torch.randn(4, H)
    x[0, 3] = float("nan")
    before_a, before_b = _state(d, a), _state(d, b)
    res = d.train_step(torch.tensor([a, a, b, b]), x, t)
    assert res.updated.tolist() == [False, True]
    assert not torch.isfinite(res.losses[0]) and torch.isfinite(res.losses[1])
    assert _same(_state(d, a), before_a)
    assert not _same(_state(d, b), before_b)


def test_free_resets_and_capacity_is_bounded():
    d = _distiller(capacity=4)
    mem = d.memory_bytes()
    for _ in range(200):
        s = d.alloc()
        d.train_step(torch.tensor([s, s]), torch.randn(2, H), torch.randn(2, H))
        d.free(s)
    assert d.num_live == 0 and d.capacity == 4 and d.memory_bytes() == mem
    assert torch.equal(d.theta[:4], d.template.expand(4, -1))
    assert not d.m.any() and not d.v.any() and not d.step.any()
    with pytest.raises(ValueError, match="not live"):
        d.free(0)
    with pytest.raises(ValueError, match="not live"):
        d.predict(torch.tensor([0]), torch.randn(1, H))


def test_capacity_doubles_and_keeps_state():
    d = _distiller(capacity=2)
    slots = [d.alloc() for _ in range(2)]
    d.train_step(torch.tensor(slots), torch.randn(2, H), torch.randn(2, H))
    kept = [_state(d, s) for s in slots]
    slots += [d.alloc() for _ in range(3)]
    assert d.capacity == 8 and d.num_live == 5 and len(set(slots)) == 5
    assert all(_same(_state(d, s), k) for s, k in zip(slots[:2], kept, strict=True))
    assert d.memory_bytes_per_group() == (3 * 2 * INTER * H * 3 + 1) * 4


@pytest.mark.parametrize("target_scale", [10.0, 0.01])  # clipping active / inactive
def test_batched_adam_clip_matches_torch_optim(target_scale):
    torch.manual_seed(0)
    d = _distiller(lr=1e-2, eps=1e-4, grad_clip=0.5, capacity=1)
    s = d.alloc()
    gate, up, down = split_params(d.template[None].clone(), d.shape)
    params = [torch.nn.Parameter(p[0].clone()) for p in (gate, up, down)]
    opt = torch.optim.Adam(params, lr=1e-2, eps=1e-4, betas=(0.9, 0.999))
    x, t = torch.randn(6, H), torch.randn(6, H) * target_scale
    for step in range(5):
        h = x
        for blk in range(d.shape.num_blocks):
            a, u = h @ params[0][blk].t(), h @ params[1][blk].t()
            h = h + (torch.nn.functional.silu(a) * u) @ params[2][blk].t()
        loss = torch.nn.functional.mse_loss(h, t)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        if step == 2:  # growth moves the state: the update must follow it
            d.alloc()
            assert d.capacity == 2
        res = d.train_step(torch.tensor([s] * 6), x, t)
        torch.testing.assert_close(res.losses[0], loss.detach(), rtol=1e-5, atol=1e-6)
    ref = torch.cat([p.detach().reshape(-1) for p in params])
    torch.testing.assert_close(d.theta[s], ref, rtol=1e-5, atol=1e-6)


# -- config ---------------------------------------------------------------------------
def test_config_validation():
    assert ESampConfig().beta == 0.25 and ESampConfig().mode == "auto"
    with pytest.raises(ValidationError, match=r"beta\s+Input should be greater than or equal to 0"):
        ESampConfig(beta=-0.1)
    with pytest.raises(ValidationError, match="max_groups"):
        ESampConfig(max_groups=0)
    with pytest.raises(ValidationError, match="identity"):
        ESampConfig(source_layer=3, target_layer=3)
    with pytest.raises(ValidationError):
        ESampConfig(betta=0.3)
    with pytest.raises(ValidationError):
        ESampConfig(mode="everything")
    assert ESampConfig(target_layer=-1, grad_clip=None).target_layer == -1


# -- consumer with fake runtime objects ------------------------------------------------
class Fake:
    """A tiny model and runtime stand-in: 4 layers, a random linear head."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(V, H, generator=g)
        self.model = ModelInfo(
            hidden_size=H,
            num_layers=4,
            vocab_size=V,
            dtype=torch.float32,
            device=torch.device("cpu"),
            lm_head=lambda z: z @ self.w.t(),
            lm_head_weight=self.w,
        )
        self.gen = g

    def consumer(self, cuda_path: bool | None = None, **cfg) -> ESampConsumer:
        cfg.setdefault("intermediate_size", INTER)
        ctx = ConsumerContext(self.model, lambda i: resolve_layer(i, 4))
        return ESampConsumer(ESampConfig(**cfg), ctx, cuda_path=cuda_path)

    @staticmethod
    def requests(prompts: int, n: int) -> list[RequestInfo]:
        return [RequestInfo(f"{p}-{s}", f"r{p}", p, s, 3) for p in range(prompts) for s in range(n)]

    def step(self, reqs, decode=None, h1=None, hl=None):
        r = len(reqs)
        decode = np.ones(r, bool) if decode is None else np.asarray(decode)
        rows = RowInfo(
            np.arange(r),
            list(reqs),
            np.full(r, 5),
            decode,
            np.zeros(r, bool),
            torch.zeros(r, dtype=torch.long),
        )
        h1 = torch.randn(r, H, generator=self.gen) if h1 is None else h1
        hl = torch.randn(r, H, generator=self.gen) if hl is None else hl
        return rows, {"layer.0": h1, "final": hl}

    @staticmethod
    def view(rows, hidden, logits, is_random=None, filtered=True, temp=0.8):
        r = len(rows)
        is_random = np.ones(r, bool) if is_random is None else np.asarray(is_random)
        return GuideView(
            0, rows, logits.clone(), torch.full((r,), temp), is_random, filtered, hidden
        )


@pytest.mark.parametrize("cpu_update", ["inline", "thread"])
def test_consumer_end_to_end_counters_and_freeing(cpu_update):
    fake = Fake()
    c = fake.consumer(cpu_update=cpu_update)
    assert c.name == "esamp" and c.writes() == [SamplerGuide()]
    assert {p.layer for p in c.reads()} == {0, "final"}
    reqs = fake.requests(prompts=2, n=3)
    for t in range(6):
        decode = [t > 0] * len(reqs)  # first step: the last prefill rows
        rows, hidden = fake.step(reqs, decode)
        logits = _filtered_logits(len(reqs), V, keep=6, seed=t) / 0.8
        view = fake.view(rows, hidden, logits, is_random=[True] * 5 + [False])
        c.guide(view)
        if t == 0:
            assert torch.equal(view.logits, logits)  # prefill rows are never guided
        else:
            assert torch.equal(view.logits[5], logits[5])  # greedy row untouched
            assert not torch.equal(view.logits[:5], logits[:5])
            assert torch.equal(torch.isfinite(view.logits), torch.isfinite(logits))
        if t > 0:
            c.on_bundle(Bundle(t, rows, hidden))
    c.result()  # as Runtime.collect does: settles queued updates into the counters
    k = c.counters.snapshot()
    assert k["groups_created"] == 2 and k["groups_alive"] == 2
    assert k["decode_steps"] == 5 and k["optimizer_steps"] == 10 and k["rows_trained"] == 30
    assert k["rows_guided"] == 25 and k["candidates_guided"] == 25 * 6
    assert k["rows_skipped_prefill"] == 6 and k["rows_skipped_greedy"] == 5
    assert k["rows_skipped"] == 11 and k["rows_visited"] == 25
    # Measured at each prediction (test_staleness_sees_a_missed_update shows it can rise).
    assert k["staleness_max"] == 0
    assert k["loss_first"] > 0 and k["loss_last"] > 0 and k["loss_mean"] > 0
    assert k["memory_bytes_per_group"] > 0
    for r in reqs[:5]:
        c.on_request_finished(r)
    assert c.counters.get("groups_freed") == 1 and c.distiller.num_live == 1
    c.on_request_finished(reqs[5])
    c.on_request_finished(RequestInfo("ghost", "rx", 9, 0, 3))  # never delivered
    k = c.counters.snapshot()
    assert k["groups_freed"] == 2 and k["groups_alive"] == 0 and k["finished_unseen"] == 1
    res = c.result()
    json.dumps(res)
    assert res["loss_curve"][0][2] == 2 and len(res["loss_curve"]) == 5


def test_consumer_strict_staleness_training_changes_next_guidance():
    fake = Fake()
    for frozen in (False, True):
        c = fake.consumer(ablation="frozen" if frozen else "none", lr=1e-2)
        reqs = fake.requests(1, 2)
        rows, hidden = fake.step(reqs)
        logits = _filtered_logits(2, V, keep=8)
        outs = []
        for t in range(3):
            v = fake.view(rows, hidden, logits)
            c.guide(v)
            outs.append(v.logits)
            c.on_bundle(Bundle(t, rows, hidden))
        assert torch.equal(outs[0], outs[1]) == frozen
        assert (c.counters.get("optimizer_steps") == 0) == frozen


def test_consumer_beta_zero_runs_guidance_and_keeps_logits():
    fake = Fake()
    c = fake.consumer(beta=0.0)
    assert c.writes() == [SamplerGuide()]
    reqs = fake.requests(1, 2)
    rows, hidden = fake.step(reqs)
    logits = _filtered_logits(2, V, keep=8)
    v = fake.view(rows, hidden, logits)
    c.guide(v)
    assert torch.equal(v.logits, logits)
    # The path ran (both rows predicted) but no logit changed, and nothing was written.
    assert c.counters.get("rows_visited") == 2 and c.counters.get("rows_guided") == 0
    assert c.counters.get("candidates_guided") == 0 and v.guided_counts()[0] == 0
    assert not v.wrote  # so the runtime lets vLLM's own sampling call go on
    c.on_bundle(Bundle(1, rows, hidden))
    c.result()
    assert c.counters.get("optimizer_steps") == 1  # still learns (for the counters)


def test_consumer_group_cap_and_batch_scope():
    fake = Fake()
    c = fake.consumer(max_groups=1)
    reqs = fake.requests(2, 2)
    rows, hidden = fake.step(reqs)
    c.guide(fake.view(rows, hidden, _filtered_logits(4, V, keep=5)))
    c.on_bundle(Bundle(1, rows, hidden))
    c.result()  # training counters are final once the side thread's results are read back
    k = c.counters.snapshot()
    assert k["groups_created"] == 1 and k["rows_skipped_cap"] == 2
    assert k["train_rows_skipped_cap"] == 2 and k["rows_trained"] == 2
    for r in reqs[:2]:
        c.on_request_finished(r)
    rows, hidden = fake.step(reqs[2:])
    c.on_bundle(Bundle(2, rows, hidden))
    assert c.counters.get("groups_created") == 2 and c.distiller.num_live == 1

    b = fake.consumer(scope="batch")
    rows, hidden = fake.step(reqs)
    b.on_bundle(Bundle(1, rows, hidden))
    b.result()
    assert b.counters.get("groups_created") == 1 and b.counters.get("rows_trained") == 4
    for r in reqs:
        b.on_request_finished(r)
    assert b.counters.get("groups_freed") == 1


def _samples(n: int, **extra) -> list[RequestInfo]:
    """The ``n`` samples of prompt r0, tagged with their number as TllmLLM and tllm serve do."""
    return [RequestInfo(f"0-{s}", "r0", 0, s, 3, {"tllm_n": n, **extra}) for s in range(n)]


def _train(fake, c, reqs, step=1):
    rows, hidden = fake.step(reqs)
    c.on_bundle(Bundle(step, rows, hidden))
    c.result()  # the update settled


def test_late_sibling_continues_its_groups_distiller():
    fake = Fake()
    c = fake.consumer(cpu_update="inline")
    reqs = _samples(3)
    _train(fake, c, reqs[:2])  # the third still waits to be scheduled
    slot = c.groups.by_key["r0"].slot
    trained = _state(c.distiller, slot)
    for r in reqs[:2]:
        c.on_request_finished(r)
    assert c.counters.get("groups_freed") == 0 and _same(_state(c.distiller, slot), trained)
    _train(fake, c, reqs[2:], step=2)
    assert c.counters.get("groups_created") == 1 and c.groups.by_key["r0"].slot == slot
    assert c.counters.get("optimizer_steps") == 2 and c.groups.by_key["r0"].age == 2
    c.on_request_finished(reqs[2])
    k = c.counters.snapshot()
    assert k["groups_freed"] == 1 and k["groups_alive"] == 0 and not c.groups.by_key


@pytest.mark.parametrize("aborted_first", [True, False])
def test_sibling_aborted_unseen_does_not_keep_the_slot(aborted_first):
    fake = Fake()
    c = fake.consumer(cpu_update="inline")
    reqs = _samples(3)
    if aborted_first:  # before its group exists (its siblings not scheduled yet)
        c.on_request_finished(reqs[2])
    _train(fake, c, reqs[:2])
    if not aborted_first:
        c.on_request_finished(reqs[2])
    for r in reqs[:2]:
        c.on_request_finished(r)
    k = c.counters.snapshot()
    assert k["finished_unseen"] == 1 and k["groups_freed"] == 1 and k["groups_alive"] == 0
    assert not c.groups.by_key and not c.groups.idle and not c.groups.early


@pytest.mark.parametrize("growable", [False, True])  # at max_groups; instead of growing
def test_waiting_group_yields_at_the_cap_and_after_wait_s(monkeypatch, growable):
    from algorithms.esamp import lifecycle

    fake = Fake()
    c = fake.consumer(cpu_update="inline", **({} if growable else {"max_groups": 1}))
    more = c.distiller.capacity - 1 if growable else 0  # other live groups: all slots taken
    reqs = _samples(3)
    _train(fake, c, reqs[:2] + [RequestInfo(f"f{i}", f"f{i}", 9, 0, 3) for i in range(more)])
    for r in reqs[:2]:
        c.on_request_finished(r)  # r0 waits for its third sample
    other, size = RequestInfo("1-0", "r1", 1, 0, 3, {"tllm_n": 1}), c.distiller.capacity
    _train(fake, c, [other], step=2)  # a new group takes r0's slot
    k = c.counters.snapshot()
    assert k["groups_created"] == 2 + more and k["groups_freed"] == 1
    assert k["rows_skipped_cap"] == 0 and c.distiller.capacity == size
    assert "r0" not in c.groups.by_key and c.groups.freed == [0]
    c.on_request_finished(other)
    assert c.counters.get("groups_freed") == 2 and c.groups.freed == []
    c = fake.consumer(cpu_update="inline")  # no cap: a third never scheduled, WAIT_S at most
    _train(fake, c, reqs[:2])
    for r in reqs[:2]:
        c.on_request_finished(r)
    _train(fake, c, [other], step=2)
    assert c.counters.get("groups_freed") == 0 and list(c.groups.idle) == ["r0"]
    monkeypatch.setattr(lifecycle, "WAIT_S", -1.0)
    _train(fake, c, [other], step=3)
    assert c.counters.get("groups_freed") == 1 and list(c.groups.by_key) == ["r1"]


def test_group_refused_a_slot_does_not_wait_nor_yield():
    fake = Fake()
    c = fake.consumer(cpu_update="inline", max_groups=1)
    hold, reqs = RequestInfo("h", "h", 9, 0, 3), _samples(3)
    _train(fake, c, [hold] + reqs[:2])  # h takes the only slot; r0 is refused one
    for r in reqs[:2]:
        c.groups.finish(r)  # not via the consumer, which takes ``freed`` at once
    assert not c.groups.idle and not c.groups.freed and c.groups.early == {"r0": 2}
    _train(fake, c, [RequestInfo("1-0", "r1", 1, 0, 3, {"tllm_n": 1})], step=2)
    assert c.groups.freed == [] and c.counters.get("train_rows_skipped_cap") == 3
    _train(fake, c, reqs[2:], step=3)  # the late sibling's group counts the two
    c.on_request_finished(reqs[2])
    assert list(c.groups.by_key) == ["h", "r1"] and not c.groups.early


@pytest.mark.parametrize("how", ["cap", "wait_s"])
def test_late_sibling_of_a_freed_waiting_group_does_not_wait(monkeypatch, how):
    from algorithms.esamp import lifecycle

    fake = Fake()
    c = fake.consumer(cpu_update="inline", **({"max_groups": 1} if how == "cap" else {}))
    reqs = _samples(3)
    _train(fake, c, reqs[:2])
    for r in reqs[:2]:
        c.on_request_finished(r)
    if how == "wait_s":
        monkeypatch.setattr(lifecycle, "WAIT_S", -1.0)
    other = RequestInfo("1-0", "r1", 1, 0, 3, {"tllm_n": 1})
    _train(fake, c, [other], step=2)  # r0 yields its slot, or its wait expires
    c.on_request_finished(other)
    assert c.counters.get("groups_freed") == 2 and c.groups.early == {"r0": 2}
    _train(fake, c, reqs[2:], step=3)
    c.on_request_finished(reqs[2])  # the last of three: freed, not waiting another WAIT_S
    k = c.counters.snapshot()
    assert k["groups_freed"] == 3 and k["groups_alive"] == 0 and not c.groups.idle


@pytest.mark.parametrize(
    "extra, scope, waits",
    [
        ({"tllm_group": "pool"}, "group", False),  # a caller's group may pool prompts
        ({"tllm_group": "request/x-abc"}, "group", True),  # tllm serve's own group
        ({}, "batch", False),
    ],
)
def test_waiting_for_siblings_only_in_a_prompts_own_group(extra, scope, waits):
    fake = Fake()
    c = fake.consumer(cpu_update="inline", scope=scope)
    reqs = _samples(3, **extra)
    _train(fake, c, reqs[:2])
    for r in reqs[:2]:
        c.on_request_finished(r)
    assert c.counters.get("groups_freed") == (0 if waits else 1)


def test_consumer_latent_full_vocab_matches_logits_mode():
    fake = Fake()
    reqs = fake.requests(1, 3)
    rows, hidden = fake.step(reqs)
    temp = 0.7
    ref = fake.model.lm_head(hidden["final"]) / temp
    outs = {}
    for mix in ("logits", "latent"):
        c = fake.consumer(mode="full_vocab", mix=mix)
        v = fake.view(rows, hidden, ref, filtered=False, temp=temp)
        c.guide(v)
        outs[mix] = v.logits
    torch.testing.assert_close(outs["latent"], outs["logits"], rtol=1e-5, atol=1e-4)
    assert not torch.equal(outs["logits"], ref)


def test_consumer_noise_ablation_and_nonfinite_hidden():
    fake = Fake()
    c = fake.consumer(ablation="noise")
    reqs = fake.requests(1, 2)
    rows, hidden = fake.step(reqs)
    logits = _filtered_logits(2, V, keep=5)
    v = fake.view(rows, hidden, logits)
    c.guide(v)
    assert torch.isfinite(v.logits[torch.isfinite(logits)]).all()
    hidden["layer.0"][0, 0] = float("nan")
    v = fake.view(rows, hidden, logits)
    c.guide(v)
    assert torch.equal(v.logits[0], logits[0])  # non-finite prediction: row left as is
    c.on_bundle(Bundle(1, rows, hidden))
    c.result()
    assert c.counters.get("nonfinite_losses_skipped") == 1


def test_dense_fixed_capacity_update_equals_unpadded():
    """The CUDA-graph layout (every slot of the state computed in place, each on its own
    rows padded to a fixed row count, slots without rows and padded rows masked) gives the
    same update as the exact packing, and leaves the other slots bit for bit."""
    from esamp_kernel_helpers import train_dense

    torch.manual_seed(0)
    exact, dense = _distiller(), _distiller()
    slots = [exact.alloc() for _ in range(3)]
    assert [dense.alloc() for _ in range(3)] == slots
    dense.theta[dense.capacity - 1] += 1.0  # the slot in no group: must stay as it is
    before = dense.theta.clone()
    rows = torch.tensor([slots[0], slots[2], slots[0], slots[2], slots[2]])
    x, t = torch.randn(5, H), torch.randn(5, H)
    ref = exact.train_step(rows, x, t)
    pk, valid, xp, tp, mask = _dense_inputs(dense, rows, x, t, m=8)
    s_total = dense.theta.shape[0]
    applied = torch.zeros(s_total, dtype=torch.long)
    losses, ok = train_dense(
        dense.theta,
        dense.m,
        dense.v,
        dense.step,
        valid,
        xp,
        tp,
        mask,
        dense.shape,
        dense.hp,
        applied=applied,
    )
    assert ok.tolist() == valid.tolist() and applied.tolist() == valid.long().tolist()
    torch.testing.assert_close(losses[torch.from_numpy(pk.slots)], ref.losses)
    for s in slots:
        torch.testing.assert_close(dense.theta[s], exact.theta[s], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(dense.m[s], exact.m[s], rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(dense.v[s], exact.v[s], rtol=1e-5, atol=1e-12)
        assert torch.equal(dense.step[s], exact.step[s])
    for s in range(s_total):
        if not valid[s]:
            assert torch.equal(dense.theta[s], before[s]) and not dense.m[s].any()
            assert not dense.v[s].any() and dense.step[s] == 0


def test_dense_update_skips_nonfinite_slot_bit_for_bit():
    """A slot whose rows give a non-finite loss keeps its state exactly; the others train."""
    from esamp_kernel_helpers import train_dense

    d = _distiller(capacity=2)
    a, b = d.alloc(), d.alloc()
    mask, valid = torch.ones(2, 3, dtype=torch.bool), torch.ones(2, dtype=torch.bool)
    # One good step first, so the skipped slot has moments and a step count to keep.
    train_dense(d.theta, d.m, d.v, d.step, valid, *torch.randn(2, 2, 3, H), mask, d.shape, d.hp)
    xp, tp = torch.randn(2, 3, H), torch.randn(2, 3, H)
    xp[b, 0, 0] = float("nan")
    before = [t.clone() for t in (d.theta, d.m, d.v, d.step)]
    _, ok = train_dense(d.theta, d.m, d.v, d.step, valid, xp, tp, mask, d.shape, d.hp)
    assert ok.tolist() == [True, False]
    for now, then in zip((d.theta, d.m, d.v, d.step), before, strict=True):
        assert torch.equal(now[b], then[b])
        assert not torch.equal(now[a], then[a])


def test_growth_under_inference_mode_keeps_state_trainable():
    # vLLM runs sampling (and so consumer callbacks) under torch.inference_mode.
    d = GroupedDistiller(8, intermediate_size=4, capacity=2)
    with torch.inference_mode():
        slots = [d.alloc() for _ in range(5)]  # grows twice
        x = torch.randn(5, 8)
        res = d.train_step(torch.tensor(slots), x, x.flip(0))
    assert bool(res.updated.all()) and not d.theta.is_inference()


def test_side_thread_updates_equal_inline_updates():
    """CPU side-thread training: same math and order as inline, so the same state."""
    torch.manual_seed(0)
    inline, side = _distiller(capacity=2), _distiller(capacity=2, side_thread=True)
    assert side.asynchronous and not inline.asynchronous
    gen = torch.Generator().manual_seed(1)
    for step in range(12):
        if step == 4:  # slot churn and growth are ordered with the queued updates
            for d in (inline, side):
                d.free(0)
                d.alloc(), d.alloc(), d.alloc()
        if step == 0:
            for d in (inline, side):
                d.alloc(), d.alloc()
        live = inline.live_slots
        slots = torch.tensor([live[i % len(live)] for i in range(7)])
        x, t = torch.randn(7, H, generator=gen), torch.randn(7, H, generator=gen) * 3
        y_inline, y_side = inline.predict(slots, x), side.predict(slots, x)
        torch.testing.assert_close(y_side, y_inline, rtol=1e-5, atol=1e-5)
        r_inline, r_side = inline.train_step(slots, x, t), side.train_step(slots, x, t)
    side.synchronize()
    torch.testing.assert_close(r_side.losses, r_inline.losses, rtol=1e-5, atol=1e-6)
    assert r_side.updated.all()
    torch.testing.assert_close(side.theta, inline.theta, rtol=1e-5, atol=1e-6)
    assert torch.equal(side.step, inline.step)
    side.close()


def test_side_thread_error_surfaces_on_the_engine_thread():
    from algorithms.esamp.cpu import SideThread

    st = SideThread()
    ran = []
    st.submit(lambda: 1 / 0)
    st.submit(lambda: ran.append(1))  # skipped: the owner has not seen the failure yet
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        st.wait()
    st.submit(lambda: ran.append(2))
    st.wait()
    assert ran == [2]
    st.close()


def test_consumer_side_thread_counters_settle_in_result():
    fake = Fake()
    c = fake.consumer(cpu_update="thread")
    assert c.distiller.asynchronous
    reqs = fake.requests(prompts=2, n=2)
    for _ in range(3):
        rows, hidden = fake.step(reqs)
        c.on_bundle(Bundle(0, rows, hidden))
    res = c.result()
    assert res["counters"]["optimizer_steps"] == 6
    assert c.counters.snapshot()["optimizer_steps"] == 6
    c.close()


@pytest.mark.parametrize("cpu_update", ["inline", "thread"])
def test_consumer_sparse_post_filter_equals_dense_reference(cpu_update):
    """The consumer's sparse candidate write equals the spec's mix written out densely
    (``(1+b) l - b (W f) / T`` on the candidates), per-request betas included, and leaves
    non-candidates and other rows untouched."""
    fake = Fake()
    c = fake.consumer(beta=0.5, cpu_update=cpu_update)
    reqs = fake.requests(prompts=2, n=2)
    reqs[2].extra_args = {"tllm_esamp_beta": 1.5}
    rows, hidden = fake.step(reqs)
    logits = _filtered_logits(4, V, keep=7, seed=3) / 0.7
    view = fake.view(rows, hidden, logits, is_random=[True, True, True, False], temp=0.7)
    c.guide(view)
    idx = torch.tensor([0, 1, 2])
    slots = torch.tensor([c.groups.by_key["r0"].slot] * 2 + [c.groups.by_key["r1"].slot])
    f = c.distiller.predict(slots, hidden["layer.0"][idx]).double()
    b = torch.tensor([0.5, 0.5, 1.5], dtype=torch.float64)[:, None]
    ref = logits[idx].double()
    expect = (1 + b) * ref - b * (f @ fake.w.double().t()) / 0.7
    expect = torch.where(torch.isfinite(ref), expect, ref).float()
    torch.testing.assert_close(view.logits[idx], expect, rtol=1e-5, atol=1e-5)
    assert torch.equal(view.logits[3], logits[3])  # greedy row
    assert c.counters.get("rows_guided") == 3 and c.counters.get("candidates_guided") == 21
    c.close()


@pytest.mark.parametrize("cap", [64, 4])
def test_sync_free_candidate_mix_equals_the_exact_one_up_to_its_cap(cap, caplog):
    """The CUDA branch's fixed-size search (GuideView.top_candidates) mixes the same values
    as the exact search while a row has at most cuda_max_candidates candidates; past it, a
    guided row's lowest candidates are dropped (-inf) and counted in candidates_over_cap."""
    caplog.set_level("WARNING", logger="tllm")
    fake = Fake()
    reqs = fake.requests(prompts=2, n=3)
    reqs[2].extra_args = {"tllm_esamp_beta": 1.5}
    reqs[4].extra_args = {"tllm_esamp_beta": 0.0}
    rows, hidden = fake.step(reqs)
    logits = _filtered_logits(6, V, keep=7, seed=11) / 0.7
    out = {}
    for branch in ("exact", "top"):
        c = fake.consumer(beta=0.5, cuda_max_candidates=cap, cuda_path=branch == "top")
        view = fake.view(rows, hidden, logits, is_random=[True] * 5 + [False], temp=0.7)
        c.guide(view)
        out[branch] = (view.logits.clone(), c.result()["counters"])
        c.close()
    (exact, k_exact), (top, k_top) = out["exact"], out["top"]
    if cap >= 7:
        torch.testing.assert_close(top, exact, rtol=1e-6, atol=1e-6)
        assert k_top["candidates_over_cap"] == 0
    else:
        kept = logits.topk(cap, dim=-1).indices  # each row's cap highest: mixed
        mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, kept, True)
        torch.testing.assert_close(top[mask], exact[mask], rtol=1e-6, atol=1e-6)
        tail = ~mask[:4] & torch.isfinite(logits[:4])  # the guided rows' other candidates
        assert tail.sum() == 4 * (7 - cap) and torch.isneginf(top[:4][tail]).all()
        assert k_top["candidates_over_cap"] == 4 * (7 - cap)  # 4 mixed rows (beta > 0)
    assert torch.equal(top[4:], logits[4:])  # beta 0 and greedy rows: every candidate kept
    assert k_exact["candidates_over_cap"] == 0
    assert k_top["rows_guided"] == k_exact["rows_guided"] == 4
    assert k_top["candidates_guided"] == k_exact["candidates_guided"] == 4 * 7  # mixed + dropped
    dropped_logged = [r for r in caplog.records if "past cuda_max_candidates" in r.getMessage()]
    assert len(dropped_logged) == (1 if cap < 7 else 0)  # once, at the read-back


def test_train_step_reuses_the_prediction_forward_only_when_valid(monkeypatch):
    """predict -> train_step on the same rows skips the training forward (same result as a
    distiller that never predicted); any other rows or changed parameters recompute it."""
    import algorithms.esamp.cpu as dist

    calls = []
    real = dist.forward_acts
    monkeypatch.setattr(dist, "forward_acts", lambda *a: calls.append(1) or real(*a))
    reuse, fresh = _distiller(capacity=2), _distiller(capacity=2)
    for d in (reuse, fresh):
        d.alloc(), d.alloc()
    gen = torch.Generator().manual_seed(3)
    slots = torch.tensor([0, 1, 0, 1, 1])
    for step in range(4):
        x, t = torch.randn(5, H, generator=gen), torch.randn(5, H, generator=gen)
        reuse.predict(slots, x)
        calls.clear()
        if step == 2:  # different rows than predicted: recomputed
            x = x + 1
        r_reuse = reuse.train_step(slots, x, t)
        assert len(calls) == (1 if step == 2 else 0)  # one batched forward for both groups
        r_fresh = fresh.train_step(slots, x, t)
        torch.testing.assert_close(r_reuse.losses, r_fresh.losses, rtol=0, atol=0)
        torch.testing.assert_close(reuse.theta, fresh.theta, rtol=0, atol=0)
    # A second train step has no saved forward (the parameters changed): recomputed.
    reuse.predict(slots, x)
    reuse.train_step(slots, x, t)
    calls.clear()
    reuse.train_step(slots, x, t)
    assert len(calls) == 1


# -- counters measured where the work happens --------------------------------------------
@pytest.mark.parametrize("mode", ["post_filter", "full_vocab"])
def test_rows_guided_counts_only_rows_whose_logits_changed(mode):
    """beta 0 rows and rows with a non-finite prediction are visited but not guided: nothing
    is written back for them; beta > 0 rows are guided and their candidates counted."""
    fake = Fake()
    reqs = fake.requests(prompts=3, n=1)
    reqs[1].extra_args = {"tllm_esamp_beta": 0.0}
    rows, hidden = fake.step(reqs)
    hidden["layer.0"][2, 0] = float("nan")  # row 2: non-finite prediction
    logits = _filtered_logits(3, V, keep=6, seed=5)
    c = fake.consumer(beta=0.5, mode=mode)
    v = fake.view(rows, hidden, logits, filtered=mode == "post_filter")
    c.guide(v)
    k = c.counters.snapshot()
    assert k["rows_visited"] == 3 and k["rows_guided"] == 1
    assert k["candidates_guided"] == 6  # row 0's candidates (full_vocab: the finite ones)
    assert not torch.equal(v.logits[0], logits[0])
    assert torch.equal(v.logits[1:], logits[1:])
    assert v.guided_counts()[0] == 1  # the view saw writes to row 0 only


def test_training_counters_count_only_steps_and_rows_really_trained():
    fake = Fake()
    reqs = fake.requests(prompts=2, n=2)
    # Frozen: rows selected, nothing trained.
    c = fake.consumer(ablation="frozen")
    rows, hidden = fake.step(reqs)
    c.on_bundle(Bundle(1, rows, hidden))
    c.result()
    k = c.counters.snapshot()
    assert k["train_rows_skipped_frozen"] == 4
    assert k["decode_steps"] == 0 and k["rows_trained"] == 0 and k["optimizer_steps"] == 0
    # One group's rows are non-finite: only the other group's rows count as trained.
    c = fake.consumer(cpu_update="inline")
    rows, hidden = fake.step(reqs)
    hidden["layer.0"][0, 0] = float("nan")  # group r0
    c.on_bundle(Bundle(1, rows, hidden))
    k = c.counters.snapshot()
    assert k["nonfinite_losses_skipped"] == 1 and k["optimizer_steps"] == 1
    assert k["rows_trained"] == 2 and k["decode_steps"] == 1
    # A step where every group is skipped is no training step.
    rows, hidden = fake.step(reqs)
    hidden["layer.0"][:, 0] = float("nan")
    c.on_bundle(Bundle(2, rows, hidden))
    k = c.counters.snapshot()
    assert k["nonfinite_losses_skipped"] == 3
    assert k["rows_trained"] == 2 and k["decode_steps"] == 1


def test_fixed_capacity_distiller_skips_new_groups_as_cap():
    """The CUDA distiller never grows: a group arriving with every slot live is skipped
    (shown here with the CPU distiller marked fixed)."""
    fake = Fake()
    c = fake.consumer()
    c.distiller.growable = False
    cap = c.distiller.capacity
    reqs = fake.requests(prompts=cap + 1, n=1)
    rows, hidden = fake.step(reqs)
    c.guide(fake.view(rows, hidden, _filtered_logits(cap + 1, V, keep=5)))
    assert c.counters.get("groups_created") == cap and c.counters.get("rows_skipped_cap") == 1
    assert c.distiller.capacity == cap


def _gate_side_thread(d: GroupedDistiller):
    """Hold the side thread until the returned event is set."""
    import threading

    gate = threading.Event()
    d._side.submit(gate.wait)
    return gate


@pytest.mark.parametrize("broken", [False, True])
def test_staleness_sees_a_missed_update(broken, monkeypatch):
    """staleness_max compares the updates submitted for a slot with those processed when a
    prediction reads it: strict ordering reads 0; a prediction that skips the wait (the
    ordering broken on purpose) sees the queued update."""
    d = _distiller(side_thread=True)
    s = d.alloc()
    x = torch.randn(3, H)
    gate = _gate_side_thread(d)
    d.train_step(torch.tensor([s] * 3), x, x + 1)
    if broken:
        monkeypatch.setattr(d, "_wait_side", lambda: None)
    else:
        gate.set()
    d.predict(torch.tensor([s]), x[:1])
    assert d.staleness_max() == (1 if broken else 0)
    gate.set()
    d.close()


def test_consumer_reports_measured_staleness(monkeypatch):
    fake = Fake()
    c = fake.consumer(cpu_update="thread")
    reqs = fake.requests(1, 2)
    rows, hidden = fake.step(reqs)
    logits = _filtered_logits(2, V, keep=5)
    c.guide(fake.view(rows, hidden, logits))
    gate = _gate_side_thread(c.distiller)
    c.on_bundle(Bundle(1, rows, hidden))
    monkeypatch.setattr(c.distiller, "_wait_side", lambda: None)  # ordering broken
    c.guide(fake.view(rows, hidden, logits))
    gate.set()
    monkeypatch.undo()
    assert c.result()["counters"]["staleness_max"] == 1
    c.close()


def test_group_loss_state_stays_flat_over_many_finished_groups():
    """A server frees groups for ever: per-group loss state is kept only while a group may
    still report a loss, and the per-group means are still over every group (issue 26)."""
    fake = Fake()
    c = fake.consumer(cpu_update="inline")
    for g in range(40):
        (req,) = [RequestInfo(f"g{g}-0", f"g{g}", g, 0, 3)]
        rows, hidden = fake.step([req])
        c.guide(fake.view(rows, hidden, _filtered_logits(1, V, keep=6, seed=g) / 0.8))
        c.on_bundle(Bundle(g, rows, hidden))  # one optimizer step: first loss == last loss
        res = c.result()
        c.on_request_finished(req)
        assert len(c.losses._group_last) + len(c.losses._freed) <= 1
    res = c.result()
    assert c.losses._group_last == {} and c.losses._freed == set()
    assert c.counters.get("optimizer_steps") == 40
    # One step per group: the mean of firsts, of lasts and of all losses agree.
    assert res["group_loss_first_mean"] == pytest.approx(res["loss_mean"], rel=1e-9)
    assert res["group_loss_last_mean"] == pytest.approx(res["loss_mean"], rel=1e-9)


def test_group_loss_means_follow_each_groups_first_and_last_step():
    fake = Fake()
    c = fake.consumer(cpu_update="inline")
    (req,) = fake.requests(prompts=1, n=1)
    for t in range(4):
        rows, hidden = fake.step([req])
        c.guide(fake.view(rows, hidden, _filtered_logits(1, V, keep=6, seed=t) / 0.8))
        c.on_bundle(Bundle(t, rows, hidden))
    res = c.result()
    assert c.counters.get("optimizer_steps") == 4 and res["loss_first"] != res["loss_last"]
    assert res["group_loss_first_mean"] == pytest.approx(res["loss_first"], rel=1e-9)
    assert res["group_loss_last_mean"] == pytest.approx(res["loss_last"], rel=1e-9)


def test_side_thread_waits_are_bounded():
    import threading

    from algorithms.esamp.cpu import SideThread

    st = SideThread()
    gate = threading.Event()
    st.submit(lambda: gate.wait(30))  # a job that hangs
    with pytest.raises(RuntimeError, match=r"has not finished its jobs after 0 s \(1 still"):
        st.wait(timeout=0.2)
    st.close(timeout=0.2)  # returns, though the thread is still in the job
    assert st._thread.is_alive()
    gate.set()
    st.close()
    assert not st._thread.is_alive()


@pytest.mark.parametrize(
    ("cpu_update", "cuda_path"), [("inline", False), ("thread", False), ("inline", True)]
)
def test_consumer_returns_each_rows_error_the_loss_is_the_mean_of(cpu_update, cuda_path):
    """tllm_results=esamp: each asking request gets its decode rows' positions and errors;
    a group's logged loss at each step is the mean of its rows' errors (one group here: the
    loss curve is its losses). Deferred reads (the CUDA path's, the side thread's) are
    settled by request_result; a request that does not ask keeps nothing."""
    fake = Fake()
    c = fake.consumer(cpu_update=cpu_update, cuda_path=cuda_path)
    ask = {"tllm_results": "esamp"}
    reqs = [RequestInfo(f"0-{s}", "r0", 0, s, 3, dict(ask)) for s in range(3)]
    steps = 4
    for t in range(steps):
        rows, hidden = fake.step(reqs)
        rows.position[:] = 5 + t
        logits = _filtered_logits(len(reqs), V, keep=6, seed=t) / 0.8
        c.guide(fake.view(rows, hidden, logits))  # the update reuses this forward (CPU)
        c.on_bundle(Bundle(t, rows, hidden))
    if cuda_path:  # read back in batches: still in flight (the side thread's: may be)
        assert c.returned.waits_for("0-0")
    elif cpu_update == "inline":
        assert not c.returned.waits_for("0-0")
    got = []
    for r in reqs:
        c.on_request_finished(r)
        got.append(c.request_result(r))
    for g in got:
        assert g["positions"].tolist() == [5, 6, 7, 8]
        assert g["prediction_error"].dtype == np.float32
        assert np.isfinite(g["prediction_error"]).all() and (g["prediction_error"] > 0).all()
    errors = np.stack([g["prediction_error"] for g in got])  # [samples, steps]
    curve = c.result()["loss_curve"]
    assert [a for a, _, _ in curve] == list(range(steps))
    np.testing.assert_allclose(errors.mean(0), [m for _, m, _ in curve], rtol=1e-5)
    assert c.counters.get("rows_returned") == 3 * steps
    assert c.request_result(reqs[0])["positions"].size == 0  # taken once
    # A request that does not ask: trained on, nothing kept for it.
    other = RequestInfo("1-0", "r1", 1, 0, 3)
    rows, hidden = fake.step([other])
    c.on_bundle(Bundle(steps, rows, hidden))
    c.result()
    assert c.counters.get("rows_returned") == 3 * steps and not c.returned.waits_for("1-0")
    assert c.request_result(other)["positions"].size == 0
    c.close()


def test_an_unseen_siblings_finish_keeps_a_waiting_groups_start():
    """The wait for a sibling is WAIT_S from the seen samples' end: an unseen sibling's
    finish meanwhile (counted) does not start it again."""
    fake = Fake()
    c = fake.consumer(cpu_update="inline")
    reqs = _samples(4)
    _train(fake, c, reqs[:2])
    for r in reqs[:2]:
        c.on_request_finished(r)
    since = c.groups.idle["r0"].idle_since
    c.on_request_finished(reqs[2])  # never seen: counted, still waiting for the fourth
    assert c.groups.idle["r0"].idle_since == since and c.groups.by_key["r0"].done == 3

"""ESamp's loss reduction, optimizer statistics and f-noise ablation (CPU, no vLLM)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from esamp_kernel_helpers import train_dense
from test_esamp_math import INTER, Fake, H, _dense_inputs, _filtered_logits

from algorithms.esamp.cpu import GroupedDistiller
from algorithms.esamp.guidance import f_noise_prediction
from algorithms.esamp.kernels.op_loss_dy import loss_denominator
from algorithms.esamp.params import STATS, block_weights
from tllm_core.api.bundles import Bundle


def _dist(**kw) -> GroupedDistiller:
    kw.setdefault("intermediate_size", INTER)
    return GroupedDistiller(H, **kw)


def test_loss_denominator():
    rows = torch.tensor([0, 1, 3])
    assert loss_denominator(rows, H, "mean").tolist() == [1.0, H, 3.0 * H]
    assert loss_denominator(rows, H, "sum").tolist() == [1.0, 1.0, 3.0]
    with pytest.raises(ValueError):
        loss_denominator(rows, H, "max")


def _manual_stats(before, d: GroupedDistiller, slot: int, eps: float, x, t) -> list[float]:
    """eps share, mean |delta theta| / lr and the gradient norm from the state itself and
    autograd (no formula shared)."""
    b2 = d.hp.betas[1]
    n = float(d.step[slot])
    v_hat_sqrt = (d.v[slot] / (1 - b2**n)).sqrt()
    share = float((v_hat_sqrt < eps).float().mean())
    size = float((d.theta[slot] - before[slot]).abs().mean()) / d.hp.lr
    w = before[slot].clone().requires_grad_(True)
    h = x
    for gate, up, down in block_weights(w[None], d.shape):
        h = h + (F.silu(h @ gate[0].T) * (h @ up[0].T)) @ down[0].T
    loss = F.mse_loss(h, t)
    (g,) = torch.autograd.grad(loss, w)
    return [share, size, float(g.norm())]


@pytest.mark.parametrize("clip, clipped", [(1e-6, 1.0), (1e6, 0.0), (None, 0.0)])
@pytest.mark.parametrize("eps", [1e-4, 10.0])
def test_optimizer_stats_match_the_update(clip, clipped, eps):
    """Stats of both paths equal what the update did: its |delta theta| / lr, the share of
    sqrt(v_hat) < eps, and whether the gradient norm exceeded the clip."""
    torch.manual_seed(2)
    rows = torch.tensor([0, 1, 1, 0])
    host = _dist(optimizer_stats=True, grad_clip=clip, eps=eps)
    dense = _dist(optimizer_stats=True, grad_clip=clip, eps=eps)
    for d in (host, dense):
        d.alloc(), d.alloc()
    for _ in range(3):
        x, t = torch.randn(4, H), torch.randn(4, H) * 0.01
        before = host.theta.clone()
        res = host.train_step(rows, x, t)
        host.synchronize()
        pk, valid, xp, tp, mask = _dense_inputs(dense, rows, x, t)
        out = torch.full((dense.theta.shape[0], len(STATS)), float("nan"))
        train_dense(
            dense.theta, dense.m, dense.v, dense.step, valid, xp, tp, mask,
            dense.shape, dense.hp, stats=out,
        )  # fmt: skip
        for gi, slot in enumerate(pk.slots):
            sel = rows == int(slot)
            want = [clipped, *_manual_stats(before, host, slot, eps, x[sel], t[sel])]
            torch.testing.assert_close(res.stats[gi], torch.tensor(want), rtol=2e-3, atol=1e-6)
            torch.testing.assert_close(out[slot], res.stats[gi], rtol=1e-4, atol=1e-6)
    assert len(STATS) == 4
    # eps 10 dominates every denominator of these gradients, and so does 1e-4 once the
    # gradient is clipped to norm 1e-6; unclipped, 1e-4 does not dominate them all.
    share = float(res.stats[:, 1].mean())
    assert (share == 1.0) if eps == 10.0 or clip == 1e-6 else (share < 1.0)


def test_optimizer_stats_off_by_default():
    d = _dist()
    d.alloc()
    res = d.train_step(torch.tensor([0]), torch.randn(1, H), torch.randn(1, H))
    assert res.stats is None


def test_consumer_optimizer_counters():
    fake = Fake()
    c = fake.consumer(optimizer_stats=True, cpu_update="inline", grad_clip=1e-3)
    reqs = fake.requests(2, 2)
    for t in range(4):
        rows, hidden = fake.step(reqs)
        c.guide(fake.view(rows, hidden, _filtered_logits(4, 40, keep=5, seed=t)))
        c.on_bundle(Bundle(t, rows, hidden))
    out = c.result()
    k = c.counters.snapshot()
    assert k["optimizer_updates_measured"] == k["optimizer_steps"] == 8
    assert k["optimizer_clipped_updates"] == 8 and k["optimizer_clip_rate"] == 1.0
    assert 0.0 <= k["optimizer_eps_share"] <= 1.0 and k["optimizer_update_size"] > 0
    assert k["optimizer_grad_norm"] > 1e-3
    curve = out["optimizer_curve"]
    assert [row[0] for row in curve] == [0, 1, 2, 3] and all(row[-1] == 2 for row in curve)
    plain = fake.consumer(cpu_update="inline")
    rows, hidden = fake.step(reqs)
    plain.on_bundle(Bundle(0, rows, hidden))
    assert "optimizer_updates_measured" not in plain.counters.snapshot()
    assert plain.result()["optimizer_curve"] == []


def test_f_noise_prediction_keeps_row_norm():
    f = torch.randn(6, H)
    f[2] = 0.0
    g = torch.Generator().manual_seed(0)
    fake = f_noise_prediction(f, g)
    torch.testing.assert_close(fake.norm(dim=-1), f.norm(dim=-1))
    assert not torch.allclose(fake, f) and not fake[2].any()


def test_consumer_f_noise_keeps_sharpening_and_norm():
    """ablation f_noise: the mix is still (1+beta) ref - beta W f' / T, with ||f'|| = ||f||
    per row and f' != f (the learned direction is replaced, the sharpening kept)."""
    beta, temp = 0.5, 0.7
    fake = Fake()
    reqs = fake.requests(1, 3)
    rows, hidden = fake.step(reqs)
    ref = fake.model.lm_head(hidden["final"]) / temp
    f = {}
    for ablation in ("none", "f_noise"):
        c = fake.consumer(ablation=ablation, beta=beta, mode="full_vocab")
        v = fake.view(rows, hidden, ref, filtered=False, temp=temp)
        c.guide(v)
        dist = ((1 + beta) * ref - v.logits) * temp / beta  # = W f' if the form holds
        sol = torch.linalg.lstsq(fake.w, dist.t()).solution.t()
        torch.testing.assert_close(sol @ fake.w.t(), dist, rtol=1e-4, atol=1e-4)
        f[ablation] = sol
    torch.testing.assert_close(
        f["f_noise"].norm(dim=-1), f["none"].norm(dim=-1), rtol=1e-4, atol=1e-4
    )
    assert not torch.allclose(f["f_noise"], f["none"], atol=1e-2)

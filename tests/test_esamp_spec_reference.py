"""ESamp end to end against a reference written from the spec (shared/esamp-spec.md) and the
paper, not from the implementation: one ``nn.Module`` distiller per prompt group (two residual
gated-SwiGLU blocks, no biases), ``torch.optim.Adam(lr 4e-4, eps 1e-4)`` after
``clip_grad_norm_(0.5)`` on the squared error summed over hidden dimensions and averaged over
rows (``/ hidden`` for the default ``loss_reduction: "mean"``), one step per group after each
decode step on all its decode rows (greedy ones too); guidance on random-sampling decode rows
only, ``(1 + b) ref - b W f(h_1) / T`` with ``f`` trained through the previous step; a group
created at its first decode row, freed with its last request, and a later group starting from
the initial weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from algorithms.esamp.config import ESampConfig
from algorithms.esamp.consumer import ESampConsumer
from algorithms.esamp.params import split_params
from tllm_core.api.bundles import Bundle, GuideView
from tllm_core.api.consumer import ConsumerContext, ModelInfo
from tllm_core.api.ports import resolve_layer
from tllm_core.api.rows import RequestInfo, RowInfo

H, V, INTER, TEMP = 16, 40, 8, 0.7


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, INTER, bias=False)
        self.up = nn.Linear(H, INTER, bias=False)
        self.down = nn.Linear(INTER, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class RefGroup:
    """The spec's distiller and optimizer for one group, from the consumer's initial weights."""

    def __init__(self, template: torch.Tensor, cfg: ESampConfig):
        self.f = nn.Sequential(Block(), Block()).double()
        gate, up, down = split_params(template[None].double(), _shape())
        with torch.no_grad():
            for b, blk in enumerate(self.f):
                blk.gate.weight.copy_(gate[0, b])
                blk.up.weight.copy_(up[0, b])
                blk.down.weight.copy_(down[0, b])
        self.cfg = cfg
        self.opt = torch.optim.Adam(self.f.parameters(), lr=cfg.lr, eps=cfg.eps)

    def train(self, x: torch.Tensor, y: torch.Tensor) -> float:
        err = (self.f(x) - y).pow(2).sum(-1).mean()  # the paper's loss
        loss = err / H if self.cfg.loss_reduction == "mean" else err
        self.opt.zero_grad()
        loss.backward()
        if self.cfg.grad_clip is not None:
            nn.utils.clip_grad_norm_(self.f.parameters(), self.cfg.grad_clip)
        self.opt.step()
        return float(loss.detach())

    def params(self) -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in self.f.parameters()])


def _shape():
    from algorithms.esamp.params import DistillerShape

    return DistillerShape(H, INTER, 2)


def _slot_params(c: ESampConsumer, slot: int) -> torch.Tensor:
    gate, up, down = split_params(c.distiller.theta[slot][None].double(), _shape())
    return torch.cat([t.flatten() for b in range(2) for t in (gate[0, b], up[0, b], down[0, b])])


def _model(seed: int) -> tuple[torch.Generator, torch.Tensor, ModelInfo]:
    """A model of H hidden and V tokens whose head is a random matrix ``w``, and the
    generator that drew it (the test draws its rows from it next)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g)
    model = ModelInfo(
        hidden_size=H,
        num_layers=4,
        vocab_size=V,
        dtype=torch.float32,
        device=torch.device("cpu"),
        lm_head=lambda z: z @ w.t(),
        lm_head_weight=w,
    )
    return g, w, model


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"loss_reduction": "sum", "mode": "full_vocab"},
        {"cpu_update": "thread", "beta": 0.6, "grad_clip": None},
        {"loss_reduction": "sum", "grad_clip": None},
        {"cuda_path": True},  # the CUDA guidance (fixed-size candidates, workspace) on CPU
        {"cuda_path": True, "mode": "full_vocab", "beta": 0.6},
    ],
)
def test_consumer_matches_the_spec_reference_step_by_step(cfg):
    cfg = dict(cfg)
    g, w, model = _model(seed=0)
    cuda_path = cfg.pop("cuda_path", None)
    config = ESampConfig(intermediate_size=INTER, **{"cpu_update": "inline", **cfg})
    ctx = ConsumerContext(model, lambda i: resolve_layer(i, 4))
    c = ESampConsumer(config, ctx, cuda_path=cuda_path)
    template = c.distiller.template.clone()

    def req(p: int, s: int) -> RequestInfo:
        return RequestInfo(f"{p}-{s}", f"r{p}", p, s, 3)

    # (request, greedy, first step in decode, last step it runs)
    plan = [(req(0, s), False, 1, 4) for s in range(3)]
    plan += [(req(1, 0), False, 1, 9), (req(1, 1), True, 1, 9)]
    plan += [(req(2, s), False, 3, 9) for s in range(2)]  # its prefill is step 2: a mixed step
    plan += [(req(3, s), False, 6, 9) for s in range(3)]  # after group 0 is freed: slot reused
    ref: dict[str, RefGroup] = {}
    for t in range(10):
        live = [(r, gr, d) for r, gr, d, last in plan if d - 1 <= t <= last]
        reqs = [r for r, *_ in live]
        n = len(reqs)
        decode = np.array([t >= d for _, _, d in live])
        rows = RowInfo(
            np.arange(n), reqs, np.full(n, 5 + t), decode, np.zeros(n, bool), torch.zeros(n)
        )
        h1 = torch.randn(n, H, generator=g) * 3
        hl = torch.randn(n, H, generator=g) * 3 + h1[:, :1]
        hidden = {"layer.0": h1, "final": hl}
        raw = torch.randn(n, V, generator=g) * 2
        if config.mode != "full_vocab":  # a top-6 filter, as vLLM's sampler leaves them
            raw = raw.masked_fill(raw < raw.topk(6, -1).values[:, -1:], float("-inf"))
        random = np.array([not gr for _, gr, _ in live])
        view = GuideView(
            t, rows, raw / TEMP, torch.full((n,), TEMP), random, config.mode != "full_vocab", hidden
        )
        for r, dec in zip(reqs, decode, strict=True):  # a group exists from its first decode row
            if dec and r.request_id not in ref:
                ref[r.request_id] = RefGroup(template, config)
        expect = raw.double() / TEMP
        for i, r in enumerate(reqs):
            if decode[i] and random[i]:
                with torch.no_grad():
                    dist = w.double() @ ref[r.request_id].f(h1[i].double())
                mixed = (1 + config.beta) * raw[i].double() - config.beta * dist
                expect[i] = torch.where(torch.isfinite(raw[i]), mixed / TEMP, expect[i])
        c.guide(view)
        torch.testing.assert_close(view.logits.double(), expect, rtol=1e-5, atol=1e-5)
        c.on_bundle(Bundle(t, rows, hidden))
        for key, grp in ref.items():  # one step per group, on all its decode rows
            mine = [i for i, r in enumerate(reqs) if decode[i] and r.request_id == key]
            if mine:
                grp.train(h1[mine].double(), hl[mine].double())
        c.trainer.flush()
        for key, grp in ref.items():
            slot = c.groups.by_key[key].slot
            torch.testing.assert_close(_slot_params(c, slot), grp.params(), rtol=0, atol=2e-6)
        for r, _, _, last in plan:
            if last == t:
                c.on_request_finished(r)
                if not c.groups.by_key.get(r.request_id):
                    ref.pop(r.request_id, None)
    k = c.result()["counters"]
    assert k["groups_created"] == 4 and k["groups_freed"] == 4
    # group 0: 3 rows x 4 steps; group 1: 2 x 9; group 2: 2 x 7; group 3: 3 x 4
    assert k["rows_trained"] == 12 + 18 + 14 + 12
    c.close()


def test_a_sample_still_in_prefill_keeps_its_groups_distiller():
    """The spec frees a group's distiller "when its last request finishes": a sample whose
    prefill is still running (chunked prefill) when its siblings finish joins the distiller
    they trained, not a fresh one."""
    g, w, model = _model(seed=1)
    config = ESampConfig(intermediate_size=INTER, cpu_update="inline")
    c = ESampConsumer(config, ConsumerContext(model, lambda i: resolve_layer(i, 4)))
    a, b = (RequestInfo(f"{s}-r0", "r0", 0, s, 3) for s in range(2))
    # step 0: a's last prefill chunk; 1: a decodes, b mid-prefill; 2: a decodes, b's last
    # prefill chunk; a finishes; 3: b decodes
    for t, reqs, decode in [(0, [a], [0]), (1, [a, b], [1, 0]), (2, [a, b], [1, 0]), (3, [b], [1])]:
        n = len(reqs)
        rows = RowInfo(np.arange(n), reqs, np.full(n, 5 + t), np.array(decode, bool),
                       np.zeros(n, bool), torch.zeros(n))  # fmt: skip
        hidden = {
            "layer.0": torch.randn(n, H, generator=g),
            "final": torch.randn(n, H, generator=g),
        }
        logits = torch.randn(n, V, generator=g)
        c.guide(GuideView(t, rows, logits, torch.ones(n), np.ones(n, bool), False, hidden))
        c.on_bundle(Bundle(t, rows, hidden))
        if t == 2:
            c.on_request_finished(a)
    k = c.result()["counters"]
    assert k["groups_created"] == 1 and k["groups_freed"] == 0 and k["optimizer_steps"] == 3
    c.on_request_finished(b)
    assert c.counters.get("groups_freed") == 1 and c.counters.get("finished_unseen") == 0
    c.close()

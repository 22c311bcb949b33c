"""ESamp's whole decode step on CUDA, checked without a GPU (``tllm_core.testing.fake_cuda``):
the consumer's guidance (prediction, candidate mix) and its training submission at
Qwen2.5-7B's shapes (hidden 3584, vocabulary 152064, bf16), 8 prompts x 16 samples, in both
mixing modes, with ``beta_schedule`` constant and 'fit'. The step must not make the host wait
for the device nor copy from pageable memory, and the distiller's part must not allocate.
Each step's launches, bytes and allocations are printed (docs/results.md has them)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import algorithms.esamp.factory as factory
from algorithms.esamp.config import ESampConfig
from algorithms.esamp.consumer import ESampConsumer
from algorithms.esamp.cuda import CudaGroupedDistiller
from tllm_core.api.bundles import Bundle, GuideView
from tllm_core.api.consumer import ConsumerContext, ModelInfo
from tllm_core.api.ports import resolve_layer
from tllm_core.api.rows import RequestInfo, RowInfo
from tllm_core.testing.fake_cuda import FakeCuda

H, V, LAYERS = 3584, 152064, 28
PROMPTS, N = 8, 16


def _consumer(fc: FakeCuda, monkeypatch, **cfg) -> ESampConsumer:
    # The factory takes the CUDA path for device type 'cuda'; the fake device is 'meta'.
    monkeypatch.setattr(factory, "uses_gpu_path", lambda device: True)
    w = torch.zeros(V, H, dtype=torch.bfloat16, device=fc.device)
    model = ModelInfo(H, LAYERS, V, torch.bfloat16, fc.device, lambda z: z @ w.t(), w)
    ctx = ConsumerContext(model, lambda i: resolve_layer(i, LAYERS))
    return ESampConsumer(ESampConfig(**cfg), ctx)


def _rows(fc: FakeCuda) -> RowInfo:
    reqs = [RequestInfo(f"{p}-{s}", f"r{p}", p, s, 3) for p in range(PROMPTS) for s in range(N)]
    r = len(reqs)
    tokens = torch.zeros(r, dtype=torch.long, device=fc.device)
    return RowInfo(np.arange(r), reqs, np.full(r, 5), np.ones(r, bool), np.zeros(r, bool), tokens)


@pytest.mark.parametrize("fit", [False, True], ids=["constant", "fit"])
@pytest.mark.parametrize("mode", ["post_filter", "full_vocab"])
def test_esamp_decode_step_at_7b_shapes(monkeypatch, mode, fit):
    extra = {"beta_schedule": "fit"} if fit else {}
    with FakeCuda() as fc:
        c = _consumer(fc, monkeypatch, mode=mode, **extra)
        assert c.shared.on_cuda and isinstance(c.distiller, CudaGroupedDistiller)
        rows = _rows(fc)
        r = len(rows)

        def step(t: int) -> None:
            hidden = {
                key: torch.zeros(r, H, dtype=torch.bfloat16, device=fc.device)
                for key in ("layer.0", "final")
            }
            logits = torch.zeros(r, V, device=fc.device)
            temp = torch.ones(r, device=fc.device)
            view = GuideView(t, rows, logits, temp, np.ones(r, bool), mode == "post_filter", hidden)
            c.guide(view)
            view.commit()
            c.on_bundle(Bundle(t, rows, hidden))

        step(0)  # the groups' slots are allocated (host bookkeeping) and first plans sent
        fc.start_steps()
        for t in (1, 2):
            with fc.step():
                step(t)
        report = fc.report()["steps"]
    per_step = report["per_step"][-1]
    print(json.dumps({"mode": mode, "fit": fit, **{k: per_step[k] for k in sorted(per_step)}}))
    stalls = [f for f in fc.failures() if f.kind in ("host_wait", "pageable_copy")]
    assert not stalls, "\n".join(f"{f.kind} {f.where} {f.code}" for f in stalls)
    assert not fc.findings(kind="first_cublas")
    assert per_step["graph_replays"] == 2  # one predict, one update: the distiller's work
